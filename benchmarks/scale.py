"""Throughput of `kvcheck fuzz --ray` with 1 and 2 workers on a local Ray cluster: one JSON
object on stdout.

For each worker count, --reps campaigns of the clean spec (each shard a `--budget` time
budget, seeds differing per rep): `steps_per_s` is the merged result's (the sum of the shards'
own rates), `wall_steps_per_s` counts every step against the wall clock of the whole run
(scheduling, worker start-up and merging included), `wall_s` that clock; for comparison,
`pool_wall_steps_per_s` is the same count for the same campaigns on the local process pool
(`fuzz --workers N`; one worker: a plain campaign in this process). Medians of --reps.
The local cluster is started once (its start-up is reported apart, `ray_init_s`). Speed is
never asserted by tests; on a shared machine the numbers are noisy.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcheck.fuzz.campaign import Budget, run_campaign, run_workers  # noqa: E402
from kvcheck.fuzz.pool import cores  # noqa: E402
from kvcheck.fuzz.ray_campaign import plan, require_ray, run_ray  # noqa: E402
from kvcheck.spec.config import Config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=20.0, help="seconds per shard")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--sut", default="spec")
    ap.add_argument("--no-pool", dest="pool", action="store_false",
                    help="skip the local process pool (fuzz --workers) run for comparison")
    a = ap.parse_args()
    ray = require_ray()
    counts = [int(w) for w in a.workers.split(",")]
    t0 = time.perf_counter()
    ray.init(num_cpus=max(counts), include_dashboard=False, log_to_driver=False,
             configure_logging=False, logging_level=logging.WARNING, object_store_memory=100 * 2**20)
    init_s = time.perf_counter() - t0
    out: dict = {"benchmark": "scale", "sut": a.sut, "budget_s_per_shard": a.budget, "reps": a.reps,
                 "ray": ray.__version__, "ray_init_s": round(init_s, 2), "cores": cores(),
                 "cpu": platform.processor() or platform.machine(), "workers": {},
                 "pool_wall_steps_per_s": {}}
    try:
        for w in counts:
            rates, wall_rates, walls, steps = [], [], [], []
            for rep in range(a.reps):
                with tempfile.TemporaryDirectory() as tmp:
                    t = time.perf_counter()
                    res = run_ray(Config(), plan([(a.sut, None)], seed=1000 * rep, seeds=w),
                                  Budget(seconds=a.budget), None, Path(tmp))
                    wall = time.perf_counter() - t
                rates.append(res["steps_per_s"])
                wall_rates.append(res["steps"] / wall)
                walls.append(wall)
                steps.append(res["steps"])
            if a.pool:           # the same campaigns on the local process pool (fuzz --workers)
                pool = []
                for rep in range(a.reps):
                    with tempfile.TemporaryDirectory() as tmp:
                        t = time.perf_counter()
                        r = (run_workers(Config(), a.sut, Budget(seconds=a.budget), 1000 * rep, None, None,
                                         Path(tmp), w) if w > 1 else
                             run_campaign(Config(), a.sut, Budget(seconds=a.budget), 1000 * rep, out=Path(tmp)))
                        pool.append(r["steps"] / (time.perf_counter() - t))
                out["pool_wall_steps_per_s"][str(w)] = round(statistics.median(pool))
            out["workers"][str(w)] = {"steps_per_s": round(statistics.median(rates)),
                                      "wall_steps_per_s": round(statistics.median(wall_rates)),
                                      "wall_s": round(statistics.median(walls), 2),
                                      "steps": round(statistics.median(steps)),
                                      "runs_steps_per_s": [round(r) for r in rates]}
    finally:
        ray.shutdown()
    if "1" in out["workers"] and "2" in out["workers"]:
        out["speedup_2_over_1"] = round(out["workers"]["2"]["wall_steps_per_s"]
                                        / max(1, out["workers"]["1"]["wall_steps_per_s"]), 2)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
