"""The one trace builder and the one replay, on the lockstep core.

Every engine writes its steps with `to_trace` (random walks, the explorer, Z3, the fuzz
machine, `kvcheck diff`, the vLLM campaign) and `replay` runs any trace on the core: the
spec (and the SUT, when one is named) step by step, each step enabled, each lookup answering
what the trace expected, the invariants failing exactly where the trace says they did, and
the first divergence, differential or violation reported with its exit code.

A step the recorded SUT took alone, after it left the spec, is marked `"mode": "follow"`
(kvcheck diff's traces mark probes too). Replayed on a SUT that leaves the spec at the same
place, it runs on the SUT alone (refused: skipped, as when recorded), so the finding comes back;
on a SUT that stays with the spec (a fix), a follow step runs in lockstep where the spec enables
it and is sent as a negative probe where it does not: refused, it is skipped (`skipped_follow`
counts them), so a fixed engine replays clean; taken, it is the divergence it was when recorded
(the first step a SUT took alone may be the forbidden step itself).
"""
from __future__ import annotations

from typing import Any

from ..spec.sut import SpecSUT, SystemUnderTest
from ..spec.system import Spec
from ..spec.trace import Step, Trace
from ..spec.verdict import FOR_FINDING, ExitCode
from .guard import GuardedLockstep, ValuedSpecModel, guard
from .lockstep import Finding, Lockstep

WHY = {"decision_matches_spec": "SUT decision differs from the spec",
       "abstract_state_matches_spec": "SUT abstract state differs from the spec",
       "sut_accepted_disabled_action": "the spec forbids it here, the SUT did it",
       "sut_rejected_enabled_action": "SUT rejected it",
       "sut_raised": "the SUT raised an exception"}


def to_trace(spec: Spec | None, steps: list[tuple[str, dict[str, Any]]], seed: int | None,
             engine: str = "walk", expect_upto: int | None = None, *, cfg: Any = None,
             sut: str = "spec", finding: Finding | None = None, meta: dict[str, Any] | None = None,
             fault: str | None = None) -> Trace:
    """A trace with the decisions and violations the spec shows along the way as expectations
    (for the first `expect_upto` steps only: after a SUT left the spec, the spec expects
    nothing; without a spec, none). `finding`: the failure the trace reproduces."""
    out: list[Step] = []
    violation = None
    s = spec.init() if spec is not None else None
    for n, (action, params) in enumerate(steps):
        if spec is None or (expect_upto is not None and n >= expect_upto):
            # taken by the SUT alone after it left the spec: marked, so that an engine that no
            # longer leaves it (a fix) skips what the spec forbids there instead of failing
            out.append(Step(action, dict(params), {"mode": "follow"} if spec is not None else {}))
            continue
        inst = spec.instance(action, params)
        expect: dict[str, Any] = {}
        if action == "lookup":
            expect["decision"] = spec.decide(s, params["r"])
        s = inst.effect(s)
        bad = spec.check(s)
        if bad:
            expect["violations"] = sorted({inv for inv, _ in bad})
            violation = {"step": n, "action": inst.label(), "invariants": expect["violations"],
                         "where": [f"{inv}: {w}" for inv, w in bad]}
        out.append(Step(action, dict(params), expect))
    if finding is not None:
        violation = {"step": len(steps) - 1, "kind": finding.kind, "checks": finding.checks,
                     "check": finding.checks[0], "message": finding.message}
    return Trace(spec.cfg if spec is not None else cfg, out, spec.fault if spec is not None else fault,
                 engine, seed, sut, violation, meta or {})


def replay(trace: Trace, sut: SystemUnderTest | None = None, model: Any = None) -> tuple[int, dict[str, Any]]:
    """Run a trace on the core (the spec with the trace's fault as the model unless `model`
    says otherwise; the spec itself when no SUT is named). Returns (exit code, report)."""
    if model is None:
        model = ValuedSpecModel(Spec(trace.config, trace.fault))
    runs = guard(sut) if sut is not None else SpecSUT(trace.fault)   # a raise is a finding
    out: dict[str, Any] = {"steps": len(trace.steps), "fault": trace.fault, "sut": getattr(sut, "name", None)}
    try:
        runs.reset(trace.config)
    except Finding as f:
        return _found(out, 0, trace.steps[0], f) if trace.steps else FOR_FINDING[f.kind], out
    core: Lockstep = GuardedLockstep(model, runs, follow=False, full_check=True)
    try:
        code = _replay(core, trace, out, model)
    finally:
        try:
            core.close()
        except Finding as f:
            code = _found(out, len(trace.steps) - 1, trace.steps[-1], f) if trace.steps else FOR_FINDING[f.kind]
    return code, out


def _replay(core: Lockstep, trace: Trace, out: dict[str, Any], model: Any) -> int:
    for n, step in enumerate(trace.steps):
        mode = step.expect.get("mode")
        try:
            x = model.step(step.action, step.params)
        except KeyError as e:
            return _diverged(out, n, step, f"spec: {e.args[0]}", "step_enabled")
        try:
            if core.diverged is not None:
                if not core.follow_step(x) and mode not in ("follow", "probe"):
                    return ExitCode.CONFORMANCE      # the diverged SUT refuses the recorded step
                continue
            if not model.allows(core.s, x):
                if not core.probe(x):    # refused: right, unless it was recorded as a spec step
                    if mode == "follow":     # the recorded SUT was alone here; this one is not
                        out["skipped_follow"] = out.get("skipped_follow", 0) + 1
                        continue
                    if mode != "probe":
                        return _diverged(out, n, step, "not enabled in the spec", "step_enabled")
                _note(core, out, n, step)
                continue
            decision = model.decide(core.s, x)
            if decision is not None and "decision" in step.expect and step.expect["decision"] != decision:
                return _diverged(out, n, step, "spec decision differs from the trace", "decision_matches_trace",
                                 expected=step.expect["decision"], spec=decision)
            core.step(x)
        except Finding as f:
            _note(core, out, n, step)
            return _found(out, n, step, f)
        _note(core, out, n, step)
        expected = step.expect.get("violations")
        if expected and "divergence" not in out:
            return _diverged(out, n, step, "the trace expected a violation here; none occurred",
                             "violations_match_trace", expected=expected)
    if "divergence" in out:
        return ExitCode.CONFORMANCE
    if core.soft is not None:
        return _found(out, len(trace.steps) - 1, trace.steps[-1], core.soft)
    return ExitCode.OK


def _note(core: Lockstep, out: dict[str, Any], n: int, step: Step) -> None:
    """Record where the SUT left the model (the first time), before what it broke."""
    f = core.diverged
    if f is not None and "divergence" not in out:
        _diverged(out, n, step, WHY[f.checks[0]], f.checks[0], message=f.message)


def _diverged(out: dict[str, Any], n: int, step: Step, why: str, check: str, **more: Any) -> int:
    """Record the first divergence (a conformance finding, unless a worse one follows)."""
    out.setdefault("divergence", {"step": n, "action": step.label(), "why": why, **more})
    out.setdefault("finding", {"kind": "conformance", "checks": [check], "message": why, "step": n})
    return ExitCode.CONFORMANCE


def _found(out: dict[str, Any], n: int, step: Step, f: Finding) -> int:
    """Report the finding a replayed step raised, as the trace expected it or not."""
    if f.kind == "conformance":
        return _diverged(out, n, step, WHY.get(f.checks[0], f.message), f.checks[0], message=f.message)
    out["finding"] = {"kind": f.kind, "checks": f.checks, "message": f.message, "step": n}
    if f.kind == "invariant":
        out["violation"] = {"step": n, "action": step.label(), "invariants": f.checks, "where": f.where[:20]}
        expected = step.expect.get("violations")
        if expected is not None and expected != f.checks:
            out.pop("finding")
            return _diverged(out, n, step, "violated invariants differ from the trace",
                             "violations_match_trace", expected=expected, got=f.checks)
    elif f.kind == "differential":
        out["differential"] = {"step": n, "action": step.label(), "why": f.message}
    else:       # an adapter's own check
        out["violation"] = {"step": n, "action": step.label(), "kind": f.kind, "check": f.checks[0],
                            "message": f.message}
    return FOR_FINDING[f.kind]
