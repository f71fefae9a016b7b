"""The engines a project file names, each run on one system and seed, as per-check results.

Every runner returns an `EngineRun`: its exit code, time, counts, one record per check it
verifies (the JUnit test cases and report.json's "checks") and the traces of its findings
(saved to the corpus by the gate). The runners only call the existing engines (walks, the
Hypothesis campaign, the vLLM driver, `kvcheck diff`'s two oracles, prove, explore); a planted
expected fault runs through the mutants' engines and counts only when its expected check
catches it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..spec.config import Config
from ..spec.outputs import kvcheck_command
from ..spec.system import Spec
from ..spec.trace import Trace
from ..spec.verdict import FOR_FINDING, ExitCode
from .project import System
from ..fuzz.floor import shortfall as floor_shortfall

LOCKSTEP = ("decision_matches_spec", "abstract_state_matches_spec", "sut_accepted_disabled_action",
            "sut_rejected_enabled_action", "sut_raised")


@dataclass
class EngineRun:
    code: int
    seconds: float
    counts: dict[str, Any]
    checks: list[dict[str, Any]]
    traces: list[str] = field(default_factory=list)     # findings' trace files (for the corpus)
    extra: dict[str, dict] = field(default_factory=dict)   # report.json engine data (reuse_profile, metrics)
    detection_s: float | None = None     # seconds to the first failure (an expected fault's detection time)


def metrics(logical: float, usable: float, degradations: dict[str, int], weight: float) -> dict[str, Any]:
    """An engine run's hit rates and degradations (the report's plots), merged over seeds by the
    gate weighted by `weight` (the walk's requested blocks, the diff's scenarios)."""
    return {"logical_hit_rate": logical, "usable_hit_rate": usable, "degradations": dict(degradations),
            "weight": weight}


def check(system: str, engine: str, name: str, verdict: str, seconds: float, counts: dict[str, Any],
          finding: dict[str, Any] | None = None, note: str | None = None) -> dict[str, Any]:
    """One report.json "checks" entry (verdict: passed, failed, undecided, skipped, fixed)."""
    return {"system": system, "engine": engine, "check": name, "verdict": verdict,
            "seconds": round(seconds, 3), "counts": counts, "finding": finding, "note": note}


def finding(kind: str, message: str, replay: str | None, steps: list[str]) -> dict[str, Any]:
    return {"kind": kind, "message": message, "replay": replay, "trace_steps": steps}


def labels(path: str) -> list[str]:
    try:
        return [s.label() for s in Trace.load(path).steps]
    except Exception:  # noqa: BLE001 - a label list is decoration; the trace stays named
        return []


def per_check(system: str, engine: str, names: list[str], failed: dict[str, dict[str, Any]],
               seconds: float, counts: dict[str, Any], undecided: dict[str, str] | None = None) -> list[dict[str, Any]]:
    names = names + [n for n in failed if n not in names]
    out = []
    for n in names:
        if n in failed:
            out.append(check(system, engine, n, "failed", seconds, counts, failed[n]))
        elif undecided and n in undecided:
            out.append(check(system, engine, n, "undecided", seconds, counts, note=undecided[n]))
        else:
            out.append(check(system, engine, n, "passed", seconds, counts))
    return out


def system_config(sys: System, fallback: Config) -> Config:
    return Config.load(str(sys.config)) if sys.config is not None else fallback


def invariants(cfg: Config) -> list[str]:
    return sorted({k.invariant for k in Spec(cfg).conjuncts})


# ---- spec: walk, prove, explore ---------------------------------------------------------

def run_walk(sys: System, cfg: Config, seed: int, out: Path) -> EngineRun:
    from ..fuzz.walk import Walker, shrink, to_trace
    from ..spec.objects import DECISION_KINDS
    from .coverage_min import required_states
    spec, steps = Spec(cfg), sys.budgets["walk"].steps or 10_000
    t0 = time.perf_counter()
    res = Walker(spec, seed=seed).run(steps)
    cov = res.coverage
    counts = {"steps": cov.steps, "episodes": cov.episodes, "invariants": len(invariants(cfg))}
    failed: dict[str, dict[str, Any]] = {}
    traces: list[str] = []
    code = ExitCode.OK
    if res.violation is not None:
        v = res.violation
        trace = to_trace(spec, shrink(spec, v.trace, set(v.invariants), 10.0), seed)
        path = str(trace.save(out / f"walk-{sys.name}-seed{seed}.json"))
        traces.append(path)
        f = finding("invariant", f"after {v.action}: " + "; ".join(f"{i}: {w}" for i, w in v.violations[:4]),
                    kvcheck_command("replay", path), [s.label() for s in trace.steps])
        failed = {i: f for i in v.invariants}
        code = ExitCode.INVARIANT
    missing = [f"action {a}" for a in spec.actions if cov.actions.get(a, 0) == 0]
    missing += [f"decision {d}" for d in DECISION_KINDS if cov.decisions.get(d, 0) == 0]
    missing += [f"state {s}" for s in required_states(cfg) if cov.object_states.get(s, 0) == 0]
    secs = time.perf_counter() - t0
    und = {"coverage": "not reached: " + ", ".join(missing)} if missing and code == ExitCode.OK else {}
    if und:
        code = ExitCode.UNDECIDED
    m = res.metrics.to_dict()
    return EngineRun(code, secs, counts, per_check(sys.name, "walk", invariants(cfg) + ["coverage"],
                                                    failed, secs, counts, und), traces,
                     {"metrics": metrics(m["logical_hit_rate"], m["usable_hit_rate"], m["degradations"],
                                         res.metrics.requested_blocks)})


def run_prove(sys: System, cfg: Config, out: Path) -> EngineRun:
    from .prove import run_prove as prove
    code, rep = prove(cfg, out, None, None, str(sys.config) if sys.config else None)
    counts = {"invariants": len(rep["invariants"]), "bmc_depth": rep["bmc"].get("checked")}
    checks = []
    for o in rep["invariants"]:
        verdict = "passed" if o["status"] == "proved" else "failed" if o["status"] in ("refuted", "violated",
                                                                                    "counterexample") else "undecided"
        f = finding("z3", f"{o['name']}: {o['status']} ({o['method']})", kvcheck_command("prove"), []) \
            if verdict == "failed" else None
        checks.append(check(sys.name, "prove", o["name"], verdict, rep["seconds"], counts, f,
                            None if verdict != "undecided" else o["status"]))
    return EngineRun(code, rep["seconds"], counts, checks)


def run_explore(sys: System, out: Path) -> EngineRun:
    from .explore import run_profile
    code, rep = run_profile(out)
    counts = {k: rep.get(k) for k in ("states", "transitions", "depth")}
    v = rep.get("violation")
    failed = {}
    if v:
        f = finding("invariant", ", ".join(v["invariants"]), v.get("replay"), v.get("trace_steps", []))
        failed = {i: f for i in v["invariants"]}
    und = {}
    if rep.get("deadlocks"):
        failed["deadlocks"] = finding("deadlock", f"{rep['deadlocks']} deadlocked states", kvcheck_command("explore"), [])
    if rep.get("sometimes_missing"):
        und["sometimes"] = "never reached: " + ", ".join(rep["sometimes_missing"])
    if not rep.get("exhaustive"):
        und["exhaustive"] = "state budget spent before the state space was"
    names = ["invariants", "deadlocks", "sometimes", "exhaustive"]
    return EngineRun(code, rep["seconds"], counts, per_check(sys.name, "explore", names, failed, rep["seconds"],
                                                              counts, und))


def run_exhaustive(sys: System, cfg: Config, seed: int, out: Path) -> EngineRun:
    """Every program of the system up to its `depth` (fuzz/exhaustive.py): one check,
    `depth_K`, passed when complete, failed with a shortest trace, undecided when the budget
    ran out first."""
    from .gate_profiles import run_exhaustive_pass
    from .project import DEFAULT_DEPTH
    depth, b = int(sys.options.get("depth", DEFAULT_DEPTH)), sys.budgets["exhaustive"]
    x = run_exhaustive_pass(cfg, out, seed, depth, b.steps, sut=sys.name, seconds=b.seconds)
    e = x["exhaustive"]
    counts = {k: e[k] for k in ("depth", "reached", "programs", "states", "steps", "complete")}
    failed, und, traces = {}, {}, []
    for f in x["findings"]:
        failed[f"depth_{depth}"] = finding(f["kind"], f["message"], f["replay"], f["trace_steps"])
        traces.append(f["trace"])
    if not failed and x["exit_code"] != ExitCode.OK:
        und[f"depth_{depth}"] = x["verdict"]
    return EngineRun(x["exit_code"], x["seconds"], counts,
                     per_check(sys.name, "exhaustive", [f"depth_{depth}"], failed, x["seconds"], counts, und), traces)


# ---- the Hypothesis campaign (spec, reference, MODULE:CLASS) ----------------------------

def run_fuzz(sys: System, cfg: Config, seed: int, out: Path, fault: str | None = None) -> EngineRun:
    from ..fuzz.campaign import run_campaign
    budget = sys.fault_budget if fault else sys.budgets["fuzz"]
    if sys.ray is not None:            # the project file's `ray`: the campaign as Ray tasks
        from ..fuzz.ray_campaign import plan, run_ray
        r = run_ray(cfg, plan([(sys.name, fault)], seed, sys.ray_shards), budget, sys.redis, out,
                    address=None if sys.ray is True else sys.ray)
    else:
        r = run_campaign(cfg, sys.name, budget, seed=seed, fault=fault, out=out,
                         shrink_seconds=10.0 if fault else 30.0)
    if r.get("interrupted"):
        raise KeyboardInterrupt
    counts = {"steps": r["steps"], "examples": r["examples"],
              "actions": len(r["coverage"]["actions"]), **r["coverage"]["decisions"]}
    failed, traces = {}, []
    for x in r["findings"]:
        f = finding(x["kind"], x["message"], x["replay"], x["trace_steps"])
        failed.update({c: f for c in x["checks"]})
        traces.append(x["trace"])
    code = r["exit_code"]
    und = {"campaign": r["error"]} if r.get("error") and code == ExitCode.UNDECIDED else {}
    names = invariants(cfg) + list(LOCKSTEP) + (["reuse_equals_recompute"] if sys.kind == "reference" else []) \
        + (["campaign"] if und else [])
    checks = per_check(sys.name, "fuzz", names, failed, r["seconds"], counts, und)
    checks.append(cov := coverage_check(sys.name, r["coverage"]["actions_missing"], r["seconds"], counts,
                                        r["coverage"].get("actions_never_enabled", ())))
    if code == ExitCode.OK and cov["verdict"] == "undecided":
        code = ExitCode.UNDECIDED
    return EngineRun(code, r["seconds"], counts, checks, traces,
                     detection_s=r.get("seconds_to_detection", r.get("seconds_to_first_failure")))


def coverage_check(label: str, missing: list[str], seconds: float, counts: dict[str, Any],
                   never_enabled: list[str] | tuple = ()) -> dict[str, Any]:
    """A campaign's coverage floor (fuzz/floor.py: steps run, examples tried, a lookup decided,
    every declared action exercised); short of it the check is undecided (exit 3): a campaign
    that did no work, or left part of what it declares untried, proves nothing about that part."""
    why = floor_shortfall(counts, missing, never_enabled, counts.get("steps"))
    if why:
        return check(label, "fuzz", "coverage", "undecided", seconds, counts,
                     note="below the coverage floor (raise the budget): " + why)
    return check(label, "fuzz", "coverage", "passed", seconds, counts)


# ---- reference diff ---------------------------------------------------------------------

def run_reference_diff(sys: System, cfg: Config, seed: int, out: Path, fault: str | None = None) -> EngineRun:
    from ..fuzz import registry
    n = sys.budgets["diff"].steps or 30
    if fault:                          # the fault budget: scenarios, or a time bound on 1000
        n = sys.fault_budget.steps or 1000
    d = registry.get("reference").differential(cfg, n, seed, fault, out,
                                               seconds=sys.fault_budget.seconds if fault else None)
    counts = {"scenarios": d["scenarios"], "comparisons": d["comparisons"], **d["decisions"]}
    failed, traces = {}, []
    for m in d["mismatches"]:
        f = finding(m["kind"], m["message"], m["replay"], labels(m["trace"]))
        failed.update({c: f for c in m["checks"]})
        traces.append(m["trace"])
    return EngineRun(d["exit_code"], d["seconds"], counts,
                     per_check(sys.name, "diff", ["reuse_equals_recompute"] + list(LOCKSTEP[:2]),
                                failed, d["seconds"], counts), traces,
                     {"metrics": metrics(d["logical_hit_rate"], d["usable_hit_rate"], d["degradations"],
                                         d["scenarios"])})


def run_engine_variant(sys: System, variant: str, seed: int, out: Path, fault: str | None = None) -> EngineRun:
    """One layout / model type of a registered engine's system, by the engine's `project_run`."""
    from ..fuzz import registry
    from ..fuzz.engine import EngineUnavailable
    label = f"{sys.kind}[{variant}]"
    try:
        return registry.get(sys.kind).project_run(sys, variant, seed, out, fault)
    except (registry.UnknownEngine, EngineUnavailable) as e:
        return skipped(label, "fuzz", str(e))


def covered(sys: System, kind: str, label: str, engine: str, key: str, html_dir: Path, fault: str | None,
            run: Callable[[], EngineRun]) -> EngineRun:
    """`run` (one campaign of the registered engine `kind`) under a measurement of its cache code
    when the system's `cover` is on (the default; not for an expected fault's run): the result
    in report.json (`engine_coverage[key]`) and an `engine_coverage` check held to the engine's
    floor (`Engine.coverage_floor`), undecided below it. A run that was skipped stays skipped."""
    if not sys.options.get("cover") or fault:
        return run()
    from ..fuzz import engine_coverage as ec, registry
    eng = registry.get(kind)
    try:
        meas = ec.measure(kind, eng.cache_code, html_dir)
    except ec.CoverageUnavailable:       # the engine is not importable here: the run says so itself
        return run()
    try:
        r = run()
    finally:
        cov = meas.stop()
    if all(c["verdict"] == "skipped" for c in r.checks):
        return r
    r.extra["engine_coverage"] = {key: cov}
    why = ec.below_floor(cov, eng.coverage_floor)
    counts = {"runtime_pct": cov["runtime_pct"], "lines_pct": cov["lines_pct"],
              "branches_pct": cov["branches_pct"]}
    r.checks.append(check(label, engine, "engine_coverage", "undecided" if why else "passed", r.seconds, counts,
                          note=(why + " (raise the budget, or add a layout that exercises it)") if why else None))
    if why and r.code == ExitCode.OK:
        r.code = ExitCode.UNDECIDED
    return r


def skipped(label: str, engine: str, why: str) -> EngineRun:
    return EngineRun(ExitCode.OK, 0.0, {}, [check(label, engine, "all", "skipped", 0.0, {}, note=why)])


# ---- expected faults: regression checks that the engines still catch them ------------------

def expected_check(sys: System, fault: str) -> str:
    """The check a planted fault must be caught by (the registry's, or the user SUT's own)."""
    if sys.kind == "user":
        from ..fuzz.suts import sut_class
        return sut_class(sys.name).faults[fault]
    from ..fuzz import faults as faultlib
    return faultlib.get(fault.split("@")[0]).expected


def run_expected_fault(sys: System, engine: str, cfg: Config, seed: int, out: Path, fault: str,
                       variant: str | None = None) -> dict[str, Any]:
    """Plant `fault`, run `engine`; the check passes when the expected check fails."""
    want = expected_check(sys, fault)
    t0 = time.perf_counter()
    if engine == "walk":
        from .mutants import engines_for
        secs = sys.fault_budget.seconds or 30.0
        r = engines_for("spec")["walk"](cfg, fault, secs, seed)
        caught_by, label, detected_at = r["caught_by"], sys.name, r["seconds"]
        detail = f"walk of {r['steps']} steps"
    else:
        label = sys.name if variant is None else f"{sys.kind}[{variant}]"
        run = (run_engine_variant(sys, variant, seed, out, fault) if variant is not None
               else {"fuzz": lambda: run_fuzz(sys, cfg, seed, out, fault),
                     "diff": lambda: run_reference_diff(sys, cfg, seed, out, fault)}[engine]())
        if run.checks and run.checks[0]["verdict"] == "skipped":
            return check(label, engine, f"expected_fault:{fault}", "skipped", 0.0, {}, note=run.checks[0]["note"])
        caught_by = [c["check"] for c in run.checks if c["verdict"] == "failed"]
        if sys.kind == "transformers" and caught_by:
            caught_by = ["divergent"]          # the registry names the verdict that catches these
        unit = "steps" if "steps" in run.counts else "scenarios"
        detail = f"{engine} of {run.counts.get(unit)} {unit}"
        detected_at = run.detection_s
    secs = time.perf_counter() - t0
    counts: dict[str, Any] = {"expected": want, "caught_by": caught_by}
    if caught_by:        # the report's detection time: to the first failure where the engine tells
        counts["seconds_to_detection"] = round(detected_at if detected_at is not None else secs, 3)   # else its run
    name = f"expected_fault:{fault}"
    if want in caught_by:
        return check(label, engine, name, "passed", secs, counts, note=f"caught by {want} ({detail})")
    why = (f"planted fault {fault} was caught by {', '.join(caught_by)}, not its expected check {want}"
           if caught_by else f"planted fault {fault} survived: {want} did not fail within the fault budget ({detail})")
    return check(label, engine, name, "failed", secs, counts, finding("survived", why, None, []))


def code_of(c: dict[str, Any]) -> int:
    """The exit code a failed check gives the gate (a surviving fault: undecided, as in mutants)."""
    if c["verdict"] == "undecided":
        return ExitCode.UNDECIDED
    if c["verdict"] != "failed":
        return ExitCode.OK
    kind = (c.get("finding") or {}).get("kind")
    if kind == "survived":
        return ExitCode.UNDECIDED
    if kind == "z3":
        return ExitCode.Z3
    return int(FOR_FINDING.get(kind, ExitCode.INVARIANT))
