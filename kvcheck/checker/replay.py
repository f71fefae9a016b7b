"""`kvcheck replay TRACE`: run a trace from any engine on the spec (and on a system under test,
when one is named) and report the first step where they diverge.

Owns conformance in the spec -> SUT direction for recorded traces: each step must be enabled,
each lookup must answer what the trace expected, and the invariants must fail exactly where
the trace says they did.
"""
from __future__ import annotations

from typing import Any

from ..fuzz.suts import resolve_sut
from ..spec.sut import ActionRejected, SystemUnderTest, observed_mismatch
from ..spec.system import Spec
from ..spec.trace import Trace
from ..spec.verdict import ExitCode

EXIT_OK, EXIT_INVARIANT, EXIT_DIFF, EXIT_CONFORMANCE = ExitCode.OK, ExitCode.INVARIANT, ExitCode.DIFF, ExitCode.CONFORMANCE


def replay_trace(trace: Trace, sut: SystemUnderTest | None = None) -> tuple[int, dict[str, Any]]:
    spec = Spec(trace.config, trace.fault)
    s = spec.init()
    if sut is not None:
        sut.reset(trace.config)
    out: dict[str, Any] = {"steps": len(trace.steps), "fault": trace.fault,
                           "sut": getattr(sut, "name", None)}
    following = False       # after a divergence: the SUT alone, judged by the invariants
    for n, step in enumerate(trace.steps):
        if following:
            try:
                sut.apply(step.action, step.params)
            except ActionRejected:
                return EXIT_CONFORMANCE, out
            s = tuple(sut.observe())
            if _violated(spec, s, n, step, out):
                return EXIT_INVARIANT, out
            continue
        try:
            inst = spec.instance(step.action, step.params)
        except KeyError as e:
            out["divergence"] = {"step": n, "action": step.label(), "why": f"spec: {e.args[0]}"}
            return EXIT_CONFORMANCE, out
        if not inst.guard(s):
            if sut is not None and _accepts(sut, step.action, step.params):
                # a negative probe the SUT took: follow it from here, judged by the invariants
                out["divergence"] = {"step": n, "action": step.label(),
                                     "why": "the spec forbids it here, the SUT did it"}
                seen = sut.observe()
                if not (isinstance(seen, tuple) and len(seen) == len(s)):
                    return EXIT_CONFORMANCE, out
                s, following = tuple(seen), True
                if _violated(spec, s, n, step, out):
                    return EXIT_INVARIANT, out
                continue
            out["divergence"] = {"step": n, "action": step.label(), "why": "not enabled in the spec"}
            return EXIT_CONFORMANCE, out
        decision = spec.decide(s, step.params["r"]) if step.action == "lookup" else None
        s = inst.effect(s)
        if decision is not None and "decision" in step.expect and step.expect["decision"] != decision:
            out["divergence"] = {"step": n, "action": step.label(), "why": "spec decision differs from the trace",
                                 "expected": step.expect["decision"], "spec": decision}
            return EXIT_CONFORMANCE, out
        if sut is not None:
            try:
                obs = sut.apply(step.action, step.params)
            except ActionRejected as e:
                out["divergence"] = {"step": n, "action": step.label(), "why": f"SUT rejected it: {e}"}
                return EXIT_CONFORMANCE, out
            oracle = getattr(sut, "differential_check", None)
            msg = oracle(step.action, dict(step.params)) if oracle is not None else None
            if msg:
                out["differential"] = {"step": n, "action": step.label(), "why": msg}
                return EXIT_DIFF, out
            seen = sut.observe()
            why = None
            if decision is not None and obs.get("decision") != decision:
                why = {"why": "SUT decision differs from the spec", "spec": decision, "sut": obs.get("decision")}
            elif observed_mismatch(seen, s):
                names = [spec.lay.names[i] for i in observed_mismatch(seen, s)][:10]
                why = {"why": "SUT abstract state differs from the spec",
                       "slots": [".".join(map(str, k)) for k in names]}
            if why is not None:
                out.setdefault("divergence", {"step": n, "action": step.label(), **why})
                if not (isinstance(seen, tuple) and len(seen) == len(s)):
                    return EXIT_CONFORMANCE, out
                # Follow the SUT alone from here: its abstract state is a spec state, so the
                # spec's invariants still judge what it does next (a wrong decision shows its
                # consequence a step later, e.g. a bound hit whose window is not covered).
                s = tuple(seen)
                following = True
        expected = step.expect.get("violations")
        if _violated(spec, s, n, step, out):
            got = out["violation"]["invariants"]
            if expected is not None and expected != got:
                out["divergence"] = {"step": n, "action": step.label(),
                                     "why": "violated invariants differ from the trace",
                                     "expected": expected, "got": got}
                return EXIT_CONFORMANCE, out
            return EXIT_INVARIANT, out
        if expected and "divergence" not in out:
            out["divergence"] = {"step": n, "action": step.label(),
                                 "why": "the trace expected a violation here; none occurred",
                                 "expected": expected}
            return EXIT_CONFORMANCE, out
    if "divergence" in out:
        return EXIT_CONFORMANCE, out
    return EXIT_OK, out


def _violated(spec: Spec, s: tuple, n: int, step: Any, out: dict[str, Any]) -> bool:
    """Record, in `out`, the invariants state s violates after step n (if any)."""
    bad = spec.check(s)
    if bad:
        out["violation"] = {"step": n, "action": step.label(), "invariants": sorted({inv for inv, _ in bad}),
                            "where": [f"{inv}: {w}" for inv, w in bad][:20]}
    return bool(bad)


def _accepts(sut: SystemUnderTest, action: str, params: dict[str, Any]) -> bool:
    try:
        sut.apply(action, dict(params))
    except ActionRejected:
        return False
    return True


def sut_by_name(name: str, fault: str | None) -> SystemUnderTest:
    return resolve_sut(name, fault)()
