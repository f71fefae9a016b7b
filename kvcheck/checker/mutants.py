"""`kvcheck mutants`: the fault matrix — which engine catches which planted fault, and with which check.

Owns the mutation score. For every fault in the library, every engine that applies to its
layer runs with the fault planted under the same budget; a detection counts only when the
failing check is the fault's `expected` one. The negative control runs every engine on the
clean system with the same budgets and must report nothing.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from ..fuzz.campaign import Budget, run_campaign
from ..fuzz.pool import Interrupted, run_jobs
from ..fuzz.walk import Walker, shrink
from ..fuzz import faults as faultlib
from ..spec.config import Config
from ..spec.system import Spec
from ..spec.verdict import ExitCode

Result = dict[str, Any]


def _with_semantics(cfg: Config, fault: str | None) -> Config:
    """cfg with the configurable semantic a fault lives in switched on (it plants nothing else)."""
    return cfg if fault is None else faultlib.get(fault).config_for(cfg)


def _walk(cfg: Config, fault: str | None, budget_s: float, seed: int) -> Result:
    cfg = _with_semantics(cfg, fault)
    spec = Spec(cfg, fault)
    t0 = time.perf_counter()
    res = Walker(spec, seed=seed).run(10**9 if fault else 10_000, seconds=budget_s)
    secs = time.perf_counter() - t0
    v = res.violation
    if v is None:
        return {"detected": False, "caught_by": [], "seconds": round(secs, 2), "steps": res.coverage.steps}
    short = shrink(spec, v.trace, set(v.invariants), budget_s=min(5.0, budget_s))
    return {"detected": True, "caught_by": v.invariants, "seconds": round(secs, 2),
            "trace_len": len(short), "steps": res.coverage.steps}


def _fuzz(sut: str) -> Callable[[Config, str | None, float, int], Result]:
    def run(cfg: Config, fault: str | None, budget_s: float, seed: int) -> Result:
        cfg = _with_semantics(cfg, fault)
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            r = run_campaign(cfg, sut, Budget(seconds=budget_s), seed=seed, fault=fault, out=Path(d),
                             shrink_seconds=min(20.0, max(5.0, budget_s / 2)))
            secs = time.perf_counter() - t0
        if r.get("interrupted") and not r["findings"]:
            raise KeyboardInterrupt     # a cell cut short by Ctrl-C is no miss: stop the matrix
        if not r["findings"]:
            return {"detected": False, "caught_by": [], "seconds": round(secs, 2), "steps": r["steps"]}
        f = r["findings"][0]
        return {"detected": True, "caught_by": f["checks"], "kind": f["kind"],
                "seconds": r.get("seconds_to_detection", r["seconds_to_first_failure"]), "seconds_with_shrink": round(secs, 2),
                "trace_len": len(f["trace_steps"]), "steps": r["steps"]}
    return run


def _optional(module: str, attr: str = "mutant_engine") -> Callable[..., Result] | None:
    """An engine's mutant entry point, if that engine is part of this install."""
    import importlib
    try:
        return getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return None


# The providers whose faults the matrix runs (vLLM's run in `kvcheck fuzz --sut vllm --fault`
# and its adapter tests; a user's SUT declares its own).
PROVIDERS = ("spec", "reference")


def engines_for(layer: str) -> dict[str, Callable[[Config, str | None, float, int], Result]]:
    """The engines that apply to faults of a layer (those importable in this install)."""
    if layer == "spec":
        table: dict[str, Callable[..., Result]] = {"walk": _walk, "fuzz": _fuzz("spec")}
        optional = {"explore": "kvcheck.checker.explore", "prove": "kvcheck.checker.prove"}
    elif layer == "engine":            # the reference engine's faults: its SUT, and its own checkers
        from ..fuzz import registry
        try:
            ref = registry.get("reference")
        except registry.UnknownEngine:
            return {}
        table = {"fuzz": _fuzz("reference")} if ref.sut_class() is not None else {}
        table.update(ref.mutant_engines())
        optional = {}
    else:
        return {}
    for name, module in optional.items():
        fn = _optional(module)
        if fn is not None:
            table[name] = fn
    return table


def fault_row(cfg: Config, name: str, budget_s: float, seed: int,
              progress: Callable[[str], None] | None = None) -> Result:
    """One fault: every engine that applies to its layer, and its status."""
    f = faultlib.get(name)
    row: Result = {"fault": name, "layer": f.layer, "expected": f.expected, "engines": {}}
    for ename, run in engines_for(f.layer).items():
        if progress:
            progress(f"{name} / {ename}")
        r = run(cfg, name, budget_s, seed)
        r["expected_caught"] = f.expected in r["caught_by"]
        row["engines"][ename] = r
    row["caught_by_expected"] = sorted(e for e, r in row["engines"].items() if r["expected_caught"])
    row["detected_by"] = sorted(e for e, r in row["engines"].items() if r["detected"])
    if not row["engines"]:
        row["status"] = "no engine for this layer in this install"
    elif row["caught_by_expected"]:
        row["status"] = "killed"
    elif row["detected_by"]:
        row["status"] = "mis-attributed"
    else:
        row["status"] = "survived"
    return row


def control_cell(cfg: Config, layer: str, engine: str, budget_s: float, seed: int) -> Result:
    """The negative control of one engine on one layer: the clean system, the same budget."""
    return engines_for(layer)[engine](cfg, None, budget_s, seed)


def one_thread() -> None:
    """Campaigns side by side, one per core: torch must not spread each over every core."""
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass


def run_mutants(cfg: Config, budget_s: float = 30.0, seed: int = 0, only: list[str] | None = None,
                progress: Callable[[str], None] | None = None,
                on_row: Callable[[Result], None] | None = None, workers: int = 1) -> Result:
    """`on_row` gets each fault's row as soon as it is done (a long run shows its results as it
    goes, and an interrupted one keeps them). `workers` > 1 runs faults (and control cells) in
    that many processes; detection times are then measured side by side."""
    names = only or [n for n, f in faultlib.FAULTS.items() if f.provider in PROVIDERS]
    cells = [(layer, e) for layer in sorted({faultlib.get(n).layer for n in names}) for e in engines_for(layer)]
    rows: dict[str, Result] = {}
    control: Result = {}
    interrupted = False
    try:
        if workers <= 1:
            for name in names:
                rows[name] = fault_row(cfg, name, budget_s, seed, progress)
                if on_row:
                    on_row(rows[name])
            # negative control: the clean system, every engine, same budgets
            for layer, e in cells:
                if progress:
                    progress(f"clean / {layer} / {e}")
                control[f"{layer}:{e}"] = control_cell(cfg, layer, e, budget_s, seed)
        else:
            jobs: dict[tuple[str, str], tuple] = {("row", n): (cfg, n, budget_s, seed) for n in names}
            jobs.update({("control", f"{layer}:{e}"): (cfg, layer, e, budget_s, seed) for layer, e in cells})
            for (what, key), res in run_jobs(_job, jobs, workers, initializer=one_thread):
                if isinstance(res, BaseException):
                    raise res
                if what == "row":
                    rows[key] = res
                    if progress:
                        progress(key)
                    if on_row:
                        on_row(rows[key])
                else:
                    control[key] = res
    except (KeyboardInterrupt, Interrupted):
        interrupted = True          # the rows done so far stand; the cell in flight is dropped
    ordered = [rows[n] for n in names if n in rows]
    survivors = [{"fault": r["fault"], "expected": r["expected"],
                  "why": f"no engine failed within {budget_s:g}s per engine"}
                 for r in ordered if r["status"] == "survived"]
    misattributed = [{"fault": r["fault"], "expected": r["expected"],
                      "caught_by": {e: r["engines"][e]["caught_by"] for e in r["detected_by"]},
                      "why": "detected, but not by the check the fault targets: that check "
                             "is not testing what it claims, or the fault's symptom is elsewhere"}
                     for r in ordered if r["status"] == "mis-attributed"]
    control_clean = all(not r["detected"] for r in control.values())
    scored = [r for r in ordered if r["engines"]]
    killed = sum(1 for r in scored if r["status"] == "killed")
    score = killed / len(scored) if scored else 0.0
    return {"faults": ordered, "mutation_score": round(score, 4), "killed": killed, "scored": len(scored),
            "survivors": survivors, "misattributed": misattributed,
            "negative_control": control, "negative_control_clean": control_clean,
            "budget_per_fault_s": budget_s, "seed": seed, "workers": workers,
            "interrupted": interrupted,
            "not_run": [n for n in names if n not in rows],
            "exit_code": int(ExitCode.INTERRUPTED if interrupted else ExitCode.OK
                             if (control_clean and killed == len(scored)) else
                             ExitCode.INVARIANT if not control_clean else ExitCode.UNDECIDED)}


def _job(*args: Any) -> Result:
    """A row (cfg, name, budget, seed) or a control cell (cfg, layer, engine, budget, seed)."""
    return fault_row(*args) if len(args) == 4 else control_cell(*args)
