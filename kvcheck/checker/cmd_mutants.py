"""`kvcheck mutants`: the fault matrix (engine table and scoring in mutants.py)."""
from __future__ import annotations

import argparse
import sys

from ..fuzz import faults as faultlib
from .common import UsageError, emit, load_config, progress


def cmd_mutants(args: argparse.Namespace) -> int:
    """The fault matrix: every fault, every engine that applies, caught by the expected check?"""
    from ..fuzz.campaign import Budget
    from ..fuzz.pool import cap_workers
    from .mutants import run_mutants
    cfg = load_config(args)
    try:
        budget = Budget.parse(args.budget_per_fault)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if budget.seconds is None:
        raise UsageError("--budget-per-fault must be a duration such as 30s")
    from .mutants import PROVIDERS
    for name in args.fault or []:
        f = faultlib.get(name)
        if f.provider not in PROVIDERS:
            raise UsageError(f"fault {name!r} is planted by --sut {' or '.join(f.suts)}; the mutants matrix "
                             f"runs {' and '.join(PROVIDERS)} faults (try `kvcheck fuzz --sut "
                             f"{f.suts[0]} --fault {name}`)")
    workers, note = cap_workers(args.workers)
    if note:
        print(f"kvcheck mutants: {note}", file=sys.stderr)

    def row_done(r: dict) -> None:      # each fault's verdict as it lands, on stderr
        cells = ", ".join(f"{e} {'OK' if x['expected_caught'] else 'other' if x['detected'] else 'miss'} "
                          f"{x['seconds']}s" for e, x in r["engines"].items())
        print(f"kvcheck mutants: {r['fault']}: {r['status']} ({cells})", file=sys.stderr, flush=True)

    with progress(args, "mutants") as bar:
        res = run_mutants(cfg, budget.seconds, args.seed, args.fault, progress=bar, on_row=row_done,
                          workers=workers)
    code = res["exit_code"]

    def text() -> str:
        lines = [f"kvcheck mutants: score {res['mutation_score']:.0%} ({res['killed']}/{res['scored']} "
                 f"killed by their expected check), negative control "
                 + ("clean" if res["negative_control_clean"] else "NOT CLEAN") + f" (exit {code})", ""]
        if res.get("interrupted"):
            lines[0] = (f"kvcheck mutants: INTERRUPTED after {len(res['faults'])} of "
                        f"{len(res['faults']) + len(res['not_run'])} faults (exit {code}); nothing is claimed")
            lines.append(f"  not run: {', '.join(res['not_run']) or 'none'}; the negative control "
                         "may be incomplete")
        engines = sorted({e for r in res["faults"] for e in r["engines"]})
        lines.append(f"  {'fault':34} {'expected':26} " + " ".join(f"{e:>14}" for e in engines))
        for r in res["faults"]:
            cells = []
            for e in engines:
                x = r["engines"].get(e)
                cells.append(f"{'-':>14}" if x is None else
                             f"{('OK ' if x['expected_caught'] else 'other ' if x['detected'] else 'miss ') + str(x['seconds']) + 's':>14}")
            lines.append(f"  {r['fault']:34} {r['expected']:26} " + " ".join(cells))
        for s in res["survivors"]:
            lines.append(f"  SURVIVOR {s['fault']}: {s['why']}")
        for m in res["misattributed"]:
            lines.append(f"  MIS-ATTRIBUTED {m['fault']}: expected {m['expected']}, got {m['caught_by']}")
        return "\n".join(lines)

    emit(args, res, text)
    return code


