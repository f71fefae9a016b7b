"""Hypothesis stateful machines generated from the spec's action table.

Owns lockstep conformance: one rule per spec action (its precondition: some instance of it is
enabled in the spec), parameters drawn among the enabled instances, the step applied to the
spec and to the system under test; then the SUT's decision and abstract state must equal the
spec's, and every invariant must hold. Hypothesis shrinks a failure to a minimal program;
`target()` steers toward memory pressure, transfers in flight and boundary positions.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from hypothesis import strategies as st
from hypothesis import target
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from ..spec.objects import READY
from ..spec.sut import ActionRejected, SystemUnderTest, observed_mismatch
from ..spec.system import Instance, Spec


import time


class Finding(AssertionError):
    """A failure with the check that found it (`kind`: invariant | conformance | differential)."""

    def __init__(self, kind: str, checks: list[str], message: str) -> None:
        super().__init__(f"[{kind}] {message}")
        self.kind, self.checks, self.message = kind, checks, message


@dataclass
class Tally:
    """Shared across every example of a campaign (machines are created per example)."""

    steps: int = 0
    runs: int = 0
    actions: Counter = field(default_factory=Counter)
    decisions: Counter = field(default_factory=Counter)
    last_trail: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    first_failure_at: float | None = None      # perf_counter() of the first failing step
    steps_to_first_failure: int | None = None


def make_machine(spec: Spec, sut_factory: Callable[[], SystemUnderTest], tally: Tally,
                 differential: Callable[[SystemUnderTest, Instance, dict[str, Any]], None] | None = None
                 ) -> type[RuleBasedStateMachine]:
    """A RuleBasedStateMachine class for this spec and SUT."""
    probe = sut_factory()
    supported = getattr(probe, "actions", None)
    by_action: dict[str, list[Instance]] = {}
    for inst in spec.instances:
        if supported is None or inst.action in supported:
            by_action.setdefault(inst.action, []).append(inst)
    lay, cfg = spec.lay, spec.cfg
    occ_slots = [lay.o(o.group, o.kind, o.block, "st") for o in lay.objects]
    inflight = lay.g("inflight")
    rpos = [lay.r(r, "rpos") for r in range(cfg.requests)]
    boundaries = {j for g in cfg.groups if g.m for j in range(cfg.blocks + 1)
                  if (j * cfg.block_size) % g.m == 0 or j == cfg.window_lo_block(g.window, j) + 1}

    all_insts = [i for insts in by_action.values() for i in insts]

    def enabled_names(s: tuple) -> set[str]:
        """Actions with an enabled instance: one pass per step, so that Hypothesis's
        precondition checks during rule selection are set lookups."""
        return {i.action for i in all_insts if i.guard(s)}

    def __init__(self: Any) -> None:
        RuleBasedStateMachine.__init__(self)
        self.s = spec.init()
        self.sut = sut_factory()
        self.sut.reset(cfg)
        self.trail: list[tuple[str, dict[str, Any]]] = []
        self.pressure = self.transfers = self.at_boundary = 0
        self.enabled = enabled_names(self.s)
        tally.runs += 1
        tally.last_trail = self.trail

    def step(self: Any, inst: Instance) -> None:
        try:
            check(self, inst)
        except Finding:
            if tally.first_failure_at is None:
                tally.first_failure_at = time.perf_counter()
                tally.steps_to_first_failure = tally.steps
            raise

    def check(self: Any, inst: Instance) -> None:
        pre = self.s
        decision = spec.decide(pre, inst.params["r"]) if inst.action == "lookup" else None
        self.s = inst.effect(pre)
        self.trail.append((inst.action, dict(inst.params)))
        tally.steps += 1
        tally.actions[inst.action] += 1
        if decision is not None:
            tally.decisions[decision["kind"]] += 1
        try:
            obs = self.sut.apply(inst.action, dict(inst.params))
        except ActionRejected as e:
            raise Finding("conformance", ["sut_rejected_enabled_action"],
                          f"{inst.label()}: the spec enables it, the SUT rejected it ({e})") from None
        if decision is not None and obs.get("decision") != decision:
            raise Finding("conformance", ["decision_matches_spec"],
                          f"{inst.label()}: spec decided {decision}, SUT {obs.get('decision')}")
        diff = observed_mismatch(self.sut.observe(), self.s)
        if diff:
            names = [".".join(map(str, lay.names[i])) for i in diff[:6]]
            raise Finding("conformance", ["abstract_state_matches_spec"],
                          f"after {inst.label()}: SUT state differs from the spec at {', '.join(names)}")
        bad = spec.check_after(inst, self.s)
        if bad:
            invs = sorted({i for i, _ in bad})
            raise Finding("invariant", invs, f"after {inst.label()}: " +
                          "; ".join(f"{i}: {w}" for i, w in bad[:6]))
        if differential is not None and decision is not None:
            differential(self.sut, inst, decision)
        oracle = getattr(self.sut, "differential_check", None)
        if oracle is not None:
            msg = oracle(inst.action, dict(inst.params))
            if msg:
                raise Finding("differential", ["reuse_equals_recompute"], f"after {inst.label()}: {msg}")
        s = self.s
        self.enabled = enabled_names(s)
        self.pressure = max(self.pressure, sum(1 for i in occ_slots if s[i] == READY))
        self.transfers = max(self.transfers, s[inflight])
        self.at_boundary = max(self.at_boundary, sum(1 for i in rpos if s[i] in boundaries))

    def teardown(self: Any) -> None:
        target(float(self.pressure), label="memory pressure (ready objects)")
        target(float(self.transfers), label="transfers in flight")
        target(float(self.at_boundary), label="requests at window/compression boundaries")

    attrs: dict[str, Any] = {"__init__": __init__, "step": step, "teardown": teardown}
    for name, insts in by_action.items():
        # Parameters are drawn from the action's static instance list; a drawn instance that is
        # not enabled is a no-op. This keeps a step's meaning stable while Hypothesis deletes
        # other steps, which is what lets it shrink (drawing among the currently enabled ones
        # would shift every later choice).
        def body(self: Any, inst: Instance) -> None:
            if inst.guard(self.s):
                self.step(inst)
        body.__name__ = name
        guard = (lambda name: lambda self: name in self.enabled)(name)
        attrs[name] = precondition(guard)(rule(inst=st.sampled_from(insts))(body))
    return type("KVCacheMachine", (RuleBasedStateMachine,), attrs)
