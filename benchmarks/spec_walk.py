"""Concrete random walks of the spec, all invariants checked every step: steps per second.

Prints one JSON object. `steps_per_s` is the median over runs of the default gate walk
(incremental frame checking: after each step the conjuncts that read a written slot are
re-evaluated; the rest held and did not change). `full_check_steps_per_s` re-evaluates every
conjunct every step, measured in the same process for the ratio. One core (the walk is
single-threaded).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics

from kvcheck.fuzz.walk import Walker
from kvcheck.spec.system import Spec


def measure(spec: Spec, steps: int, seed: int, full: bool) -> float:
    res = Walker(spec, seed=seed, full_check=full).run(steps)
    assert res.violation is None
    return res.coverage.steps / res.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    spec = Spec()
    inc = [measure(spec, args.steps, seed, False) for seed in range(args.runs)]
    full = [measure(spec, args.steps, seed, True) for seed in range(args.runs)]
    print(json.dumps({
        "benchmark": "spec_walk", "steps_per_run": args.steps, "runs": args.runs,
        "steps_per_s": round(statistics.median(inc)),
        "full_check_steps_per_s": round(statistics.median(full)),
        "incremental_over_full": round(statistics.median(inc) / statistics.median(full), 2),
        "runs_steps_per_s": [round(x) for x in inc],
        "state_slots": spec.lay.size, "action_instances": len(spec.instances),
        "invariant_conjuncts": len(spec.conjuncts), "target_steps_per_s": 20_000,
        "python": platform.python_version(), "machine": platform.machine(),
    }))


if __name__ == "__main__":
    main()
