"""Speed of the checker engines on this machine: one JSON object on stdout.

explore_states_per_s / explore_seconds: the exhaustive CI explore profile (every config of
`CI_PROFILE`, one core, liveness analysis included; states_per_s without it is reported as
explore_states_per_s_no_liveness). prove_seconds: `kvcheck prove` on the default config (induction
of every invariant and auxiliary invariant for every action instance, the hit-soundness theorem,
BMC to the default depth). induction_seconds_by_blocks: induction alone for blocks = 4, 8, 16,
32 (skipped once one exceeds --max-induction-s; the trend is what matters). Medians of --reps
runs. Speed is never asserted by tests. --smoke: a tiny run that only checks this script works
(explore stops at 5,000 states per config; prove and induction use the small CI "tiers" config,
BMC to depth 2): its figures are not comparable with a full run's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcheck.checker.explore import CI_PROFILE, explore  # noqa: E402
from kvcheck.checker.prove import Prover, run_prove  # noqa: E402
from kvcheck.spec.config import Config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-induction-s", type=float, default=300.0)
    ap.add_argument("--blocks", default="4,8,16,32")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes (explore capped at 5,000 states per config; prove and induction on the "
                         "small CI 'tiers' config, BMC depth 2): checks the script runs, figures not comparable")
    a = ap.parse_args()
    base = CI_PROFILE["tiers"] if a.smoke else Config()
    cap = {"max_states": 5_000} if a.smoke else {}
    ex_s, ex_rate, ex_rate_nl, states = [], [], [], 0
    for _ in range(a.reps):
        t, n = 0.0, 0
        for cfg in CI_PROFILE.values():
            _, res, _ = explore(cfg, **cap)
            t += res.seconds
            n += res.states
        ex_s.append(t)
        ex_rate.append(n / t)
        states = n
        t2 = 0.0
        for cfg in CI_PROFILE.values():
            _, res, _ = explore(cfg, liveness=False, **cap)
            t2 += res.seconds
        ex_rate_nl.append(n / t2)
        print(f"explore: {n} states, {t:.1f} s ({n / t:.0f}/s; {n / t2:.0f}/s without liveness)",
              file=sys.stderr, flush=True)
    pr = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        code, _ = run_prove(base, None, depth=2 if a.smoke else None)
        pr.append(time.perf_counter() - t0)
        assert code == 0
        print(f"prove: {pr[-1]:.1f} s", file=sys.stderr, flush=True)
    by_blocks: dict[str, float | str] = {}
    over = False
    for n in [int(x) for x in a.blocks.split(",")]:
        if over:
            by_blocks[str(n)] = "skipped (previous size over --max-induction-s)"
            continue
        t0 = time.perf_counter()
        res = Prover(replace(base, blocks=n)).induction()
        dt = time.perf_counter() - t0
        by_blocks[str(n)] = round(dt, 2)
        print(f"induction blocks={n}: {dt:.1f} s", file=sys.stderr, flush=True)
        if any(o.status != "proved" for o in res.values()):
            by_blocks[str(n)] = f"{dt:.2f} (not all proved)"
        over = dt > a.max_induction_s
    print(json.dumps({
        "explore_states_per_s": round(statistics.median(ex_rate)),
        "explore_states_per_s_no_liveness": round(statistics.median(ex_rate_nl)),
        "explore_seconds": round(statistics.median(ex_s), 2),
        "explore_states": states,
        "prove_seconds": round(statistics.median(pr), 2),
        "induction_seconds_by_blocks": by_blocks,
        "reps": a.reps, "smoke": a.smoke, "python": platform.python_version(), "machine": platform.machine(),
        "loadavg": os.getloadavg()[0],
    }))


if __name__ == "__main__":
    main()
