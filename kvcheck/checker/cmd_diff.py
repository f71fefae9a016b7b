"""`kvcheck diff --sut NAME`: reuse vs full recompute, by the registered engine's own driver
(the reference engine: bitwise over generated workloads; transformers: a model type's caches)."""
from __future__ import annotations

import argparse

from ..fuzz import registry
from ..fuzz.engine import Engine
from .common import UsageError, covering


def cmd_diff(args: argparse.Namespace) -> int:
    """Reuse vs full recompute on the engine `--sut` names."""
    if args.scenarios is None:
        args.scenarios = 200 if args.sut == "reference" else 20
    try:
        eng = registry.get(args.sut)
    except registry.UnknownEngine as e:
        raise UsageError(f"--sut: {e}") from None
    with covering(args, eng, "diff"):
        code = eng.diff_command(args)
    if code is None:
        have = [n for n, e in registry.engines().items() if type(e).diff_command is not Engine.diff_command]
        raise UsageError(f"--sut {args.sut}: the engine has no reuse-vs-recompute model "
                         f"(kvcheck diff runs on: {', '.join(have)})")
    return code
