"""The models a SUT is stepped against in lockstep (kvcheck.fuzz.lockstep): the spec itself,
or no model at all for an adapter with its own vocabulary.

`SpecModel` is the spec's guards, effects, decisions, invariants and the reading of an
engine's own events (spec/events.py); `FreeModel` allows every step and has no abstract state.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ..spec.events import Event, claim_fails, read_event
from ..spec.objects import R_IDLE
from ..spec.sut import PROBE_ACTIONS, observed_mismatch
from ..spec.system import Instance, Spec

# The order in which a diverged request is driven to completion (the first accepted one wins).
DRIVE = ("bind", "bind_stale", "use", "use_stale", "append", "finish", "lookup")


class Act(NamedTuple):
    """A step of an adapter's own vocabulary (FreeModel's step; SpecModel's is an Instance)."""

    action: str
    params: dict[str, Any]

    def label(self) -> str:
        return f"{self.action}(" + ", ".join(f"{k}={v}" for k, v in self.params.items()) + ")"


class SpecModel:
    """The spec as the model: guards, effects, decisions and invariants; the SUT's observation
    (when it is the whole state) stands in for the spec's state after a divergence."""

    exact = True          # the guards are the truth: a SUT refusing an enabled step diverges

    def __init__(self, spec: Spec, supported: frozenset[str] | None = None) -> None:
        self.spec, lay, cfg = spec, spec.lay, spec.cfg
        self.size, self.names = lay.size, lay.names
        self.instances = [i for i in spec.instances if supported is None or i.action in supported]
        self.probes = [x for x in self.instances if x.action in PROBE_ACTIONS]
        self.requests, self.blocks = cfg.requests, cfg.blocks
        self.rst = [lay.r(r, "rst") for r in range(cfg.requests)]
        per: list[dict[str, list[Instance]]] = [{} for _ in range(cfg.requests)]
        for i in self.instances:
            if "r" in i.params:
                per[i.params["r"]].setdefault(i.action, []).append(i)
        self.drive_steps = [[i for a in DRIVE for i in per[r].get(a, ())] for r in range(cfg.requests)]

    def init(self) -> tuple[int, ...]:
        return self.spec.init()

    def step(self, action: str, params: dict[str, Any]) -> Instance:
        return self.spec.instance(action, params)             # KeyError: not a spec step

    def allows(self, s: tuple, x: Instance) -> bool:
        return x.guard(s)

    def effect(self, s: tuple, x: Instance) -> tuple:
        return x.effect(s)

    def decide(self, s: tuple, x: Instance) -> dict[str, Any] | None:
        return self.spec.decide(s, x.params["r"]) if x.action == "lookup" else None

    def event(self, s: tuple, ev: Any) -> Event:
        """An engine-initiated event as the spec's steps (spec/events.py)."""
        return read_event(self.spec, s, ev)

    def claim(self, s: tuple, e: Event) -> str | None:
        return claim_fails(self.spec, s, e)

    def invariants(self, s: tuple, x: Instance | None = None) -> list[tuple[str, str]]:
        """Violations in s (after x, from a state where every invariant held: only the
        conjuncts x can change)."""
        return self.spec.check(s) if x is None else self.spec.check_after(x, s)

    def as_state(self, seen: Any) -> tuple | None:
        return tuple(seen) if isinstance(seen, tuple) and len(seen) == self.size else None

    def mismatch(self, seen: Any, s: tuple) -> list[str]:
        return [".".join(map(str, self.names[i])) for i in observed_mismatch(seen, s)]

    def drive_order(self, s: tuple, focus: int | None) -> list[int]:
        """The requests a follow-through drives: the diverging one, then every busy one."""
        rest = [r for r in range(self.requests) if r != focus and s[self.rst[r]] != R_IDLE]
        return ([focus] if focus is not None else []) + rest

    def fresh(self, s: tuple) -> list[Instance]:
        """Submits for the first idle request, longest first (a fresh request over the prefix)."""
        for r in range(self.requests):
            if s[self.rst[r]] == R_IDLE:
                p = {"p": 0} if self.spec.cfg.prompts > 1 else {}
                return [self.spec.instance("submit", {"r": r, "n": n, **p}) for n in range(self.blocks, 0, -1)]
        return []


class FreeModel:
    """No model: every step is allowed and there is no abstract state, so the adapter's own
    extra checks are the ground truth (a refused step is the adapter's own guard: skipped)."""

    exact = False
    probes: list[Act] = []

    def init(self) -> None:
        return None

    def step(self, action: str, params: dict[str, Any]) -> Act:
        return Act(action, params)

    def allows(self, s: None, x: Act) -> bool:
        return True

    def effect(self, s: None, x: Act) -> None:
        return None

    def decide(self, s: None, x: Act) -> None:
        return None

    def event(self, s: None, ev: Any) -> Event:
        return Event(str(ev))           # no model: the adapter's own checks judge its events

    def claim(self, s: None, e: Event) -> None:
        return None

    def invariants(self, s: None, x: Act | None = None) -> list[tuple[str, str]]:
        return []

    def as_state(self, seen: Any) -> None:
        return None

    def mismatch(self, seen: Any, s: None) -> list[str]:
        return []
