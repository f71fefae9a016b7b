"""The adapter protocol: a system under test is whatever can be driven by actions and observed
through an abstraction function; the lockstep core (kvcheck.fuzz.lockstep) runs every one.

Owns the contract between the spec and every engine implementation (the reference engine,
vLLM's cache manager, a user's own). It lives with the spec so that reference/ needs nothing
from fuzz/. `SpecSUT` is the spec itself behind the protocol: the oracle, and the negative
control every engine is compared with.

Optional hooks the core calls when an adapter has them (each returns None when all is well):
`differential_check(action, params) -> str` (reuse vs recompute: a message is a differential
finding), `isolation_check(r) -> str` (after a lookup: what another tenant would hit),
`extra_checks(action, params) -> (kind, check, message)` (the adapter's own checks, e.g.
vLLM's shadow-model safety and bookkeeping), `close()` (release threads and files now).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .config import Config
from .refusal import ActionRejected  # noqa: F401 (the SUT protocol's refusal)
from .system import Spec, spec_for


# Negative probes: actions a SUT must refuse where the spec's guard forbids them (evicting a
# pinned page, migrating a captured one, allocating past a cap, using a stale lease, ...).
# The lockstep core sends them where they are disabled (for `kvcheck diff` and the fuzz machine).
PROBE_ACTIONS = ("evict", "migrate", "append", "use", "bind", "verify_ok", "offload_start",
                 "prefetch_start", "use_stale", "compress")


@runtime_checkable
class SystemUnderTest(Protocol):
    """`name` for reports; `actions`: the actions it implements (None: all the spec's) —
    drivers only send those."""

    name: str
    actions: frozenset[str] | None

    def reset(self, cfg: Config) -> None:
        """Start from the spec's Init for this config (empty caches, idle requests)."""

    def apply(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        """Perform one action (a spec action, or one of the adapter's own vocabulary). Returns
        observations (for `lookup`: {"decision": {...}}). Raises ActionRejected when the
        action is not enabled in the SUT's current state."""

    def observe(self) -> tuple[int, ...] | dict[int, int] | None:
        """The abstraction function: the SUT's state mapped onto the spec's state — the whole
        tuple (Layout order), a partial {slot: value} map of the slots it can abstract, or
        None when it exposes no state (then only decisions are compared)."""


def observed_mismatch(seen: tuple[int, ...] | dict[int, int] | None,
                      spec_state: tuple[int, ...]) -> list[int]:
    """Slots where an observation disagrees with the spec's state."""
    if seen is None:
        return []
    if isinstance(seen, dict):
        return [i for i, v in seen.items() if spec_state[i] != v]
    return [i for i, (a, b) in enumerate(zip(seen, spec_state)) if a != b]


class SpecSUT:
    """The executable spec as a system under test."""

    name = "spec"
    actions = None

    def __init__(self, fault: str | None = None) -> None:
        self.fault = fault
        self.spec: Spec | None = None
        self.state: tuple[int, ...] = ()

    def reset(self, cfg: Config) -> None:
        if self.spec is None or self.spec.cfg != cfg:
            self.spec = spec_for(cfg, self.fault)
        self.state = self.spec.init()

    def apply(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        assert self.spec is not None, "reset() first"
        try:
            inst = self.spec.instance(action, params)
        except KeyError as e:
            raise ActionRejected(str(e.args[0])) from None
        if not inst.guard(self.state):
            raise ActionRejected(f"{inst.label()} is not enabled")
        obs: dict[str, Any] = {}
        if action == "lookup":
            obs["decision"] = self.spec.decide(self.state, params["r"])
        self.state = inst.effect(self.state)
        return obs

    def observe(self) -> tuple[int, ...]:
        return self.state
