"""The vLLM scheduler drive (`--drive engine`): actions per second per layout with every check on
(median over seeds), the share of the time inside vLLM's own Scheduler (schedule +
update_from_output, the manager calls included) against kvcheck's checks and driver, and the time
from-scratch campaigns take to rediscover each known vLLM defect of the installed release
(docs/findings-vllm.md; kvcheck/engines/vllm/known.py): campaigns over every named layout of the
release in turn (policy and knobs drawn per episode, seeds not chosen for it), `--slice-s`
seconds each, until the defect is seen or `--cap-s` is spent; the time is the campaigns' time
before the sighting. Prints JSON.

    PYTHONPATH=. python benchmarks/vllm_engine.py [--steps N] [--seeds K] [--layouts a,b]
        [--defects a,b|all|none] [--slice-s S] [--cap-s S] [--rediscover-seeds K]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]   # (vllm.py would shadow vLLM)


def _throughput(layout: str, steps: int, seed: int, d: str) -> dict:
    from vllm.v1.core.sched.scheduler import Scheduler
    from kvcheck.engines.vllm.drivers import run_campaign
    box = [0.0]
    saved = {n: getattr(Scheduler, n) for n in ("schedule", "update_from_output")}

    def timed(fn):
        def w(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                box[0] += time.perf_counter() - t
        return w
    for n, fn in saved.items():
        setattr(Scheduler, n, timed(fn))
    try:
        t0 = time.perf_counter()
        res = run_campaign(layout, budget_s=None, steps=steps, seed=seed, drive="engine", out_dir=d)
        wall = time.perf_counter() - t0
    finally:
        for n, fn in saved.items():
            setattr(Scheduler, n, fn)
    return {"ops_per_s": res["steps"] / wall, "vllm_share": box[0] / wall, "exit": res["exit_code"],
            "scheduler_steps": res["coverage"].get("step", 0)}


def _rediscover(a: argparse.Namespace, d: str) -> dict:
    """Seconds of from-scratch campaigning until each known defect is sighted (per seed)."""
    from kvcheck.engines.vllm import known
    from kvcheck.engines.vllm.drivers import run_campaign
    from kvcheck.engines.vllm.layouts import LAYOUTS, supported_layouts, vllm_version
    v = known._ver(vllm_version())
    active = [k.name for k in known.KNOWN if known._ver(k.first) <= v <= known._ver(k.last)]
    want = active if a.defects == "all" else [x for x in a.defects.split(",") if x]
    layouts = [n for n, why in supported_layouts().items() if why is None and n in LAYOUTS]   # (generated too)
    out: dict = {"active_on_release": active, "layouts_rotated": layouts, "slice_s": a.slice_s, "cap_s": a.cap_s}
    for seed in range(a.rediscover_seeds):
        spent, seen, i = 0.0, {}, 0
        while spent < a.cap_s and not all(x in seen for x in want):
            layout = layouts[(i + seed * 7) % len(layouts)]
            try:
                res = run_campaign(layout, budget_s=a.slice_s, seed=1000 * seed + i, drive="engine", out_dir=d)
            except ValueError:           # a layout this drive cannot take on this release
                res = {"elapsed_s": 0.0, "time_to_first_known_s": {}}
            for name, t in res.get("time_to_first_known_s", {}).items():
                seen.setdefault(name, {"s": round(spent + t, 1), "layout": layout})
            spent += res.get("elapsed_s", a.slice_s)
            i += 1
        for name in want:
            out.setdefault(name, []).append(seen.get(name))
    for name in want:
        got = sorted(x["s"] for x in out[name] if x)
        out[name] = {"per_seed": out[name], "found": f"{len(got)}/{len(out[name])}",
                     "median_s": statistics.median(got) if len(got) * 2 > len(out[name]) else None}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--layouts", default="full,full+swa,full+chunked_local,mla+swa_mla,gemma3,gpt-oss,llama4")
    ap.add_argument("--defects", default="all", help="known defects to rediscover: all (active on this release), "
                    "none, or a comma-separated list")
    ap.add_argument("--slice-s", type=float, default=20.0, help="seconds per layout campaign in the rotation")
    ap.add_argument("--cap-s", type=float, default=600.0, help="give up on a defect after this much campaigning")
    ap.add_argument("--rediscover-seeds", type=int, default=3)
    a = ap.parse_args()
    from kvcheck.engines.vllm.drivers import run_campaign
    from kvcheck.engines.vllm.layouts import vllm_version
    out: dict = {"vllm_version": vllm_version(), "drive": "engine", "steps": a.steps, "seeds": a.seeds, "layouts": {}}
    with tempfile.TemporaryDirectory() as d:
        _throughput("full", 200, 0, d)          # (the process's one-time ModelConfig build: not timed)
        for layout in a.layouts.split(","):
            try:
                runs = [_throughput(layout, a.steps, s, d) for s in range(a.seeds)]
            except ValueError as e:
                out["layouts"][layout] = {"refused": str(e)}
                continue
            out["layouts"][layout] = {
                "ops_per_s_median": round(statistics.median(r["ops_per_s"] for r in runs)),
                "scheduler_steps_per_s_median": round(statistics.median(
                    r["ops_per_s"] * r["scheduler_steps"] / a.steps for r in runs)),
                "vllm_share_median": round(statistics.median(r["vllm_share"] for r in runs), 3),
                "exit_codes": [r["exit"] for r in runs]}
        if a.defects != "none":
            out["rediscover"] = _rediscover(a, d)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
