"""Hypothesis stateful machines generated from the spec's action table: a thin driver of the
lockstep core (kvcheck.fuzz.lockstep), which steps the spec and the SUT and checks them.

Owns what Hypothesis draws: one rule for every step (an enabled action on the example's mix,
then one of its enabled instances, or a negative probe), swarm coins per example, `target()`
toward memory pressure, transfers in flight and boundary positions; and the campaign's tally.
A failure's chosen steps are shrunk further by the one shrinker (kvcheck.fuzz.shrink).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from hypothesis import strategies as st
from hypothesis import target
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from ..spec.objects import READY
from ..spec.sut import SystemUnderTest
from ..spec.system import Instance, Spec
from ..spec.workloads import BASE, THEMES, weights as theme_weights
from .guard import GuardedLockstep, ValuedSpecModel, guard
from ..spec.severity import rank
from .lockstep import Finding, Lockstep, lead
from . import shrink as shrinking
from .walk import CORE, WEIGHTS

# Every draw is a byte: Hypothesis draws integers within 256 of zero uniformly, but a wider
# range from a log-scaled distribution that piles up near zero. Measured for a 16-bit draw:
# 19% fell below 256 (the first enabled action, meant to get 0.4%) and 72% below 6554 (a
# negative probe, meant to be 10%). An action is a point on the cumulative weights made of two
# bytes; a probe is the first PROBE_BYTES values of the first.
BYTE = st.integers(0, 255)
WANTED_BOOST = 20.0      # Tally.steer: an action enabled but never drawn weighs 20x while it is wanted
PROBE_BYTES = 26          # 26/256: about one step in ten is a negative probe (where there are any)

# The action mixes an example draws from: the random walker's (first: what examples shrink
# towards), then the workload themes of `kvcheck diff` (version bumps, offload and reload,
# memory pressure, ...), where the actions that deep faults need are common.
# The machine's own mix besides them (not a `kvcheck diff` theme, whose scenarios it would redraw):
# a bound lease waits (use is slow) while versions move, for the stale fallbacks of bind and use.
STALE_LEASES = {**BASE, "bump_model": 0.3, "bump_compressor": 0.3, "bump_indexer": 0.3, "bump_abi": 0.3,
                "use": 0.2, "bind": 6}
MIXES: list[tuple[str, dict[str, float]]] = [("walk", WEIGHTS)] + [(t, theme_weights(t)) for t in THEMES] \
    + [("stale_leases", STALE_LEASES)]
# (The version bumps keep their coins: a stale indexer shows only when the indexer is the one
# bumped, a weight update making the whole prefix stale; engine_indexer_version_ignored was found
# in 2 of 5 seeds with the theme's bumps always on, 5 of 5 with their coins.)
EMPHASIS: list[frozenset[str]] = [frozenset(n for n, w in THEMES.get(t, {}).items()
                                            if w > BASE.get(n, 1.0) and not n.startswith("bump_"))
                                  for t, _ in MIXES]


class BudgetSpent(BaseException):
    """The campaign's budget (time or steps) is spent (raised as an example starts; once a
    failure is found, when its shrinking time is up). A BaseException so that Hypothesis stops at once instead of
    counting it as a failure: its target phase has no time bound of its own."""


@dataclass
class Tally:
    """Shared across every example of a campaign (machines are created per example)."""

    steps: int = 0
    runs: int = 0
    actions: Counter = field(default_factory=Counter)
    decisions: Counter = field(default_factory=Counter)
    enabled: set = field(default_factory=set)   # actions the spec enabled at some step of some example
    last: Lockstep | None = None               # the core of the latest example
    soft: "Finding | None" = None              # shortest example where only decision reasons differed
    first_failure_at: float | None = None      # perf_counter() of the first failing step
    steps_to_first_failure: int | None = None
    first_by_check: dict[str, tuple[float, int]] = field(default_factory=dict)  # check -> (time, steps)
    raised: Counter = field(default_factory=Counter)   # check -> times raised (not the shrinker's replays)
    kind_of: dict[str, str] = field(default_factory=dict)   # check -> the kind of finding that raised it
    first_check: str | None = None             # the check of the first failure
    deadline: float | None = None              # perf_counter() when the campaign's budget ends
    max_steps: int | None = None               # ... or the step count where it ends
    shrink_seconds: float = 60.0               # how long past the first failure it may shrink
    best: "Finding | None" = None              # the most specific, then shortest, failure raised
    replaying: bool = False                    # shrink_finding's replays: never out of budget
    steering: dict = field(default_factory=dict)   # an example's drawn key -> (turn, wanted): Tally.steer

    def steer(self, key: tuple) -> tuple[int, frozenset]:
        """Coverage as feedback, on the spec's own actions: an example wants the actions the
        campaign has seen enabled but never drawn (a stale lease's fallback is enabled for a step
        or two) and draws them WANTED_BOOST times as often; and the examples take the action mixes
        in turn (drawn at random, 16 examples missed one of 11 mixes one campaign in five).
        Remembered by the example's own draws (`key`), so that a replay of the same example, in
        Hypothesis's shrinking, steers as the first run did."""
        if key not in self.steering:
            self.steering[key] = (self.runs, frozenset(self.enabled) - frozenset(self.actions))
        return self.steering[key]

    def out_of_time(self) -> bool:
        if self.replaying:
            return False
        if self.first_failure_at is not None:     # a failure found: only its shrinking is left
            return time.perf_counter() > self.first_failure_at + self.shrink_seconds
        if self.max_steps is not None and self.steps >= self.max_steps:
            return True
        # at least one step: a budget spent before the first step (Hypothesis starting on a busy
        # machine) would otherwise give a campaign of nothing
        return self.deadline is not None and self.steps > 0 and time.perf_counter() > self.deadline

    @property
    def last_trail(self) -> list[tuple[str, dict[str, Any]]]:
        return self.last.trail if self.last is not None else []

    @property
    def lockstep(self) -> int:
        """Steps of last_trail taken in lockstep with the spec."""
        return self.last.lockstep if self.last is not None else 0

    def count(self, action: str, decision: dict[str, Any] | None) -> None:
        self.steps += 1
        self.actions[action] += 1
        if decision is not None:
            self.decisions[decision["kind"]] += 1

    def found(self, f: "Finding") -> None:
        if self.best is None or f.rank() < self.best.rank():
            self.best = f
        now = time.perf_counter()
        if self.first_failure_at is None:
            self.first_failure_at, self.steps_to_first_failure = now, self.steps
            self.first_check = f.checks[0] if f.checks else None
        if self.replaying:
            return
        for c in f.checks:
            self.first_by_check.setdefault(c, (now, self.steps))
            self.raised[c] += 1
            self.kind_of.setdefault(c, f.kind)

    def checks_raised(self, t0: float) -> list[dict[str, Any]]:
        """Every distinct check raised in the campaign, most serious first: how often, and the
        step and time of its first failure."""
        out = [{"check": c, "kind": self.kind_of[c], "count": n, "first_step": self.first_by_check[c][1],
                "first_seconds": round(self.first_by_check[c][0] - t0, 2)} for c, n in self.raised.items()]
        return sorted(out, key=lambda d: (*rank(d["kind"], [d["check"]]), d["first_step"]))


def drive_model(spec: Spec, sut_factory: Callable[[], SystemUnderTest], actions: Any = None) -> ValuedSpecModel:
    """The model a SUT is driven against, over the actions it declares: every driver of the
    spec's alphabet (this machine, the exhaustive search) draws from the same instances."""
    declared = getattr(sut_factory(), "actions", None)
    # a SUT that declares a set when constructed and another one for this config after its reset
    # (the hash-chain base class) is driven with the latter (one that declares None when
    # constructed keeps its draws: the reference engine's campaigns stay as they were)
    if actions is not None and declared is not None and set(actions) != set(declared) & set(spec.actions):
        declared = frozenset(actions)
    return ValuedSpecModel(spec, declared)


def make_machine(spec: Spec, sut_factory: Callable[[], SystemUnderTest], tally: Tally,
                 actions: Any = None) -> type[RuleBasedStateMachine]:
    """A RuleBasedStateMachine class for this spec and SUT. `actions`: what the SUT declares
    after its reset for this config (campaign.machine_actions); else what a fresh one declares."""
    model = drive_model(spec, sut_factory, actions)
    lay, cfg = spec.lay, spec.cfg
    occ_slots = [lay.o(o.group, o.kind, o.block, "st") for o in lay.objects]
    inflight = lay.g("inflight")
    rpos = [lay.r(r, "rpos") for r in range(cfg.requests)]
    boundaries = {j for g in cfg.groups if g.m for j in range(cfg.blocks + 1)
                  if (j * cfg.block_size) % g.m == 0 or j == cfg.window_lo_block(g.window, j) + 1}
    all_insts = model.instances
    action_names = sorted({i.action for i in all_insts})

    def enabled_by_action(s: tuple) -> dict[str, list[Instance]]:
        """The enabled instances, per action (one pass over the guards per step)."""
        out: dict[str, list[Instance]] = {}
        for i in all_insts:
            if i.guard(s):
                out.setdefault(i.action, []).append(i)
        return out

    def __init__(self: Any) -> None:
        if tally.out_of_time():
            raise BudgetSpent()
        RuleBasedStateMachine.__init__(self)
        sut = guard(sut_factory())       # whatever the SUT raises is a finding
        sut.reset(cfg)
        self.core = GuardedLockstep(model, sut, count=tally.count, after=self.after, found=tally.found)
        self.pressure = self.transfers = self.at_boundary = 0
        self.enabled = enabled_by_action(self.core.s)
        tally.enabled.update(self.enabled)
        self.off: frozenset[str] = frozenset()
        self.weights = WEIGHTS
        self.wanted: frozenset[str] = frozenset()
        tally.runs += 1
        tally.last = self.core

    def after(self: Any, s: tuple) -> None:
        self.enabled = enabled_by_action(s)
        tally.enabled.update(self.enabled)
        self.pressure = max(self.pressure, sum(1 for i in occ_slots if s[i] == READY))
        self.transfers = max(self.transfers, s[inflight])
        self.at_boundary = max(self.at_boundary, sum(1 for i in rpos if s[i] in boundaries))

    def teardown(self: Any) -> None:
        core = self.core
        try:
            core.end()
        finally:
            core.close()
        if core.soft is not None:
            # Only a decision's reasons differed: not a failure of this example, so the campaign
            # keeps looking for what the difference breaks (reported at the end, the shortest
            # such example, if nothing else fails).
            f = core.stamp(core.soft)
            if tally.soft is None or len(f.trail) < len(tally.soft.trail):
                tally.soft = f
        target(float(self.pressure), label="memory pressure (ready objects)")
        target(float(self.transfers), label="transfers in flight")
        target(float(self.at_boundary), label="requests at window/compression boundaries")

    # Swarm testing, as the random walker does it: each example takes the next action mix (Tally.steer) and
    # switches off each non-core action with probability 1/2 (a coin each; shrinks towards the
    # walker's mix with nothing off). Deep faults need long runs of the core actions that noise
    # (eviction, migration, corruption) breaks, some need an action that is rare in the
    # everyday mix (a weight update), and some need one bump without the others (a stale
    # indexer alone: a weight update would make the whole prefix stale and hide it).
    # The stale fallbacks are not noise: they are bind and use when the state moved under the
    # lease, the only way on for that request (off, a stale lease just waits, and the fallback
    # path went unexercised in most 2,000-step campaigns).
    noise = sorted(n for n in action_names if n not in CORE and n not in ("bind_stale", "use_stale"))

    # A theme never switches off what it is about (the actions it weighs above the everyday mix,
    # bumps aside: EMPHASIS): an offload-and-reload example with its prefetch coin off cannot
    # reach a verified reload, and with six such coins the path that ends in verify_ok came up in
    # 1 example of ~300. The wanted actions' boost is folded into the example's weights here,
    # once, not in every step's draw.
    def swarm(self: Any, off: list[bool], tag: bytes) -> None:
        turn, self.wanted = tally.steer((tuple(off), tag))
        mix = turn % len(MIXES)
        w = MIXES[mix][1]
        self.weights = {**w, **{n: w.get(n, 1.0) * WANTED_BOOST for n in self.wanted}} if self.wanted else w
        keep = EMPHASIS[mix]
        self.off = frozenset(n for n, o in zip(noise, off) if o and n not in keep and n not in self.wanted)

    # One rule for every step: an enabled action (a point on the mix's cumulative weights, so
    # version bumps are rare in the walker's mix), then one of its enabled instances by an
    # integer modulo how many there are. Every step is a real step (no no-op draws) and costs
    # three byte draws: per-action rules with preconditions cost ~25 draws a step in rule
    # selection, and half their steps drew a disabled instance.
    def act(self: Any, a: int, b: int, i: int) -> None:
        core = self.core
        lo = PROBE_BYTES if core.probes else 0
        if a < lo and core.diverged is None:
            dis = [x for x in core.probes if not x.guard(core.s)]
            if dis:
                core.probe(dis[i % len(dis)])
            return
        if a < lo:               # following a diverged SUT: no probes, the draw is a plain step
            point = (a * 256 + b + 0.5) / (lo * 256)
        else:
            point = ((a - lo) * 256 + b + 0.5) / ((256 - lo) * 256)
        names = [n for n in action_names if n in self.enabled and n not in self.off] \
            or [n for n in action_names if n in self.enabled]
        if not names:
            return
        w = self.weights
        x, pick = point * sum(w.get(n, 1.0) for n in names), names[-1]
        for n in names:
            x -= w.get(n, 1.0)
            if x < 0:
                pick = n
                break
        insts = self.enabled[pick]
        core.step(insts[i % len(insts)])

    attrs: dict[str, Any] = {"__init__": __init__, "after": after, "teardown": teardown}
    attrs["swarm"] = initialize(off=st.lists(st.booleans(), min_size=len(noise), max_size=len(noise)),
                                tag=st.binary(min_size=4, max_size=4))(swarm)
    attrs["act"] = rule(a=BYTE, b=BYTE, i=BYTE)(act)
    return type("KVCacheMachine", (RuleBasedStateMachine,), attrs)


def run_program(machine: type[RuleBasedStateMachine], program: list[Instance],
                choices: list[list[Instance]] | None = None) -> Finding | None:
    """Run chosen steps on a fresh machine outside Hypothesis (on the core: a step not enabled
    where it falls is skipped, as the rule would not have drawn it). Returns the finding, if
    any. `choices` gets, per step, the other instances of its action that were enabled there."""
    try:
        m: Any = machine()
    except Finding as f:          # the SUT raised in reset: every program fails the same way
        f.program = f.program or list(program[:1])
        return f

    def note(core: Lockstep, inst: Instance) -> None:
        choices.append([x for x in m.enabled.get(inst.action, ()) if x is not inst])   # type: ignore[union-attr]
    try:
        return m.core.run(program, **({"before": note} if choices is not None else {}))
    except Finding as f:          # raised while the run was closed
        return f


def shrink_finding(machine: type[RuleBasedStateMachine], tally: Tally, f: Finding,
                   seconds: float) -> Finding:
    """Shrink what the failing example chose, which is what a trace reader sees (Hypothesis
    shrinks the choices, slowly for long stateful runs): the one shrinker, with each step's
    other enabled instances as substitutes. A candidate counts when the same kind of finding,
    with the same leading check, comes out."""
    if not f.program:
        return f
    want = lead(f.checks)
    saved = (tally.steps, Counter(tally.actions), Counter(tally.decisions), tally.best)
    tally.replaying = True

    def alternatives(prog: list[Instance]) -> list[list[Instance]]:
        choices: list[list[Instance]] = []
        run_program(machine, prog, choices)
        return choices

    try:
        return shrinking.shrink_finding(f, lambda prog: run_program(machine, prog),
                                        lambda g: (g.kind, g.soft) == (f.kind, f.soft) and want in g.checks,
                                        seconds, alternatives)
    finally:      # replays are not campaign steps
        tally.steps, tally.actions, tally.decisions, tally.best = saved
        tally.replaying = False
