"""`kvcheck diff` for the reference engine: generated workloads, each run with cache reuse and
by full recompute, logits compared bitwise; plus, at every step, the spec's invariants on the
engine's own abstract state, and conformance with the spec.

Workloads are random walks over the spec's action table, themed (shared prefixes with
different suffixes, interrupt-and-resume, eviction under memory pressure, offload and reload,
corrupted files, version bumps, concurrent lookups during transfers, graph capture): the spec
supplies the enabled actions, so every workload is legal, and the engine must also *refuse*
what the spec forbids (negative probes: evicting a pinned page, migrating a captured one,
allocating past a cap, using a stale lease). After each lookup an isolation probe asks what a
request of another tenant (another cache salt) would hit: nothing.

Checks at each step, in this order (the first that fails is the finding):
  1. invariants of the spec evaluated on `observe()` (exit 10),
  2. the differential oracle `reuse_equals_recompute`, torch.equal (exit 11),
  3. conformance: decision and abstract state equal the spec's (exit 13).
A conformance divergence is followed through for a few steps on the engine alone (its request
binds, runs and finishes as the engine decided) so that the consequence is attributed to the
invariant or the differential it breaks; if none shows, the finding is the divergence itself.
Findings are minimized (chunk/step deletion while the same check still fails) and saved in the
kvcheck.spec.trace format with the replay command.
"""
from __future__ import annotations

import random
import shlex
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from kvcheck.spec.config import Config
from kvcheck.spec.objects import DECISION_KINDS, OBJECT_KINDS, R_BOUND, R_DECIDED, R_RUNNING, R_WAITING
from kvcheck.spec.sut import PROBE_ACTIONS, ActionRejected
from kvcheck.spec.system import Spec
from kvcheck.spec.trace import Step, Trace
from kvcheck.spec.workloads import THEMES, weights as theme_weights

from .adapter import ReferenceSUT

from ..spec.verdict import FOR_FINDING as EXIT  # noqa: E402  (the one exit-code table)


class _Finding(Exception):
    def __init__(self, kind: str, checks: list[str], message: str, step: int) -> None:
        super().__init__(message)
        self.kind, self.checks, self.message, self.step = kind, checks, message, step


class Runner:
    """Runs a list of steps on the spec and the engine with every check. A step is
    (action, params, mode): mode "spec" = an action the spec enables (applied to both), "probe" =
    one it does not (the engine must refuse), "follow" = engine-only continuation after a
    divergence."""

    def __init__(self, spec: Spec, fault: str | None) -> None:
        self.spec, self.fault = spec, fault
        self.sut = ReferenceSUT(fault=fault)
        self.sut.reset(spec.cfg)
        self.s = spec.init()
        self.diverged: _Finding | None = None
        self.soft: _Finding | None = None
        self.focus: int | None = None
        self.decisions: Counter = Counter()
        self.compared = 0
        self.requested = 0

    def close(self) -> None:
        self.sut.close()

    def _engine_checks(self, n: int, label: str) -> None:
        obs = self.sut.observe()
        bad = self.spec.check(obs)
        if bad:
            invs = sorted({i for i, _ in bad})
            raise _Finding("invariant", invs, f"after {label}: " + "; ".join(f"{i}: {w}" for i, w in bad[:4]), n)
        return None

    def _differential(self, n: int, action: str, params: dict[str, Any], label: str) -> None:
        pend = self.sut._pending_check
        msg = self.sut.differential_check(action, params)
        if pend is not None:
            self.compared += 1
        if msg:
            raise _Finding("differential", ["reuse_equals_recompute"], f"after {label}: {msg}", n)

    def step(self, n: int, action: str, params: dict[str, Any], mode: str) -> bool:
        label = action + "(" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")"
        if mode == "follow" or self.diverged is not None:
            try:
                self.sut.apply(action, dict(params))
            except ActionRejected:
                return False
            self._engine_checks(n, label)
            self._differential(n, action, params, label)
            return True
        inst = self.spec.instance(action, params)
        if mode == "probe" or not inst.guard(self.s):
            try:
                self.sut.apply(action, dict(params))
            except ActionRejected:
                return
            self._engine_checks(n, label)
            self._differential(n, action, params, label)
            raise _Finding("conformance", ["sut_accepted_disabled_action"],
                           f"{label}: the spec forbids it here, the engine did it", n)
        decision = self.spec.decide(self.s, params["r"]) if action == "lookup" else None
        self.s = inst.effect(self.s)
        try:
            obs = self.sut.apply(action, dict(params))
        except ActionRejected as e:
            raise _Finding("conformance", ["sut_rejected_enabled_action"],
                           f"{label}: the spec enables it, the engine refused ({e})", n) from None
        self._engine_checks(n, label)
        self._differential(n, action, params, label)
        if decision is not None:
            got = obs.get("decision")
            self.decisions[(got or decision)["kind"]] += 1
            self.requested += self.sut.engine.mgr.requests[params["r"]].n
            if got != decision:
                f = _Finding("conformance", ["decision_matches_spec"],
                             f"{label}: spec decided {decision}, engine {got}", n)
                if got and (got["kind"], got["k"]) == (decision["kind"], decision["k"]):
                    # only the reasons differ: the states stay in lockstep; keep the first such
                    # finding and keep looking for its consequence
                    self.soft = self.soft or f
                else:
                    self.diverged = f
                    self.focus = params["r"]
                    return True
            self._isolation(n, params["r"], label)
        if self.sut.observe() != self.s and self.diverged is None:
            names = [".".join(map(str, self.spec.lay.names[i])) for i, (a, b)
                     in enumerate(zip(self.sut.observe(), self.s)) if a != b][:6]
            self.diverged = _Finding("conformance", ["abstract_state_matches_spec"],
                                     f"after {label}: engine state differs from the spec at {', '.join(names)}", n)
        return True

    def _isolation(self, n: int, r: int, label: str) -> None:
        msg = self.sut.isolation_check(r)
        if msg:
            self.diverged = _Finding("conformance", ["decision_matches_spec"], f"{label}: {msg}", n)

    def follow_through(self, n0: int, steps: list[tuple[str, dict, str]]) -> list[tuple[str, dict, str]]:
        """After a divergence: drive the engine's requests to completion as the engine decides
        (the diverging one first), then serve fresh requests over the prefix. Steps taken are
        appended to `steps` as they run (so a finding mid-way keeps them)."""
        mgr = self.sut.engine.mgr
        n = [n0]

        def do(a: str, p: dict) -> bool:
            n[0] += 1
            steps.append((a, p, "follow"))
            return self.step(n[0], a, p, "follow")

        def drive(r: int) -> None:
            for _ in range(3 * self.spec.cfg.blocks + 6):
                q = mgr.requests.get(r)
                if q is None:
                    return
                if q.st == R_DECIDED:
                    a, p = "bind", {"r": r}
                elif q.st == R_BOUND:
                    a, p = "use", {"r": r}
                elif q.st == R_RUNNING:
                    a, p = ("append", {"r": r, "j": q.pos}) if q.pos < q.n else ("finish", {"r": r})
                elif q.st == R_WAITING:
                    a, p = "lookup", {"r": r}
                else:
                    return
                if not do(a, p):
                    return
                if a == "finish":
                    return

        order = sorted(r for r in mgr.requests if r >= 0)
        if self.focus in order:
            order.remove(self.focus)
            order.insert(0, self.focus)
        for r in order:
            drive(r)
        for r in range(self.spec.cfg.requests):
            q = mgr.requests.get(r)
            if q is None or q.st == 0:
                for nb in range(self.spec.cfg.blocks, 0, -1):     # fresh requests, every length
                    if do("submit", {"r": r, "n": nb}):
                        drive(r)
                break
        return steps


def _pick(rng: random.Random, insts: list, weights: dict[str, float]) -> Any:
    """An action by its theme weight (not by how many instances it has), then an instance."""
    by: dict[str, list] = {}
    for i in insts:
        by.setdefault(i.action, []).append(i)
    acts = sorted(by)
    a = rng.choices(acts, weights=[weights.get(x, 1.0) for x in acts], k=1)[0]
    return rng.choice(by[a])


def generate(spec: Spec, rng: random.Random, theme: str, length: int, probe_rate: float = 0.15
             ) -> tuple[list[tuple[str, dict, str]], tuple | None]:
    """One themed scenario: a list of steps (the spec's state is advanced as it is generated)."""
    weights = theme_weights(theme)
    s = spec.init()
    steps: list[tuple[str, dict, str]] = []
    for _ in range(length):
        en = spec.enabled(s)
        if rng.random() < probe_rate:
            dis = [i for i in spec.instances if i.action in PROBE_ACTIONS and not i.guard(s)]
            if dis:
                i = rng.choice(dis)
                steps.append((i.action, dict(i.params), "probe"))
                continue
        if not en:
            break
        i = _pick(rng, en, weights)
        steps.append((i.action, dict(i.params), "spec"))
        s = i.effect(s)
    return steps, s


def run_steps(spec: Spec, fault: str | None, steps: list[tuple[str, dict, str]], follow: bool = True
              ) -> tuple[_Finding | None, Runner, list[tuple[str, dict, str]]]:
    """Run steps; returns (finding, runner, the steps actually run incl. follow-through)."""
    runner = Runner(spec, fault)
    ran: list[tuple[str, dict, str]] = []
    try:
        for n, (a, p, mode) in enumerate(steps):
            ran.append((a, p, mode))
            runner.step(n, a, p, mode)
            if runner.diverged is not None and follow:
                runner.follow_through(n, ran)
                raise runner.diverged
        if runner.diverged is not None:
            raise runner.diverged
        if runner.soft is not None:
            raise runner.soft
    except _Finding as f:
        return f, runner, ran
    return None, runner, ran


def minimize(spec: Spec, fault: str | None, steps: list[tuple[str, dict, str]], checks: list[str],
             seconds: float = 20.0) -> list[tuple[str, dict, str]]:
    """Delete chunks, then single steps, while the same check still fails."""
    t0 = time.perf_counter()

    def fails(cand: list) -> list | None:
        f, r, ran = run_steps(spec, fault, cand, follow=True)
        r.close()
        return ran if f is not None and set(f.checks) & set(checks) else None

    cur = [s for s in steps if s[2] != "follow"]
    ran = fails(cur)
    if ran is None:
        return steps
    chunk = max(1, len(cur) // 2)
    while chunk >= 1 and time.perf_counter() - t0 < seconds:
        i, changed = 0, False
        while i < len(cur) and time.perf_counter() - t0 < seconds:
            cand = cur[:i] + cur[i + chunk:]
            got = fails(cand) if cand else None
            if got is not None:
                cur, ran, changed = cand, got, True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return ran


def to_trace(cfg: Config, steps: list[tuple[str, dict, str]], finding: _Finding, fault: str | None,
             seed: int) -> Trace:
    out = [Step(a, p, {"mode": m} if m != "spec" else {}) for a, p, m in steps]
    return Trace(cfg, out, fault=None, engine="diff", seed=seed, sut="reference",
                 violation={"step": len(steps) - 1, "kind": finding.kind, "checks": finding.checks,
                            "message": finding.message},
                 meta={"sut_fault": fault, "checks": "invariants on the engine state, reuse == recompute, "
                       "conformance; isolation probe after each lookup"})


def replay_reference(trace: Trace) -> dict[str, Any]:
    """Re-run a diff reproducer with every check; returns {exit_code, kind, checks, message}."""
    spec = Spec(trace.config)
    steps = [(s.action, s.params, s.expect.get("mode", "spec")) for s in trace.steps]
    f, r, _ = run_steps(spec, trace.meta.get("sut_fault"), steps, follow=False)
    r.close()
    if f is None:
        return {"exit_code": 0}
    return {"exit_code": EXIT[f.kind], "kind": f.kind, "checks": f.checks, "message": f.message}


def run_reference_diff(scenarios: int = 200, seed: int = 0, fault: str | None = None,
                       out_dir: str | Path = "kvcheck-report", config: Config | None = None,
                       length: int = 64, minimize_seconds: float = 20.0,
                       seconds: float | None = None) -> dict[str, Any]:
    """`seconds`: stop generating scenarios once spent (a time budget on top of `scenarios`)."""
    torch.set_num_threads(1)
    cfg = config or Config()
    spec = Spec(cfg)
    t0 = time.perf_counter()
    decisions: Counter = Counter()
    degradations: Counter = Counter()
    objects: Counter = Counter()
    themes: Counter = Counter()
    logical = usable = requested = compared = 0
    mismatches: list[dict[str, Any]] = []
    code = 0
    names = list(THEMES)
    run = 0
    soft = None
    for i in range(scenarios):
        if seconds is not None and i and time.perf_counter() - t0 >= seconds:
            if soft is not None:
                i, theme, f, ran = soft
                small = minimize(spec, fault, ran, f.checks, minimize_seconds)
                trace = to_trace(cfg, small, f, fault, seed)
                path = trace.save(Path(out_dir) / f"diff-reference-{fault or 'clean'}-seed{seed}-s{i}.json")
                mismatches.append({"scenario": i, "theme": theme, "kind": f.kind, "checks": f.checks,
                                   "message": f.message, "trace": str(path), "trace_steps": len(small),
                                   "replay": f"kvcheck replay {shlex.quote(str(path))} --sut reference"})
                code = EXIT[f.kind]
            break
        rng = random.Random(seed * 1_000_003 + i)
        theme = names[i % len(names)]
        steps, _ = generate(spec, rng, theme, length)
        f, r, ran = run_steps(spec, fault, steps)
        run += 1
        themes[theme] += 1
        eng = r.sut.engine
        st = eng.mgr.stats
        decisions.update(st["decisions"])
        degradations.update(st["degradations"])
        for k, v in eng.reused.items():
            objects[k] += v
        objects["on_disk"] += st["transitions"].get("on_disk:offloading->durable", 0) + sum(
            v for k, v in st["transitions"].items() if k.endswith(":restore"))
        logical += st["logical_blocks"]
        usable += st["usable_blocks"]
        requested += r.requested
        compared += r.compared
        r.close()
        if f is not None and f is r.soft:
            soft = soft or (i, theme, f, ran)       # a reasons-only divergence: keep looking
            f = None
        if f is None and soft is not None and i == scenarios - 1:
            i, theme, f, ran = soft
        if f is not None:
            small = minimize(spec, fault, ran, f.checks, minimize_seconds)
            f2, r2, ran2 = run_steps(spec, fault, [s for s in small if s[2] != "follow"], follow=True)
            r2.close()
            final, fin = (ran2, f2) if f2 is not None and set(f2.checks) & set(f.checks) else (ran, f)
            trace = to_trace(cfg, [s for s in final], fin, fault, seed)
            out = Path(out_dir)
            path = trace.save(out / f"diff-reference-{fault or 'clean'}-seed{seed}-s{i}.json")
            mismatches.append({"scenario": i, "theme": theme, "kind": fin.kind, "checks": fin.checks,
                               "message": fin.message, "trace": str(path), "trace_steps": len(final),
                               "replay": f"kvcheck replay {shlex.quote(str(path))} --sut reference"})
            code = EXIT[fin.kind]
            break
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
    negative control) under a time budget."""
    import tempfile
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
