"""`kvcheck fuzz --sut sglang`: SGLang's radix caches on the lockstep core (drivers.py)."""
from __future__ import annotations

import argparse
from pathlib import Path

from kvcheck.checker.common import UsageError, check_writable, emit, steering
from kvcheck.fuzz.campaign import Budget
from kvcheck.fuzz.known import parse_cli

from . import drivers as sg


def fuzz_command(args: argparse.Namespace) -> int:
    """SGLang's radix caches on the lockstep core (kvcheck/engines/sglang/)."""
    try:
        b = Budget.parse(args.budget)
        check_writable(Path(args.out))
        steer = steering(args, "sglang")
        res, text = sg.cli_fuzz(args.layout, args.layout_file, args.list_layouts, b.seconds, b.steps,
                                args.seed, args.fault, args.out, parse_cli(args.acknowledge),
                                bool(getattr(args, "strict_known", False)), steer)
    except (sg.SglangUnavailable, ValueError) as e:
        raise UsageError(str(e)) from None
    emit(args, res, lambda: text)
    return 0 if args.list_layouts else res["exit_code"]
