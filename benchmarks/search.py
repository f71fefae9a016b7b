"""Search power (issue 34): time to (re)discover planted faults and known vLLM defects from
scratch with (a) the plain random walk (`--steer random`), (b) coverage feedback (`--steer
coverage`: fuzz/steer.py), (c) swarm off (every action weight 1 in every episode; the manager
drive only: the scheduler drive's workload has no action weights) and (d) `--exhaustive`
small scopes (the generic lockstep's SUTs only: vLLM's own driver cannot be enumerated, so its
rows are the reference engine's planted faults, beside a Hypothesis campaign on the same fault),
side by side in one run, each run capped; vLLM cache-code line coverage after N seconds per
strategy; and the per-episode tracer's cost (the C tracer against a `sys.settrace` restricted
to the cache files). Medians over seeds; a run that misses counts as its cap, and the median of
a row missed more often than not is null. Prints JSON. Wall clock on a shared box: compare
strategies within one run only.

    PYTHONPATH=. python benchmarks/search.py [--seeds K] [--cap-s S] [--faults f@layout,..]
        [--defects d@layout,..] [--cover-s N] [--reference f,..] [--depth D] [--tracer-steps N]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]   # (vllm.py would shadow vLLM)

STRATEGIES = ("random", "coverage", "swarm_off")


def _steered(strategy: str, seed: int) -> Any:
    from kvcheck.engines.vllm.engine import VllmEngine
    from kvcheck.fuzz.prompts import PromptGen
    from kvcheck.fuzz.steer import Steer
    PromptGen.swarm = strategy != "swarm_off"
    return Steer("random" if strategy == "swarm_off" else strategy, seed, VllmEngine.cache_code)


def _vllm_run(target: str, layout: str, strategy: str, seed: int, cap: float, d: str, known: bool,
              drive: str | None = None, policy: str = "fcfs") -> float | None:
    """Seconds to the target (a planted fault's expected check, or a known defect's first sighting)."""
    from kvcheck.engines.vllm import drivers as V
    lost = not known and V.FAULTS[target][0].startswith("lost_reuse")
    drive = drive or ("auto" if known else "mixed")
    try:
        r = V.run_campaign(layout, budget_s=cap, seed=seed, out_dir=d, drive=drive, steer=_steered(strategy, seed),
                           fault=None if known else target, strict_reuse=lost, sched_policy=policy)
    finally:
        from kvcheck.fuzz.prompts import PromptGen
        PromptGen.swarm = True
    if known:
        return r.get("time_to_first_known_s", {}).get(target)
    return r["time_to_failure_s"] if r.get("caught") else None


def _row(times: list[float | None], cap: float) -> dict[str, Any]:
    got = [t for t in times if t is not None]
    med = statistics.median([cap if t is None else t for t in times]) if len(got) * 2 > len(times) else None
    return {"found": f"{len(got)}/{len(times)}", "median_s": None if med is None else round(med, 2),
            "per_seed": times}


def _table(targets: list[str], strategies: list[str], a: argparse.Namespace, d: str, known: bool) -> dict:
    out: dict = {}
    for t in targets:
        name, rest = t.split("@", 1)              # NAME@LAYOUT[#engine][#priority]: a fault the worker's
        layout, *extra = rest.split("#")          # model catches needs the engine drive; a PRIORITY defect
        drive = next((x for x in extra if x != "priority"), None)       # the priority policy
        policy = "priority" if "priority" in extra else "fcfs"
        cap = a.defect_cap_s if known else a.cap_s
        seeds = range(a.first_seed, a.first_seed + a.seeds)
        out[t] = {s: _row([_vllm_run(name, layout, s, seed, cap, d, known, drive, policy) for seed in seeds], cap)
                  for s in strategies if not (s == "swarm_off" and drive == "engine")}
        print(json.dumps({t: out[t]}), file=sys.stderr, flush=True)     # progress
    return out


def _coverage_after(layout: str, seconds: float, d: str, strategies: list[str]) -> dict:
    """vLLM cache-code lines reached by a clean campaign of `seconds` per strategy and drive
    (swarm off on the manager drive only: the scheduler drive has no action weights)."""
    from kvcheck.engines.vllm import drivers as V
    from kvcheck.engines.vllm.engine import VllmEngine
    from kvcheck.fuzz import engine_coverage as ec
    out = {}
    for drive, s in [(dr, s) for dr in ("auto", "mixed") for s in strategies if (dr, s) != ("auto", "swarm_off")]:
        ec.begin("vllm", VllmEngine.cache_code, None)
        try:
            r = V.run_campaign(layout, budget_s=seconds, seed=0, out_dir=d, steer=_steered(s, 0), drive=drive)
        finally:
            from kvcheck.fuzz.prompts import PromptGen
            PromptGen.swarm = True
        res: dict = {}
        ec.attach(res)
        cov = res["engine_coverage"]
        out[f"{s}@{drive}"] = {"lines": cov["lines"], "statements": cov["statements"], "lines_pct": cov["lines_pct"],
                  "branches_pct": cov["branches_pct"], "steps": r["steps"], "drive": r["drive"]}
    return out


def _reference(faults: list[str], a: argparse.Namespace, d: str) -> dict:
    """The reference engine's planted faults: a Hypothesis campaign against `--exhaustive`."""
    from kvcheck.fuzz import faults as faultlib
    from kvcheck.fuzz.campaign import Budget, run_campaign
    from kvcheck.fuzz.exhaustive import run_exhaustive
    from kvcheck.spec.config import Config
    out: dict = {}
    for name in faults:
        cfg = faultlib.get(name).config_for(Config())
        rand = [run_campaign(cfg, "reference", Budget(seconds=a.cap_s), seed=s, fault=name, out=Path(d),
                             shrink_seconds=1) for s in range(a.seeds)]
        t0 = time.perf_counter()
        ex = run_exhaustive(cfg, "reference", a.depth, Budget(seconds=a.cap_s), name, Path(d))
        ex_s = round(time.perf_counter() - t0, 2)
        out[name] = {"random": _row([r["seconds_to_first_failure"] for r in rand], a.cap_s),
                     "exhaustive": {"found": bool(ex["findings"]), "seconds": ex_s if ex["findings"] else None,
                                    "depth": len(ex["findings"][0]["trace_steps"]) if ex["findings"] else None,
                                    "verdict": ex["verdict"], "programs": ex["exhaustive"]["programs"]}}
        print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)
    return out


def _tracer(steps: int, d: str) -> dict:
    """CPU seconds of one manager-drive campaign of `steps` untraced, under coverage.py's C tracer
    (branch mode, the cache files only) and under a `sys.settrace` restricted to them."""
    import coverage
    from kvcheck.engines.vllm import drivers as V
    from kvcheck.engines.vllm.engine import VllmEngine
    from kvcheck.fuzz.engine_coverage import resolve
    files = set(resolve(VllmEngine.cache_code)[0].values())

    def timed(start: Callable[[], Any], stop: Callable[[], None]) -> float:
        start()
        t = time.process_time()
        try:
            V.run_campaign("full+swa", budget_s=None, steps=steps, seed=1, out_dir=d, drive="mixed")
        finally:
            stop()
        return round(time.process_time() - t, 2)

    arcs: set = set()

    def local(frame: Any, ev: str, arg: Any, last: list = [0]) -> Any:  # noqa: B006 - the last line, kept
        if ev == "line":
            arcs.add((frame.f_code.co_filename, last[0], frame.f_lineno))
            last[0] = frame.f_lineno
        return local

    def glob(frame: Any, ev: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename in files else None

    cov = coverage.Coverage(data_file=None, branch=True, config_file=False, include=sorted(files))
    plain = timed(lambda: None, lambda: None)
    ctracer = timed(cov.start, cov.stop)
    settrace = timed(lambda: sys.settrace(glob), lambda: sys.settrace(None))
    return {"steps": steps, "plain_cpu_s": plain, "ctracer_cpu_s": ctracer, "settrace_cpu_s": settrace,
            "ctracer_x": round(ctracer / plain, 2), "settrace_x": round(settrace / plain, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--first-seed", type=int, default=0, help="the fault and defect rows' seeds start here")
    ap.add_argument("--cap-s", type=float, default=5.0, help="per-run cap (seconds)")
    ap.add_argument("--faults", default="swa_overstrict@gpt-oss,early_reader_forward@gemma3",
                    help="planted vLLM faults as FAULT@LAYOUT[#DRIVE] (default: the manager drive)")
    ap.add_argument("--defects", default="", help="known vLLM defects as NAME@LAYOUT (the auto drive)")
    ap.add_argument("--defect-cap-s", type=float, default=10.0, help="per-run cap of the known-defect rows "
                    "(those runs go on to the cap: a known defect does not stop a campaign)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--cover-s", type=float, default=3.0, help="seconds of the coverage-after-N rows (0: none)")
    ap.add_argument("--cover-layout", default="gemma3")
    ap.add_argument("--reference", default="engine_tail_check_skipped",
                    help="reference-engine faults for the exhaustive rows")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--tracer-steps", type=int, default=500, help="0: no tracer rows")
    a = ap.parse_args()
    from kvcheck.engines.vllm import drivers as V
    strategies = [s for s in a.strategies.split(",") if s]
    out: dict = {"vllm_version": V.vllm_version(), "date": datetime.date.today().isoformat(), "seeds": a.seeds,
                 "first_seed": a.first_seed, "cap_s": a.cap_s, "defect_cap_s": a.defect_cap_s,
                 "strategies": strategies, "argv": sys.argv[1:]}
    with tempfile.TemporaryDirectory() as d:
        V.run_campaign("full", budget_s=None, steps=50, seed=0, out_dir=d, drive="mixed")    # import vLLM first
        if a.tracer_steps:
            out["tracer"] = _tracer(a.tracer_steps, d)
        out["faults"] = _table([x for x in a.faults.split(",") if x], strategies, a, d, False)
        out["known_defects"] = _table([x for x in a.defects.split(",") if x],
                                      [s for s in strategies if s != "swarm_off"], a, d, True)
        if a.cover_s:
            out["coverage_after"] = {"layout": a.cover_layout, "seconds": a.cover_s,
                                     **_coverage_after(a.cover_layout, a.cover_s, d, strategies)}
        out["reference_exhaustive"] = _reference([x for x in a.reference.split(",") if x], a, d)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
