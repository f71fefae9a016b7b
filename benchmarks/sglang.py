"""SGLang adapter benchmark: operations per second per layout with every check on, and time to
detection (and shrunk length) of each planted fault. Prints JSON. Run with the Python of an
SGLang side venv (scripts/install-sglang.sh VERSION DIR):

    PYTHONPATH=. DIR/bin/python benchmarks/sglang.py [--steps N] [--seeds K]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

# run as a script, this file's folder comes first on sys.path and its name would shadow SGLang's
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000, help="steps per throughput run")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per planted fault")
    a = ap.parse_args()
    from kvcheck.fuzz.adapters import sglang as sg
    from kvcheck.fuzz.adapters.sglang_install import SglangUnavailable, load
    from kvcheck.fuzz.adapters.sglang_layouts import fault_applies
    try:
        classes = load()["classes"]
    except SglangUnavailable as e:
        print(json.dumps({"error": str(e)}))
        return 2
    layouts = [r["name"] for r in sg.list_layouts() if r["supported"]]
    out: dict = {"sglang_version": sg.sglang_version(), "throughput": {}, "faults": {}}
    with tempfile.TemporaryDirectory() as d:
        for lay in layouts:
            r = sg.run_campaign(lay, budget_s=None, steps=a.steps, seed=11, out_dir=d)
            out["throughput"][lay] = {"steps": r["steps"], "elapsed_s": r["elapsed_s"],
                                      "ops_per_s": round(r["steps"] / max(r["elapsed_s"], 1e-9)),
                                      "findings": len(r["findings"])}
        for f in sg.FAULTS:
            for lay in [x for x in layouts if fault_applies(f, sg.LAYOUTS[x])]:
                ttd, shrunk, caught = [], [], 0
                for seed in range(a.seeds):
                    r = sg.run_campaign(lay, budget_s=10, seed=seed, fault=f, out_dir=d, shrink_s=5)
                    caught += bool(r["caught"])
                    if r["time_to_failure_s"] is not None:
                        ttd.append(r["time_to_failure_s"])
                    shrunk += [x["steps"] for x in r["findings"]]
                out["faults"][f"{f}@{lay}"] = {
                    "caught": f"{caught}/{a.seeds}", "expected": sg.FAULTS[f].expected,
                    "median_time_to_detection_s": statistics.median(ttd) if ttd else None,
                    "max_shrunk_steps": max(shrunk) if shrunk else None}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
