"""SGLang adapter benchmark: operations per second per layout with every check on, and time to
detection (and shrunk length) of each planted fault. Prints JSON. Run with the Python of an
SGLang side venv (scripts/install-sglang.sh VERSION DIR):

    PYTHONPATH=. DIR/bin/python benchmarks/sglang.py [--steps N] [--seeds K] [--layouts a,b] [--faults f,g | --no-faults]
    PYTHONPATH=. DIR/bin/python benchmarks/sglang.py --rediscover [--seeds K] [--cap S]

Throughput is the median over `--seeds` campaigns (seeds 11, 12, ...) of steps per second of
the process's CPU time (`time.process_time()`: the machine may be shared) and, beside it, of
wall time. Campaigns check as `run_campaign` does (incremental checks, a full scan every
`FULL_SCAN_EVERY` steps); `--exact` checks with the full scan after every step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

# run as a script, this file's folder comes first on sys.path and its name would shadow SGLang's
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000, help="steps per throughput run")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per planted fault")
    ap.add_argument("--layouts", default="", help="comma-separated layouts (default: every supported one)")
    ap.add_argument("--no-faults", action="store_true", help="throughput only")
    ap.add_argument("--faults", default=None, help="comma-separated planted faults to time (default: all)")
    ap.add_argument("--exact", action="store_true", help="the full scan after every step (shrinking's mode)")
    ap.add_argument("--rediscover", action="store_true",
                    help="only: time to rediscover each known defect of this release from scratch (scheduler drive)")
    ap.add_argument("--cap", type=float, default=600, help="--rediscover: seconds per attempt before giving up")
    a = ap.parse_args()
    if a.rediscover:
        return rediscover(a.seeds, a.cap)
    from benchmarks._common import fault_row
    from kvcheck.engines.sglang import drivers as sg
    from kvcheck.engines.sglang.install import SglangUnavailable, load
    from kvcheck.engines.sglang.layouts import fault_applies
    try:
        classes = load()["classes"]
    except SglangUnavailable as e:
        print(json.dumps({"error": str(e)}))
        return 2
    layouts = [r["name"] for r in sg.list_layouts() if r["supported"]]
    if a.layouts:
        layouts = [x for x in layouts if x in a.layouts.split(",")]
    faults = ([] if a.no_faults else list(sg.FAULTS) if a.faults is None
              else [x for x in a.faults.split(",") if x])
    if set(faults) - set(sg.FAULTS):
        ap.error(f"unknown fault(s) {sorted(set(faults) - set(sg.FAULTS))}; known: {', '.join(sg.FAULTS)}")
    out: dict = {"sglang_version": sg.sglang_version(), "throughput": {}, "faults": {}}
    with tempfile.TemporaryDirectory() as d:
        for lay in layouts:
            cpu, wall, found = [], [], 0
            for k in range(max(1, a.seeds)):
                c0, w0 = time.process_time(), time.perf_counter()
                r = sg.run_campaign(lay, budget_s=None, steps=a.steps, seed=11 + k, out_dir=d,
                                    **({"full_scan_every": 1} if a.exact else {}))
                cpu.append(r["steps"] / max(time.process_time() - c0, 1e-9))
                wall.append(r["steps"] / max(time.perf_counter() - w0, 1e-9))
                found += len(r["findings"])
            out["throughput"][lay] = {"steps": a.steps, "seeds": max(1, a.seeds),
                                      "ops_per_s_cpu": round(statistics.median(cpu)),
                                      "ops_per_s_wall": round(statistics.median(wall)),
                                      "per_seed_cpu": [round(x) for x in cpu], "findings": found}
        for f in faults:
            for lay in [x for x in layouts if fault_applies(f, sg.LAYOUTS[x])]:
                out["faults"][f"{f}@{lay}"] = fault_row(
                    lambda seed: sg.run_campaign(lay, budget_s=10, seed=seed, fault=f, out_dir=d, shrink_s=5),
                    a.seeds, sg.FAULTS[f].expected)
    print(json.dumps(out, indent=1))
    return 0


def rediscover(seeds: int, cap: float) -> int:
    """For each known defect of the installed release the scheduler drive recognises: campaigns of
    20 s over every supported scheduler-drive layout in turn (no corpus; seeds 1000*k + n, not
    chosen for the defect) until it is recognised; seconds of wall time to that, per attempt, and
    the median."""
    from kvcheck.engines.sglang import drivers as sg
    from kvcheck.engines.sglang.scheduler.known import KNOWN
    version = sg.sglang_version()
    layouts = [r["name"] for r in sg.list_layouts() if r["supported"] and r["name"].endswith("@sched")]
    out: dict = {"sglang_version": version, "layouts": layouts, "cap_s": cap, "rediscovery": {}}
    with tempfile.TemporaryDirectory() as d:
        for k in [k for k in KNOWN if k.defect.in_release(version)]:
            name, times = k.defect.name, []
            for attempt in range(max(1, seeds)):
                spent, n, hit = 0.0, 0, None
                while spent < cap and hit is None:
                    lay = layouts[n % len(layouts)]
                    r = sg.run_campaign(lay, budget_s=min(20, cap - spent), seed=1000 * attempt + n, out_dir=d,
                                        shrink_s=5)
                    first = (r.get("known_first_s") or {}).get(name)
                    hit = None if first is None else round(spent + first, 2)
                    spent += r.get("elapsed_s", 20)
                    n += 1
                times.append({"attempt": attempt, "seconds": hit, "campaigns": n, "layout": lay})
            got = [t["seconds"] for t in times if t["seconds"] is not None]
            out["rediscovery"][name] = {"upstream": k.defect.upstream, "attempts": times,
                                        "found": f"{len(got)}/{len(times)}",
                                        "median_s_of_found": statistics.median(got) if got else None}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
