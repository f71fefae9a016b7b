"""vLLM adapter benchmark (the manager drive, `--drive mixed`; the scheduler drive's is
vllm_engine.py): operations per second per preset with every check on (median of 3
seeds), where the time goes (inside vLLM's KV cache manager, in the adapter's checks, the rest:
driver and core), and time to detection (and shrunk length) of each planted vLLM fault on
full+swa and on a preset. Prints JSON. Run with the main venv or a side venv's Python:

    PYTHONPATH=. python benchmarks/vllm.py [--steps N] [--seeds K] [--layouts a,b]
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import os
import time

# run as a script, this file's folder comes first on sys.path and its name would shadow vLLM's
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

DRIVE = "mixed"        # pinned: kvcheck's step generator over the KV cache manager (not `auto`)

# where each planted fault is timed: the toy full+swa and a preset (the retention fault needs a
# layout with a retention interval, caught by the dense twin)
_FAULT_LAYOUTS = {"swa_hit_unchecked": ("full+swa", "gemma3"), "swa_overstrict": ("full+swa", "gpt-oss"),
                  "drop_ref_on_free": ("full+swa", "deepseek-v3+mtp"), "evict_keeps_hash": ("full+swa", "llama4"),
                  "retention_drops_tail": ("full+swa-sparse", "mixed_block-sparse"),
                  "early_reader_forward": ("full+swa", "gemma3"),
                  **{f: ("full+mamba", "qwen3-next") for f in ("mamba_hit_older_state", "mamba_state_freed_early",
                                                                 "mamba_same_step_hit")},
                  **{f: ("full+mamba-fine", "qwen3-next-fine") for f in ("mamba_partial_move_uncopied",
                                                                           "mamba_partial_hit_off_by_one")}}


def _timed(cls, names, box):
    """Wrap cls's methods so their time adds to box[0] (outermost call only)."""
    depth = [0]
    saved = {}
    for n in names:
        fn = getattr(cls, n)
        saved[n] = fn

        @functools.wraps(fn)
        def w(*a, __fn=fn, **k):
            if depth[0]:
                return __fn(*a, **k)
            depth[0] += 1
            t = time.process_time()
            try:
                return __fn(*a, **k)
            finally:
                box[0] += time.process_time() - t
                depth[0] -= 1
        setattr(cls, n, w)
    return lambda: [setattr(cls, n, f) for n, f in saved.items()]


def _run(V, layout, steps, seed, d, profile=False):
    from kvcheck.engines.vllm.adapter import VllmAdapter
    from kvcheck.engines.vllm.layouts import vllm_modules
    vllm_s, checks_s = [0.0], [0.0]
    undo = []
    if profile:
        undo.append(_timed(vllm_modules()["KVCacheManager"], ["get_computed_blocks", "allocate_slots", "free",
                                                       "reset_prefix_cache", "evict_blocks"], vllm_s))
        undo.append(_timed(VllmAdapter, ["_after_step", "_check_hit", "spec_usable"], checks_s))
    try:
        t, c = time.perf_counter(), time.process_time()
        r = V.run_campaign(layout, budget_s=None, steps=steps, seed=seed, out_dir=d, drive=DRIVE)
        total, cpu = time.perf_counter() - t, time.process_time() - c
    finally:
        for u in undo:
            u()
    return r, total, cpu, vllm_s[0], checks_s[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5000, help="steps per throughput run")
    ap.add_argument("--seeds", type=int, default=3, help="runs per layout and per planted fault")
    ap.add_argument("--layouts", default="", help="comma-separated layouts (default: every preset the release has, and full+swa)")
    ap.add_argument("--faults", default=None, help="comma-separated planted faults to time (default: all; '' none)")
    a = ap.parse_args()
    from benchmarks._common import fault_row
    from kvcheck.engines.vllm import drivers as V
    from kvcheck.engines.vllm.presets import PRESETS
    try:
        gaps = V.supported_layouts()
    except V.VllmUnavailable as e:
        print(json.dumps({"error": str(e)}))
        return 2
    layouts = a.layouts.split(",") if a.layouts else ["full+swa"] + [p for p in PRESETS if not gaps.get(p)]
    out: dict = {"vllm_version": V.vllm_version(), "drive": DRIVE, "steps_per_run": a.steps, "seeds": a.seeds,
                 "note": "a shared machine: noisy. ops_per_s: wall clock (unprofiled runs); "
                         "ops_per_cpu_s and the shares: CPU time of this process (profiled runs, the "
                         "same seeds); checks_share = CPU time in the adapter's checks (shadow model, "
                         "hit and bookkeeping checks, spec-usable hit) / total; medians over the seeds",
                 "throughput": {}, "faults": {}}
    with tempfile.TemporaryDirectory() as d:
        V.run_campaign("full", budget_s=None, steps=50, seed=0, out_dir=d, drive=DRIVE)     # import vLLM first
        for lay in layouts:
            ops, cpu_ops, share_v, share_c, found = [], [], [], [], 0
            for k in range(a.seeds):
                r, total, _, _, _ = _run(V, lay, a.steps, 11 + k, d)
                ops.append(r["steps"] / total)
                found += len(r["findings"])
                r, _, cpu, vs, cs = _run(V, lay, a.steps, 11 + k, d, profile=True)
                cpu_ops.append(r["steps"] / cpu)
                share_v.append(vs / cpu)
                share_c.append(cs / cpu)
            out["throughput"][lay] = {"ops_per_s_median": round(statistics.median(ops)),
                                      "ops_per_s": [round(x) for x in ops],
                                      "ops_per_cpu_s_median": round(statistics.median(cpu_ops)),
                                      "vllm_share": round(statistics.median(share_v), 3),
                                      "checks_share": round(statistics.median(share_c), 3),
                                      "checks_shares": [round(x, 3) for x in share_c],
                                      "findings": found}
        for f in (V.FAULTS if a.faults is None else [x for x in a.faults.split(",") if x]):
            for lay in _FAULT_LAYOUTS.get(f, ("full+swa",)):
                if gaps.get(lay):
                    continue
                exp = V.FAULTS[f][0]
                try:
                    out["faults"][f"{f}@{lay}"] = fault_row(
                        lambda seed: V.run_campaign(lay, budget_s=10, seed=seed, fault=f, out_dir=d, drive=DRIVE), a.seeds, exp,
                        lambda r: r["time_to_failure_s"] if r["time_to_failure_s"] is not None
                        else r["time_to_first_lost_reuse_s"],
                        lambda r: [x["steps"] for x in r["findings"] if x["check"] == exp])
                except ValueError as e:         # a fault this release cannot plant (its one line)
                    out["faults"][f"{f}@{lay}"] = {"expected": exp, "not_planted": str(e)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
