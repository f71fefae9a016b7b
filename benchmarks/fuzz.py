"""Fuzz campaign speed and fault detection. Prints one JSON object.

- `spec_steps_per_s`: Hypothesis stateful steps per second against the spec as SUT.
- `lockstep_steps_per_s`: spec + reference engine in lockstep (differential checks included),
  or null with the reason when the reference engine is not importable.
- `detect_seconds_by_fault` / `trace_len_by_fault`: per fault, median over --seeds seeds of the
  time to the first failure by the fault's expected check (a miss, or a failure by another
  check, counts as the whole run) and the shrunk trace length; `caught_by_expected` says
  whether every run failed with the fault's expected check.
The rates run in one process (one core); fault campaigns in --jobs processes side by side, one
thread each. Medians of several runs; the machine is shared and noisy.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kvcheck.checker.mutants import one_thread
from kvcheck.fuzz.campaign import Budget, run_campaign
from kvcheck.fuzz import faults as faultlib
from kvcheck.spec.config import Config


def rate(sut: str, steps: int, runs: int) -> float:
    out = []
    for seed in range(runs):
        with tempfile.TemporaryDirectory() as d:
            r = run_campaign(Config(), sut, Budget(steps=steps), seed=seed, out=Path(d))
        out.append(r["steps"] / r["seconds"])
    return statistics.median(out)


def _detect(job: tuple[str, int, str]) -> dict:
    """One fault, one seed: time to the first failure by the expected check (not counting
    shrinking; a miss, or a failure by another check, counts as the whole run), the shrunk
    trace's length, and whether the check is the fault's expected one."""
    name, seed, budget = job
    one_thread()
    f = faultlib.get(name)
    sut = "spec" if f.layer == "spec" else "reference"
    with tempfile.TemporaryDirectory() as d:
        r = run_campaign(f.config_for(Config()), sut, Budget.parse(budget), seed=seed, fault=name, out=Path(d),
                         shrink_seconds=20)
    found = r["findings"][0] if r["findings"] else None
    expected = found is not None and f.expected in found["checks"]
    at = r.get("seconds_to_detection")
    return {"fault": name, "seed": seed, "seconds": at if expected and at is not None else r["seconds"],
            "trace_len": len(found["trace_steps"]) if found else None,
            "checks": found["checks"] if found else None,
            "expected": expected}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--budget", default="60s", help="per fault and seed")
    ap.add_argument("--faults", nargs="*",
                    help="default: every spec fault (+ engine faults when available); given with no names: none")
    ap.add_argument("--rates-only", action="store_true", help="only the steps/s figures")
    ap.add_argument("--jobs", type=int, default=1,
                    help="fault campaigns run in this many processes (each is single-threaded)")
    args = ap.parse_args()
    out: dict = {"benchmark": "fuzz", "steps_per_run": args.steps, "runs": args.runs}
    out["spec_steps_per_s"] = round(rate("spec", args.steps, args.runs))
    try:
        import kvcheck.engines.reference.sut  # noqa: F401
        out["lockstep_steps_per_s"] = round(rate("reference", args.steps // 5, args.runs))
        have_ref = True
    except ImportError as e:
        out["lockstep_steps_per_s"] = None
        out["lockstep_note"] = f"reference engine not available: {e}"
        have_ref = False
    names = ([] if args.rates_only else args.faults if args.faults is not None
             else [f.name for f in faultlib.FAULTS.values()
                   if f.provider == "spec" or (have_ref and f.provider == "reference")])
    jobs = [(name, seed, args.budget) for name in names for seed in range(args.seeds)]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(_detect, jobs))
    detect, length, caught, misses = {}, {}, {}, {}
    for name in names:
        mine = [r for r in runs if r["fault"] == name]
        detect[name] = round(statistics.median(r["seconds"] for r in mine), 2)
        lens = [r["trace_len"] for r in mine if r["trace_len"] is not None]
        length[name] = statistics.median(lens) if lens else None
        caught[name] = all(r["expected"] for r in mine)
        if not caught[name]:
            misses[name] = {r["seed"]: r["checks"] for r in mine if not r["expected"]}
    out.update(detect_seconds_by_fault=detect, trace_len_by_fault=length, caught_by_expected=caught,
               missed_or_misattributed_by_seed=misses,
               targets={"spec_steps_per_s": 3000, "lockstep_steps_per_s": 300,
                        "detect_seconds": 10, "trace_len": 12})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
