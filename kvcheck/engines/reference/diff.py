"""`kvcheck diff` for the reference engine: a driver of the lockstep core (kvcheck.fuzz.lockstep)
that generates themed workloads; each runs with cache reuse and by full recompute, logits
compared bitwise; plus, at every step, the spec's invariants on the engine's own abstract
state, and conformance with the spec.

Workloads are random walks over the spec's action table, themed (shared prefixes with
different suffixes, interrupt-and-resume, eviction under memory pressure, offload and reload,
corrupted files, version bumps, concurrent lookups during transfers, graph capture): the spec
supplies the enabled actions, so every workload is legal, and the engine must also *refuse*
what the spec forbids (negative probes: evicting a pinned page, migrating a captured one,
allocating past a cap, using a stale lease). After each lookup an isolation probe asks what a
request of another tenant (another cache salt) would hit: nothing.

The checks and their order are the core's: invariants of the spec on `observe()` (exit 10),
the differential oracle `reuse_equals_recompute`, torch.equal (exit 11), conformance:
decision and abstract state equal the spec's (exit 13). A divergence is followed through on
the engine alone (its requests bind, run and finish as the engine decided) so that the
consequence is attributed to the invariant or the differential it breaks, and the scenario
ends there. Findings are shrunk by the one shrinker while the same check still fails and
saved by the one trace builder with the replay command.
"""
from __future__ import annotations

import random
import shlex
import tempfile
import time
from kvcheck.spec.outputs import file_stem
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from .sut import ReferenceSUT
from kvcheck.spec.config import Config
from kvcheck.spec.objects import DECISION_KINDS, OBJECT_KINDS
from kvcheck.spec.sut import PROBE_ACTIONS
from kvcheck.spec.system import Instance, Spec
from kvcheck.spec.trace import Trace
from kvcheck.spec.workloads import THEMES, weights as theme_weights

from kvcheck.spec.verdict import FOR_FINDING
from kvcheck.fuzz.lockstep import Finding, Lockstep, SpecModel
from kvcheck.fuzz.shrink import shrink_finding
from kvcheck.fuzz.traces import replay, to_trace

CHECKS = "invariants on the engine state, reuse == recompute, conformance; isolation probe after each lookup"


class _CountingSUT(ReferenceSUT):
    """The reference engine, counting the blocks its lookups request and the comparisons its
    oracle makes (the hit rates and `comparisons` of the report)."""

    requested = compared = 0

    def apply(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        obs = super().apply(action, params)
        if action == "lookup":
            self.requested += self.engine.mgr.requests[params["r"]].n
        return obs

    def differential_check(self, action: str, params: dict[str, Any]) -> str | None:
        self.compared += self._pending_check is not None
        return super().differential_check(action, params)


def _pick(rng: random.Random, insts: list[Instance], weights: dict[str, float]) -> Instance:
    """An action by its theme weight (not by how many instances it has), then an instance."""
    by: dict[str, list[Instance]] = {}
    for i in insts:
        by.setdefault(i.action, []).append(i)
    acts = sorted(by)
    a = rng.choices(acts, weights=[weights.get(x, 1.0) for x in acts], k=1)[0]
    return rng.choice(by[a])


def generate(spec: Spec, rng: random.Random, theme: str, length: int, probe_rate: float = 0.15
             ) -> list[Instance]:
    """One themed scenario: steps the spec enables along the way, and negative probes (steps
    it forbids where they fall)."""
    weights = theme_weights(theme)
    s = spec.init()
    steps: list[Instance] = []
    for _ in range(length):
        en = spec.enabled(s)
        if rng.random() < probe_rate:
            dis = [i for i in spec.instances if i.action in PROBE_ACTIONS and not i.guard(s)]
            if dis:
                steps.append(rng.choice(dis))
                continue
        if not en:
            break
        i = _pick(rng, en, weights)
        steps.append(i)
        s = i.effect(s)
    return steps


def run_scenario(spec: Spec, fault: str | None, program: list[Instance]
                 ) -> tuple[Finding | None, _CountingSUT, Any]:
    """Run a scenario on the core; returns (finding, the SUT, its engine, for the report)."""
    sut = _CountingSUT(fault=fault)
    sut.reset(spec.cfg)
    eng = sut.engine
    f = Lockstep(SpecModel(spec), sut).run(program, stop_at_divergence=True)
    return f, sut, eng


def minimize(spec: Spec, fault: str | None, f: Finding, seconds: float = 20.0) -> Finding:
    """The one shrinker, while a check of the finding still fails."""
    return shrink_finding(f, lambda prog: run_scenario(spec, fault, prog)[0],
                          lambda g: bool(set(g.checks) & set(f.checks)), seconds)


def replay_reference(trace: Trace) -> dict[str, Any]:
    """Re-run a diff reproducer on the one replay; returns {exit_code, kind, checks, message}."""
    code, out = replay(trace, ReferenceSUT(fault=trace.meta.get("sut_fault")))
    found = out.get("finding") or {}
    return {"exit_code": code, **{k: found[k] for k in ("kind", "checks", "message") if k in found}}


def run_reference_diff(scenarios: int = 200, seed: int = 0, fault: str | None = None,
                       out_dir: str | Path = "kvcheck-report", config: Config | None = None,
                       length: int = 64, minimize_seconds: float = 20.0,
                       seconds: float | None = None) -> dict[str, Any]:
    """`seconds`: stop generating scenarios once spent (a time budget on top of `scenarios`).
    A finding ends the run; a decision whose reasons alone differ is reported only when
    nothing worse is found."""
    torch.set_num_threads(1)
    cfg = config or Config()
    spec = Spec(cfg)
    t0 = time.perf_counter()
    decisions: Counter = Counter()
    degradations: Counter = Counter()
    objects: Counter = Counter()
    themes: Counter = Counter()
    logical = usable = requested = compared = 0
    names = list(THEMES)
    run = 0
    found: tuple[int, str, Finding] | None = None
    soft: tuple[int, str, Finding] | None = None
    for i in range(scenarios):
        if seconds is not None and i and time.perf_counter() - t0 >= seconds:
            break
        rng = random.Random(seed * 1_000_003 + i)
        theme = names[i % len(names)]
        f, sut, eng = run_scenario(spec, fault, generate(spec, rng, theme, length))
        run += 1
        themes[theme] += 1
        st = eng.mgr.stats
        decisions.update(st["decisions"])
        degradations.update(st["degradations"])
        for k, v in eng.reused.items():
            objects[k] += v
        objects["on_disk"] += st["transitions"].get("on_disk:offloading->durable", 0) + sum(
            v for k, v in st["transitions"].items() if k.endswith(":restore"))
        logical += st["logical_blocks"]
        usable += st["usable_blocks"]
        requested += sut.requested
        compared += sut.compared
        if f is not None and f.soft:
            soft = soft or (i, theme, f)       # a reasons-only divergence: keep looking
        elif f is not None:
            found = (i, theme, f)
            break
    mismatches: list[dict[str, Any]] = []
    code = 0
    if found or soft:
        i, theme, f = found or soft        # type: ignore[misc]
        f = minimize(spec, fault, f, minimize_seconds)
        trace = to_trace(spec, f.trail, seed, engine="diff", expect_upto=f.lockstep, sut="reference",
                         finding=f, meta={"sut_fault": fault, "checks": CHECKS})
        path = trace.save(Path(out_dir) / f"diff-reference-{file_stem(fault or 'clean')}-seed{seed}-s{i}.json")
        mismatches.append({"scenario": i, "theme": theme, "kind": f.kind, "checks": f.checks,
                           "message": f.message, "trace": str(path), "trace_steps": len(trace.steps),
                           "replay": f"kvcheck replay {shlex.quote(str(path))} --sut reference"})
        code = FOR_FINDING[f.kind]
    return {
        "sut": "reference", "seed": seed, "fault": fault, "scenarios": run,
        "seconds": round(time.perf_counter() - t0, 2), "themes": dict(themes),
        "decisions": {k: decisions.get(k, 0) for k in DECISION_KINDS},
        "degradations": dict(sorted(degradations.items())),
        "objects_exercised": {k: objects.get(k, 0) for k in OBJECT_KINDS},
        "comparisons": compared,
        "logical_hit_rate": round(logical / requested, 4) if requested else 0.0,
        "usable_hit_rate": round(usable / requested, 4) if requested else 0.0,
        "mismatches": mismatches,
        "bitwise_equal": not any(m["kind"] == "differential" for m in mismatches) and compared > 0,
        "exit_code": code,
    }


def mutant_engine(cfg: Config, fault: str | None, budget_s: float, seed: int) -> dict[str, Any]:
    """`kvcheck mutants` entry point: the diff runner with one fault planted (or none, the
    negative control) under a time budget, with the configurable semantic the fault lives in
    switched on."""
    if fault is not None:
        from kvcheck.fuzz.faults import get
        cfg = get(fault).config_for(cfg)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        res = run_reference_diff(scenarios=10**6, seed=seed, fault=fault, out_dir=d, config=cfg,
                                 minimize_seconds=min(10.0, budget_s), seconds=budget_s)
        secs = round(time.perf_counter() - t0, 2)
    if not res["mismatches"]:
        return {"detected": False, "caught_by": [], "seconds": secs, "steps": res["scenarios"]}
    m = res["mismatches"][0]
    return {"detected": True, "caught_by": m["checks"], "kind": m["kind"], "seconds": secs,
            "trace_len": m["trace_steps"], "steps": res["scenarios"], "exit_code": res["exit_code"]}
