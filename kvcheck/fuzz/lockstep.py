"""The lockstep core: a system under test stepped together with a model of what it must do.

Every driver runs on it (the Hypothesis machine, `kvcheck diff`, `kvcheck replay`, the vLLM
campaign), so a check, its order and what a divergence means are written once. A step goes
to the model and to the SUT; then, in the leading order, the model's invariants on the SUT's
own state, the differential oracle, the adapter's extra checks, and conformance (the SUT's
decision and abstract state against the model's). A divergence is followed on the SUT alone
(the diverging request driven to completion, then a fresh request over the prefix) so that a
wrong decision is reported by the check it breaks. Negative probes send what the model forbids.

The model side is pluggable: `SpecModel` (the spec's guards, effects, decisions and
invariants) for SUTs that speak the spec's actions; `FreeModel` (every action allowed, no
abstract state) for an adapter with its own vocabulary whose ground truth is its own checks.
"""
from __future__ import annotations

from typing import Any, Callable

from ..spec.events import EventError
from ..spec.severity import LEADS, SEVERITY, lead, rank
from ..spec.sut import PROBE_ACTIONS, ActionRejected, SystemUnderTest
from .models import DRIVE, Act, FreeModel, SpecModel
from .suts import SutError

__all__ = ["Act", "DRIVE", "Finding", "FreeModel", "LEADS", "Lockstep", "SpecModel", "lead"]


class Finding(AssertionError):
    """A failure with the checks that found it. `kind`: invariant | differential | conformance,
    or an adapter's own kind (spec.verdict.FOR_FINDING gives each its exit code)."""

    KINDS = SEVERITY        # most serious first: the one order (spec/severity.py)

    def __init__(self, kind: str, checks: list[str], message: str, where: list[str] | None = None) -> None:
        super().__init__(f"[{kind}] {message}")
        self.kind, self.checks, self.message = kind, checks, message
        self.where = where or []                             # every violated conjunct, for reports
        self.trail: list[tuple[str, dict[str, Any]]] = []    # the steps the SUT took
        self.program: list[Any] = []                         # ... that the driver chose
        self.soft = False                                    # only a decision's reasons differ
        self.lockstep = 0                                    # steps of trail taken with the model

    def rank(self) -> tuple[int, int, int, int]:
        """Most serious first (spec/severity.py: an unsafe hit leads, then what a divergence
        breaks before the divergence, ...); among divergences, a wrong decision or state
        before a forbidden action merely accepted; then the shorter."""
        return (*rank(self.kind, self.checks), self.checks == ["sut_accepted_disabled_action"], len(self.trail))


def _noop(*_: Any) -> None:
    return None


class Lockstep:
    """One run: a model and a SUT from their initial states. `step` takes a step the driver
    chose (the model allows it), `probe` one the model forbids; a finding is raised from them.
    `follow`: after a divergence, drive the SUT's requests to completion (generation does;
    a replay takes the recorded steps instead). Hooks: `count(action, decision)` per step the
    SUT took, `after(state)` after each, `found(finding)` on a failure."""

    def __init__(self, model: Any, sut: SystemUnderTest, follow: bool = True, full_check: bool = False,
                 count: Callable[[str, Any], None] = _noop, after: Callable[[Any], None] = _noop,
                 found: Callable[[Finding], None] = _noop) -> None:
        self.model, self.sut, self.follow, self.full_check = model, sut, follow, full_check
        self.count, self.after, self.found = count, after, found
        self.s = model.init()
        self.trail: list[tuple[str, dict[str, Any]]] = []
        self.program: list[Any] = []
        self.lockstep = 0
        self.diverged: Finding | None = None   # set: the SUT left the model; it is followed alone
        self.soft: Finding | None = None       # a decision whose reasons alone differ
        self.failed = False
        # optional adapter hooks (kvcheck.spec.sut): the oracle, tenant isolation, own checks
        self._oracle = getattr(sut, "differential_check", None)
        self._isolation = getattr(sut, "isolation_check", None)
        self._extra = getattr(sut, "extra_checks", None)
        # probes only where they can tell something: the spec as SUT refuses every one of them
        self.probes = [] if getattr(sut, "name", None) == "spec" else getattr(model, "probes", [])

    # ---- what a driver calls ---------------------------------------------------------------
    def step(self, x: Any) -> None:
        """A chosen step: in lockstep, or on the SUT alone once it diverged."""
        self.program.append(x)
        try:
            if self.diverged is None:
                self.check(x)
            else:
                self.follow_step(x)
        except Finding as f:
            raise self.fail(f) from None

    def probe(self, x: Any) -> bool:
        """A negative probe: an action the model forbids here. Refusing it is right; doing it
        is a divergence (followed like any other). Returns whether the SUT took it."""
        try:
            obs = self.sut.apply(x.action, dict(x.params))
        except ActionRejected:
            return False
        self.program.append(x)
        mid = self.made_room(x, obs)
        took = isinstance(obs, dict) and obs.get("instead") is not None    # another step: judged as one
        if mid is not None or took:     # the engine's own events enabled it: a lockstep step
            try:
                self.check(x, obs, mid)
            except Finding as f:
                raise self.fail(f) from None
            return True
        f = Finding("conformance", ["sut_accepted_disabled_action"],
                    f"{x.label()}: the model forbids it here, the SUT did it")
        try:
            self.diverged = self.stamp(f)       # (what it breaks, if anything, comes first)
            self.diverge(f, self.took(x), x.params.get("r"))
        except Finding as f:
            raise self.fail(f) from None
        return True

    def run(self, program: list[Any], stop_at_divergence: bool = False,
            before: Callable[["Lockstep", Any], None] = _noop) -> Finding | None:
        """Run chosen steps (one the model does not allow where it falls is sent as a probe
        when it is a probe action, else skipped, as a driver would not have drawn it) and
        end the run. Returns the finding, if any; the SUT is closed."""
        m = self.model
        try:
            for x in program:
                before(self, x)
                if m.allows(self.s, x):
                    self.step(x)
                elif self.probes and self.diverged is None and x.action in PROBE_ACTIONS:
                    self.probe(x)
                if stop_at_divergence and self.diverged is not None:
                    break
            self.end()
        except Finding as f:
            return f
        finally:
            self.close()
        return self.stamp(self.soft) if self.soft is not None else None

    def end(self) -> None:
        """The end of a run: a divergence whose consequence never showed is the finding (its
        trace ends where it diverged)."""
        if not self.failed and self.diverged is not None:
            self.failed = True
            self.found(self.diverged)
            raise self.diverged

    def close(self) -> None:
        """Release the SUT's resources now (threads, files), not from the garbage collector."""
        fn = getattr(self.sut, "close", None)
        if fn is not None:
            fn()

    def stamp(self, f: Finding) -> Finding:
        """Attach the run's steps so far to a finding."""
        f.trail, f.lockstep, f.program = list(self.trail), self.lockstep, list(self.program)
        return f

    def fail(self, f: Finding) -> Finding:
        self.stamp(f)
        self.failed = True
        self.found(f)
        return f

    # ---- the checks ------------------------------------------------------------------------
    def check(self, x: Any, obs: dict | None = None, mid: tuple | None = None) -> None:
        """One step in lockstep, every check in the leading order. (`obs`, `mid`: a probe the
        SUT took, and the model state after the events it did first to make room.)"""
        m, pre, label = self.model, self.s if mid is None else mid, x.label()
        decision = m.decide(pre, x)
        self.s = m.effect(pre, x)
        self.trail.append((x.action, dict(x.params)))
        self.lockstep = len(self.trail)
        self.count(x.action, decision)
        try:
            if obs is None:
                obs = self.sut.apply(x.action, dict(x.params))
        except ActionRejected as e:
            self.trail.pop()                    # the SUT did not take this step
            self.lockstep -= 1
            if not m.exact:                     # no model to say it should have: skipped
                self.s = pre
                self.program.pop()
                return
            self.diverge(Finding("conformance", ["sut_rejected_enabled_action"],
                                 f"{label}: the model enables it, the SUT rejected it ({e})"),
                         self.sut.observe(), x.params.get("r"))
            return
        seen = self.sut.observe()
        before, after = (obs.get("events_before"), obs.get("events")) if isinstance(obs, dict) else (None, None)
        evented = False
        if isinstance(obs, dict) and obs.get("instead") is not None:
            # the step it took instead is judged after the room its own events made (an LRU
            # eviction, then a copy of a block the spec shared)
            at = pre
            if before and mid is None:
                at = mid = self.events(label, pre, before, seen, x)
                if mid is None:
                    return
                before, evented = None, True    # done: the events wrote other slots
            x = self.instead(label, at, x, obs["instead"])
            if x is None:
                self.diverge(Finding("conformance", ["sut_accepted_disabled_action"],
                                     f"{label}: the SUT took {obs['instead']!r:.60} instead, which the "
                                     "spec forbids here"), seen, self.trail[-1][1].get("r"))
                return
            label, decision, self.s = x.label(), m.decide(at, x), m.effect(at, x)
        checked = None if evented else x        # what judge frames its check on
        if (before and mid is None) or after:
            if before and mid is None:          # done first: re-run the step from there
                mid = self.events(label, pre, before, seen, x)
                if mid is None:
                    return
                if not m.allows(mid, x):
                    self.diverge(Finding("conformance", ["sut_accepted_disabled_action"],
                                         f"{label}: the SUT's own events before it disable it"),
                                 seen, x.params.get("r"))
                    return
                decision, self.s = m.decide(mid, x), m.effect(mid, x)
            if after:
                post = self.events(label, self.s, after, seen, x)
                if post is None:
                    return
                self.s = post
            checked = None                      # the events wrote other slots: check everything
        self.judge(label, seen, checked, True)
        self.oracle(label, x)
        got = obs.get("decision") if decision is not None else None
        if decision is not None and got != decision:
            f = Finding("conformance", ["decision_matches_spec"], f"{label}: spec decided {decision}, SUT {got}")
            if got and (got.get("kind"), got.get("k")) == (decision["kind"], decision["k"]):
                f.soft = True
                self.soft = self.soft or f     # only the reasons differ: still in lockstep
            else:
                self.diverge(f, seen, x.params["r"])
                return
        if decision is not None and self._isolation is not None:
            msg = self._isolation(x.params["r"])
            if msg:     # the SUT's state is the spec's, but another tenant would hit this prefix
                raise Finding("conformance", ["decision_matches_spec"], f"{label}: {msg}")
        diff = m.mismatch(seen, self.s)
        if diff:
            self.diverge(Finding("conformance", ["abstract_state_matches_spec"],
                                 f"after {label}: SUT state differs from the spec at {', '.join(diff[:6])}"),
                         seen, x.params.get("r"))
            return
        self.after(self.s)

    def instead(self, label: str, pre: Any, x: Any, params: Any) -> Any:
        """The step the SUT took in place of x: the same action with some parameters its own
        choice (`{"instead": {"v": 2}}`: its LRU's victim, the request its scheduler preempted),
        or another action on x's parameters, any it adds, less any it maps to None (`{"instead":
        {"action": "append_copy"}}`: it copied a block the spec shared; `{"action": "append",
        "v": None}`: its allocation fitted after all). None when the spec forbids that step in
        `pre`."""
        bad = f"--sut {getattr(self.sut, 'name', '?')}: {label}: 'instead' {params!r:.60}"
        name = x.action
        if isinstance(params, dict) and isinstance(params.get("action"), str):
            name, params = params["action"], {k: v for k, v in params.items() if k != "action"}
        elif not isinstance(params, dict) or not set(params) <= set(x.params):
            raise SutError(f"{bad} must map some of the step's parameters ({', '.join(x.params)}) "
                           "to values, or name another action")
        try:
            y = self.model.step(name, {k: v for k, v in {**x.params, **params}.items() if v is not None})
        except KeyError:
            raise SutError(f"{bad} names no step of the spec") from None
        if not self.model.allows(pre, y):
            return None
        self.trail[-1] = (y.action, dict(y.params))
        return y

    def events(self, label: str, s: Any, evs: Any, seen: Any, x: Any) -> Any:
        """The engine's own events applied to model state s as the spec's steps, each where
        its guard allows it. A forbidden one is forced, so that what it breaks is the finding
        (a referenced block evicted: `toctou_bound_stable`); a claim the spec contradicts (a
        block freed while held) is one. Returns the state, or None when the run diverged."""
        m = self.model
        if not isinstance(evs, (list, tuple)):
            raise SutError(f"--sut {getattr(self.sut, 'name', '?')}: {label}: events must be a list, "
                           f"got {type(evs).__name__}")
        for ev in evs:
            try:
                e = m.event(s, ev)
            except EventError as err:
                raise SutError(f"--sut {getattr(self.sut, 'name', '?')}: {label}: {err}") from None
            for inst in e.steps:
                if m.allows(s, inst):
                    s = m.effect(s, inst)
                    continue
                forced = m.effect(s, inst)
                what = f"{label}: the SUT's own {e.label} did {inst.label()}, which the spec forbids here"
                bad = m.invariants(forced)
                if bad:
                    raise Finding("invariant", sorted({i for i, _ in bad}),
                                  what + ": " + "; ".join(f"{i}: {w}" for i, w in bad[:6]),
                                  [f"{i}: {w}" for i, w in bad])
                self.diverge(Finding("conformance", ["sut_accepted_disabled_action"], what),
                             seen, x.params.get("r"))
                return None
            why = m.claim(s, e) if e.claim else None
            if why and e.claim == "held":
                raise Finding("invariant", ["toctou_bound_stable"], f"{label}: the SUT's own {e.label}: {why}")
            if why:
                self.diverge(Finding("conformance", ["sut_accepted_disabled_action"],
                                     f"{label}: the SUT's own {e.label}: {why}"), seen, x.params.get("r"))
                return None
        return s

    def made_room(self, x: Any, obs: Any) -> Any:
        """The model state after a probe's events_before, when they are all allowed and make
        the probed step allowed (an engine that evicted to make room); else None."""
        m, s = self.model, self.s
        evs = obs.get("events_before") if isinstance(obs, dict) else None
        if not evs or not m.exact or not isinstance(evs, (list, tuple)):
            return None
        for ev in evs:
            try:
                e = m.event(s, ev)
            except EventError:
                return None
            for inst in e.steps:
                if not m.allows(s, inst):
                    return None
                s = m.effect(s, inst)
            if e.claim and m.claim(s, e):
                return None
        return s if m.allows(s, x) else None

    def judge(self, label: str, seen: Any, x: Any, lockstep: bool) -> None:
        """The model's invariants on the SUT's own state (the spec's state when the SUT shows
        only part of its own): what a divergence *does*, so they run before conformance."""
        m = self.model
        if lockstep and seen == self.s and not self.full_check:
            bad = m.invariants(self.s, x)       # in lockstep: only conjuncts the step can change
        elif (st := m.as_state(seen)) is not None:
            bad = m.invariants(st)
        elif lockstep:
            bad = m.invariants(self.s, None if self.full_check else x)
        else:
            bad = []
        if bad:
            invs = sorted({i for i, _ in bad})
            raise Finding("invariant", invs, f"after {label}: " + "; ".join(f"{i}: {w}" for i, w in bad[:6]),
                          [f"{i}: {w}" for i, w in bad])

    def oracle(self, label: str, x: Any) -> None:
        """The differential oracle, then the adapter's own checks."""
        msg = self._oracle(x.action, dict(x.params)) if self._oracle is not None else None
        if msg:
            raise Finding("differential", ["reuse_equals_recompute"], f"after {label}: {msg}")
        bad = self._extra(x.action, x.params) if self._extra is not None else None
        if bad:
            kind, check, message = bad
            raise Finding(kind, [check], message)

    def took(self, x: Any) -> Any:
        """The SUT took x on its own (not in lockstep): record it and judge its state."""
        self.trail.append((x.action, dict(x.params)))
        self.count(x.action, None)
        seen = self.sut.observe()
        label = x.label()
        self.judge(label, seen, x, False)
        self.oracle(label, x)
        return seen

    # ---- a diverged SUT --------------------------------------------------------------------
    def diverge(self, f: Finding, seen: Any, focus: int | None) -> None:
        """The SUT left the model. When it exposes its whole state, follow it alone (its state
        read as a model state, judged by the invariants and the oracle): drive the diverging
        request to completion as the SUT decides, then serve a fresh request over the prefix,
        so that a wrong decision is reported by the check it breaks. Otherwise, or when nothing
        breaks, the finding is the divergence itself (raised at the end of the run)."""
        self.diverged = self.stamp(f)    # its trace ends here, unless a consequence shows
        st = self.model.as_state(seen)
        if st is None:
            raise f
        self.s = st
        if self.follow:
            for r in self.model.drive_order(st, focus):
                self.drive(r)
            for x in self.model.fresh(self.s):
                if self.follow_step(x):
                    self.drive(x.params["r"])
                    break
        self.after(self.s)

    def drive(self, r: int) -> None:
        """Request r to completion as the SUT decides: each time, the first step of DRIVE that
        the SUT accepts (the model's guards no longer apply: the SUT's decision is what runs)."""
        for _ in range(3 * self.model.blocks + 6):
            done = next((i for i in self.model.drive_steps[r] if self.follow_step(i)), None)
            if done is None or done.action == "finish":
                return

    def follow_step(self, x: Any) -> bool:
        """One step on the SUT alone. A refusal is not a finding here (its rules already differ
        from the model's); the divergence is."""
        try:
            self.sut.apply(x.action, dict(x.params))
        except ActionRejected:
            return False
        seen = self.took(x)
        self.s = self.model.as_state(seen)
        self.after(self.s)
        return True
