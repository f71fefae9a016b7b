"""Hypothesis stateful machines generated from the spec's action table.

Owns lockstep conformance: one rule per spec action (its precondition: some instance of it is
enabled in the spec), parameters drawn among the enabled instances, the step applied to the
spec and to the system under test; then the SUT's decision and abstract state must equal the
spec's, and every invariant must hold. Hypothesis shrinks a failure to a minimal program;
`target()` steers toward memory pressure, transfers in flight and boundary positions.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from hypothesis import strategies as st
from hypothesis import target
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from ..spec.objects import R_IDLE, READY
from ..spec.sut import PROBE_ACTIONS, ActionRejected, SystemUnderTest, observed_mismatch
from ..spec.system import Instance, Spec
from ..spec.workloads import THEMES, weights as theme_weights
from .walk import CORE, WEIGHTS

# Every draw is a byte: Hypothesis draws integers within 256 of zero uniformly, but a wider
# range from a log-scaled distribution that piles up near zero. Measured for a 16-bit draw:
# 19% fell below 256 (the first enabled action, meant to get 0.4%) and 72% below 6554 (a
# negative probe, meant to be 10%). An action is a point on the cumulative weights made of two
# bytes; a probe is the first PROBE_BYTES values of the first.
BYTE = st.integers(0, 255)
PROBE_BYTES = 26          # 26/256: about one step in ten is a negative probe (where there are any)

# The order in which a diverged request is driven to completion (the first enabled one wins).
DRIVE = ("bind", "bind_stale", "use", "use_stale", "append", "finish", "lookup")

# The action mixes an example draws from: the random walker's (first: what examples shrink
# towards), then the workload themes of `kvcheck diff` (version bumps, offload and reload,
# memory pressure, ...), where the actions that deep faults need are common.
MIXES: list[tuple[str, dict[str, float]]] = [("walk", WEIGHTS)] + [(t, theme_weights(t)) for t in THEMES]


class BudgetSpent(BaseException):
    """The campaign's budget (time or steps) is spent (raised as an example starts; once a
    failure is found, when its shrinking time is up). A BaseException so that Hypothesis stops at once instead of
    counting it as a failure: its target phase has no time bound of its own."""


class Finding(AssertionError):
    """A failure with the check that found it (`kind`: invariant | conformance | differential)."""

    def __init__(self, kind: str, checks: list[str], message: str) -> None:
        super().__init__(f"[{kind}] {message}")
        self.kind, self.checks, self.message = kind, checks, message
        self.trail: list[tuple[str, dict[str, Any]]] = []   # the steps of the failing example
        self.program: list[Instance] = []                    # ... that its rules chose
        self.soft = False                                    # only a decision's reasons differ
        self.lockstep = 0                                    # ... taken in lockstep with the spec

    KINDS = ("invariant", "differential", "conformance")     # most specific first

    def rank(self) -> tuple[int, int, int]:
        """Most specific first: what a divergence breaks before the divergence; among
        divergences, a wrong decision or state before a forbidden action merely accepted."""
        return self.KINDS.index(self.kind), self.checks == ["sut_accepted_disabled_action"], len(self.trail)


@dataclass
class Tally:
    """Shared across every example of a campaign (machines are created per example)."""

    steps: int = 0
    runs: int = 0
    actions: Counter = field(default_factory=Counter)
    decisions: Counter = field(default_factory=Counter)
    last_trail: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    lockstep: int = 0                          # steps of last_trail taken in lockstep with the spec
    soft: "Finding | None" = None              # shortest example where only decision reasons differed
    first_failure_at: float | None = None      # perf_counter() of the first failing step
    steps_to_first_failure: int | None = None
    first_by_check: dict[str, tuple[float, int]] = field(default_factory=dict)  # check -> (time, steps)
    deadline: float | None = None              # perf_counter() when the campaign's budget ends
    max_steps: int | None = None               # ... or the step count where it ends
    shrink_seconds: float = 60.0               # how long past the first failure it may shrink
    best: "Finding | None" = None              # the most specific, then shortest, failure raised
    replaying: bool = False                    # shrink_finding's replays: never out of budget

    def out_of_time(self) -> bool:
        if self.replaying:
            return False
        if self.first_failure_at is not None:     # a failure found: only its shrinking is left
            return time.perf_counter() > self.first_failure_at + self.shrink_seconds
        if self.max_steps is not None and self.steps >= self.max_steps:
            return True
        return self.deadline is not None and time.perf_counter() > self.deadline

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
        for c in f.checks:
            self.first_by_check.setdefault(c, (now, self.steps))


def make_machine(spec: Spec, sut_factory: Callable[[], SystemUnderTest], tally: Tally,
                 differential: Callable[[SystemUnderTest, Instance, dict[str, Any]], None] | None = None
                 ) -> type[RuleBasedStateMachine]:
    """A RuleBasedStateMachine class for this spec and SUT."""
    probe_sut = sut_factory()
    supported = getattr(probe_sut, "actions", None)
    # optional adapter hook: after a lookup, would another tenant hit this request's prefix?
    isolation = getattr(type(probe_sut), "isolation_check", None)
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
    size = lay.size
    rst = [lay.r(r, "rst") for r in range(cfg.requests)]
    per_request: list[dict[str, list[Instance]]] = [{} for _ in range(cfg.requests)]
    for i in all_insts:
        if "r" in i.params:
            per_request[i.params["r"]].setdefault(i.action, []).append(i)

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
        self.s = spec.init()
        self.sut = sut_factory()
        self.sut.reset(cfg)
        self.trail: list[tuple[str, dict[str, Any]]] = []
        self.pressure = self.transfers = self.at_boundary = 0
        self.enabled = enabled_by_action(self.s)
        self.off: frozenset[str] = frozenset()
        self.weights = WEIGHTS
        self.diverged: Finding | None = None    # set: the SUT left the spec; it is followed alone
        self.soft: Finding | None = None        # a decision whose reasons alone differ
        self.failed = False
        self.program: list[Instance] = []       # the steps the rules chose (not follow-through)
        tally.runs += 1
        tally.last_trail, tally.lockstep = self.trail, 0

    def step(self: Any, inst: Instance, run: Callable[[Any, Instance], Any] | None = None) -> None:
        """One step (in lockstep, or following a diverged SUT, or `run`); a finding raised by
        it is the example's failure."""
        try:
            (run or (check if self.diverged is None else follow_step))(self, inst)
        except Finding as f:
            raise fail(self, f) from None

    def stamp(self: Any, f: Finding) -> Finding:
        """Attach the example's steps so far to a finding."""
        f.trail, f.lockstep, f.program = list(self.trail), tally.lockstep, list(self.program)
        return f

    def fail(self: Any, f: Finding) -> Finding:
        tally.found(stamp(self, f))
        self.failed = True
        return f

    def judge(self: Any, label: str, seen: Any, s_spec: tuple | None, inst: Instance | None) -> None:
        """Invariants on the SUT's own state, then the differential oracle: the two checks that
        say what a divergence *does* (they run before conformance, as in `kvcheck diff`)."""
        if s_spec is not None and inst is not None and seen == s_spec:
            bad = spec.check_after(inst, s_spec)      # in lockstep: only conjuncts the step can change
        elif isinstance(seen, tuple) and len(seen) == size:
            bad = spec.check(seen)
        elif s_spec is not None and inst is not None:
            bad = spec.check_after(inst, s_spec)      # partial or no observation: the spec's state
        else:
            bad = []
        if bad:
            invs = sorted({i for i, _ in bad})
            raise Finding("invariant", invs, f"after {label}: " +
                          "; ".join(f"{i}: {w}" for i, w in bad[:6]))

    def oracle(self: Any, label: str, action: str, params: dict[str, Any]) -> None:
        fn = getattr(self.sut, "differential_check", None)
        msg = fn(action, dict(params)) if fn is not None else None
        if msg:
            raise Finding("differential", ["reuse_equals_recompute"], f"after {label}: {msg}")

    def check(self: Any, inst: Instance) -> None:
        pre = self.s
        label = inst.label()
        decision = spec.decide(pre, inst.params["r"]) if inst.action == "lookup" else None
        self.s = inst.effect(pre)
        self.trail.append((inst.action, dict(inst.params)))
        tally.lockstep = len(self.trail)
        tally.count(inst.action, decision)
        try:
            obs = self.sut.apply(inst.action, dict(inst.params))
        except ActionRejected as e:
            self.trail.pop()                    # the SUT did not take this step
            tally.lockstep -= 1
            self.diverge(Finding("conformance", ["sut_rejected_enabled_action"],
                                 f"{label}: the spec enables it, the SUT rejected it ({e})"),
                         self.sut.observe(), inst.params.get("r"))
            return
        seen = self.sut.observe()
        self.judge(label, seen, self.s, inst)
        if differential is not None and decision is not None:
            differential(self.sut, inst, decision)
        self.oracle(label, inst.action, inst.params)
        got = obs.get("decision") if decision is not None else None
        if decision is not None and got != decision:
            f = Finding("conformance", ["decision_matches_spec"],
                        f"{label}: spec decided {decision}, SUT {got}")
            if got and (got.get("kind"), got.get("k")) == (decision["kind"], decision["k"]):
                f.soft = True
                self.soft = self.soft or f      # only the reasons differ: still in lockstep
            else:
                self.diverge(f, seen, inst.params["r"])
                return
        if decision is not None and isolation is not None:
            msg = isolation(self.sut, inst.params["r"])
            if msg:     # the SUT's state is the spec's, but another tenant would hit this prefix
                raise Finding("conformance", ["decision_matches_spec"], f"{label}: {msg}")
        diff = observed_mismatch(seen, self.s)
        if diff:
            names = [".".join(map(str, lay.names[i])) for i in diff[:6]]
            self.diverge(Finding("conformance", ["abstract_state_matches_spec"],
                                 f"after {label}: SUT state differs from the spec at {', '.join(names)}"),
                         seen, inst.params.get("r"))
            return
        self.after(self.s)

    def diverge(self: Any, f: Finding, seen: Any, focus: int | None) -> None:
        """The SUT left the spec. When it exposes its whole state, follow it alone (its state
        read as a spec state, judged by the invariants and the oracle): drive the diverging
        request to completion as the SUT decides, then serve a fresh request over the prefix,
        so that a wrong decision is reported by the check it breaks. Otherwise, or when nothing
        breaks, the finding is the divergence itself (raised at the end of the example)."""
        self.diverged = stamp(self, f)    # its trace ends here, unless a consequence shows
        if not (isinstance(seen, tuple) and len(seen) == size):
            raise f
        self.s = tuple(seen)
        drive = [focus] if focus is not None else []
        drive += [r for r in range(cfg.requests) if r != focus and self.s[rst[r]] != R_IDLE]
        for r in drive:
            self.drive(r)
        for r in range(cfg.requests):
            if self.s[rst[r]] == R_IDLE:
                for n in range(cfg.blocks, 0, -1):
                    if follow_step(self, spec.instance("submit", {"r": r, "n": n})):
                        self.drive(r)
                        break
                break
        self.after(self.s)

    def drive(self: Any, r: int) -> None:
        """Request r to completion as the SUT decides: each time, the first step of DRIVE that
        the SUT accepts (the spec's guards no longer apply: the SUT's decision is what runs)."""
        for _ in range(3 * cfg.blocks + 6):
            done = next((i for a in DRIVE for i in per_request[r].get(a, ()) if follow_step(self, i)), None)
            if done is None or done.action == "finish":
                return

    def follow_step(self: Any, inst: Instance) -> bool:
        """One step on the SUT alone. A refusal is not a finding here (its rules already differ
        from the spec's); the divergence is."""
        try:
            self.sut.apply(inst.action, dict(inst.params))
        except ActionRejected:
            return False
        self.trail.append((inst.action, dict(inst.params)))
        tally.count(inst.action, None)
        seen = self.sut.observe()
        self.s = tuple(seen)
        self.judge(inst.label(), seen, None, None)
        self.oracle(inst.label(), inst.action, inst.params)
        self.after(self.s)
        return True

    def after(self: Any, s: tuple) -> None:
        self.enabled = enabled_by_action(s)
        self.pressure = max(self.pressure, sum(1 for i in occ_slots if s[i] == READY))
        self.transfers = max(self.transfers, s[inflight])
        self.at_boundary = max(self.at_boundary, sum(1 for i in rpos if s[i] in boundaries))

    def end(self: Any) -> None:
        """The end of an example: a divergence whose consequence never showed is the finding."""
        if self.failed:                   # a step failed: that is the example's finding
            return
        if self.diverged is not None:
            tally.found(self.diverged)
            self.failed = True
            raise self.diverged

    def teardown(self: Any) -> None:
        try:
            self.end()
        finally:
            self.close()
        if self.soft is not None:
            # Only a decision's reasons differed: not a failure of this example, so the campaign
            # keeps looking for what the difference breaks (reported at the end, the shortest
            # such example, if nothing else fails).
            f = stamp(self, self.soft)
            if tally.soft is None or len(f.trail) < len(tally.soft.trail):
                tally.soft = f
        target(float(self.pressure), label="memory pressure (ready objects)")
        target(float(self.transfers), label="transfers in flight")
        target(float(self.at_boundary), label="requests at window/compression boundaries")

    def close(self: Any) -> None:
        """Release the SUT's resources now (threads, files), not from the garbage collector."""
        fn = getattr(self.sut, "close", None)
        if fn is not None:
            fn()

    attrs: dict[str, Any] = {"__init__": __init__, "step": step, "teardown": teardown, "close": close}
    for fn in (judge, oracle, check, diverge, drive, follow_step, after, end, stamp):
        attrs[fn.__name__] = fn
    # Swarm testing, as the random walker does it: each example draws an action mix and
    # switches off each non-core action with probability 1/2 (a coin each; shrinks towards the
    # walker's mix with nothing off). Deep faults need long runs of the core actions that noise
    # (eviction, migration, corruption) breaks, some need an action that is rare in the
    # everyday mix (a weight update), and some need one bump without the others (a stale
    # indexer alone: a weight update would make the whole prefix stale and hide it).
    noise = sorted(n for n in by_action if n not in CORE)

    def swarm(self: Any, mix: int, off: list[bool]) -> None:
        self.weights = MIXES[mix][1]
        self.off = frozenset(n for n, o in zip(noise, off) if o)

    # One rule for every step: an enabled action (a point on the mix's cumulative weights, so
    # version bumps are rare in the walker's mix), then one of its enabled instances by an
    # integer modulo how many there are. Every step is a real step (no no-op draws) and costs
    # three byte draws: per-action rules with preconditions cost ~25 draws a step in rule
    # selection, and half their steps drew a disabled instance.
    def act(self: Any, a: int, b: int, i: int) -> None:
        lo = PROBE_BYTES if probes else 0
        if a < lo and self.diverged is None:
            probe(self, i)
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
        inst = insts[i % len(insts)]
        self.program.append(inst)
        self.step(inst)

    def probe(self: Any, i: int) -> None:
        """A negative probe: send the SUT an action the spec forbids here. Refusing it is
        right; doing it is a divergence (followed like any other)."""
        dis = [x for x in probes if not x.guard(self.s)]
        if dis:
            send_probe(self, dis[i % len(dis)])

    def send_probe(self: Any, inst: Instance) -> None:
        self.step(inst, probe_step)

    def probe_step(self: Any, inst: Instance) -> None:
        try:
            self.sut.apply(inst.action, dict(inst.params))
        except ActionRejected:
            return
        self.program.append(inst)
        self.trail.append((inst.action, dict(inst.params)))
        tally.count(inst.action, None)
        label, seen = inst.label(), self.sut.observe()
        self.judge(label, seen, None, None)
        self.oracle(label, inst.action, inst.params)
        self.diverge(Finding("conformance", ["sut_accepted_disabled_action"],
                             f"{label}: the spec forbids it here, the SUT did it"),
                     seen, inst.params.get("r"))

    # Probes only where they can tell something: the spec as SUT refuses every one of them.
    probes = [] if getattr(probe_sut, "name", None) == "spec" else \
        [x for x in all_insts if x.action in PROBE_ACTIONS]
    attrs["send_probe"] = send_probe
    attrs["probes"] = bool(probes)
    action_names = sorted(by_action)
    attrs["swarm"] = initialize(mix=st.integers(0, len(MIXES) - 1),
                                off=st.lists(st.booleans(), min_size=len(noise), max_size=len(noise)))(swarm)
    attrs["act"] = rule(a=BYTE, b=BYTE, i=BYTE)(act)
    return type("KVCacheMachine", (RuleBasedStateMachine,), attrs)


def run_program(machine: type[RuleBasedStateMachine], program: list[Instance],
                choices: list[list[Instance]] | None = None) -> Finding | None:
    """Run chosen steps on a fresh machine outside Hypothesis (a step not enabled where it
    falls is skipped, as the rule would not have drawn it). Returns the finding, if any.
    `choices` gets, per step, the other instances of its action that were enabled there."""
    m: Any = machine()
    try:
        for inst in program:
            if choices is not None:
                choices.append([x for x in m.enabled.get(inst.action, ()) if x is not inst])
            if inst.guard(m.s):
                m.program.append(inst)
                m.step(inst)
            elif m.probes and m.diverged is None and inst.action in PROBE_ACTIONS:
                m.send_probe(inst)
        m.end()
    except Finding as f:
        return f
    finally:
        m.close()
    if m.soft is not None:
        return m.stamp(m.soft)
    return None


# The order in which a finding's checks say most about it: an unsound hit (what a reuse read)
# first, then a lease broken under a bound request, a graph's pages moved, accounting, routing;
# conformance and differential checks (one per finding) after.
LEADS = ("hit_sound_", "toctou_bound_stable", "graph_topology", "refcount_equals_holders",
         "admission_cap", "five_state_routing")


def lead(checks: list[str]) -> str:
    """The check a shrunk finding must keep (the others may go with the steps that caused them)."""
    def at(c: str) -> tuple[int, str]:
        return next((n for n, p in enumerate(LEADS) if c.startswith(p)), len(LEADS)), c
    return min(checks, key=at)


def shrink_finding(machine: type[RuleBasedStateMachine], tally: Tally, f: Finding,
                   seconds: float) -> Finding:
    """Shrink what the failing example chose, which is what a trace reader sees (Hypothesis
    shrinks the choices, slowly for long stateful runs): delete chunks of steps (halves,
    quarters, ... single steps), then try each step with other parameters (another length,
    block, request) and keep a change when deleting again makes the program shorter. A
    candidate counts when the same kind of finding, with the same leading check, comes out."""
    if not f.program:
        return f
    want = lead(f.checks)
    deadline = time.perf_counter() + seconds
    saved = (tally.steps, Counter(tally.actions), Counter(tally.decisions), tally.best)
    tally.replaying = True

    def fails(prog: list[Instance]) -> Finding | None:
        g = run_program(machine, prog)
        ok = g is not None and (g.kind, g.soft) == (f.kind, f.soft) and want in g.checks
        return g if ok else None

    def delete(best: Finding) -> Finding:
        prog = list(best.program)
        chunk = max(1, len(prog) // 2)
        while chunk >= 1 and time.perf_counter() < deadline:
            i, changed = 0, False
            while i < len(prog) and time.perf_counter() < deadline:
                g = fails(prog[:i] + prog[i + chunk:])
                if g is not None:
                    prog, best, changed = list(g.program), g, True
                else:
                    i += chunk
            if not changed:
                chunk //= 2
        return best

    def substitute(best: Finding) -> Finding | None:
        """The first one-step change after which deleting gives a shorter program."""
        prog, choices = best.program, []
        run_program(machine, prog, choices)
        for i, alts in enumerate(choices):
            for x in alts:
                if time.perf_counter() >= deadline:
                    return None
                g = fails(prog[:i] + [x] + prog[i + 1:])
                if g is not None:
                    g = delete(g)
                    if len(g.program) < len(prog):
                        return g
        return None

    try:
        best: Finding | None = delete(f)
        while best is not None:
            f, best = best, substitute(best)
        return f
    finally:      # replays are not campaign steps
        tally.steps, tally.actions, tally.decisions, tally.best = saved
        tally.replaying = False
