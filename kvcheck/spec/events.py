"""Engine-initiated events: what an engine did on its own during an action (evicted a block to
make room, freed one, dropped or published a hash, preempted a request).

Owns the event vocabulary of the adapter protocol. `apply` may return `{"events": [...]}`
(done after the action's own effect, e.g. a freed block evicted at finish) and
`{"events_before": [...]}` (done before it, e.g. an eviction inside allocation that made the
room). Each event is read as the spec's own step(s): the lockstep core applies them to the
spec's state when the spec's guard allows them, and otherwise judges the forced step (an engine
may evict only what the spec allows it to evict). Forms (j a block, r a request slot):

| event | spec step(s) | allowed when |
|---|---|---|
| `("evict", j)` | `evict(g, kind, j)` for each of block j's live objects | each evict's guard: unpinned, not graph-captured, not being offloaded |
| `("evict", {"g", "kind", "j"})` | that one `evict` | its guard |
| `("drop_hash", j)` | `drop_hash(j)` (a no-op if j is unpublished) | `eviction = "drop_hash"` in the config |
| `("preempt", r)` | `preempt(r)` | r decided, bound or running |
| `("free", j)` | none: a claim | no request holds an object of block j (else `toctou_bound_stable`) |
| `("publish", j)` | none: a claim | the spec has block j's hash published after the action |
| `("duplicate", j)` | none: a claim | `duplicates = "allow"` and the spec has a second copy of block j after the action (an engine that copied where the spec shared answers `{"instead": {"action": "append_copy"}}`) |
| `(action, {params})` | that spec action instance | its guard |
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .objects import READY, WRITING

EVENT_NAMES = ("evict", "free", "drop_hash", "publish", "preempt", "duplicate")


class EventError(ValueError):
    """An event the adapter reported that is not in the vocabulary (an adapter bug)."""


@dataclass(frozen=True)
class Event:
    """One event read against a state: the spec instances it stands for, in order, or a claim
    (`claim`: "held" | "published", on block `block`)."""

    label: str
    steps: tuple[Any, ...] = ()
    claim: str | None = None
    block: int | None = None


def _index(spec: Any, ev: Any, key: str, n: int) -> int:
    v = ev[1] if len(ev) > 1 else None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
        raise EventError(f"event {ev!r:.60}: {key} must be an integer in [0, {n})")
    return v


def read_event(spec: Any, s: tuple, ev: Any) -> Event:
    """Event `ev` (a tuple from the adapter) as the spec's steps in state s."""
    if not isinstance(ev, (tuple, list)) or not ev or not isinstance(ev[0], str):
        raise EventError(f"event {ev!r:.60}: expected (name, argument), e.g. ('evict', 1)")
    name, lay, cfg = ev[0], spec.lay, spec.cfg
    if len(ev) == 2 and isinstance(ev[1], dict):
        try:
            inst = spec.instance(name, dict(ev[1]))
        except KeyError as e:
            raise EventError(f"event {ev!r:.60}: {e.args[0]}") from None
        return Event(inst.label(), (inst,))
    if name not in EVENT_NAMES or len(ev) != 2:
        raise EventError(f"event {ev!r:.60}: unknown; expected one of {', '.join(EVENT_NAMES)} "
                         "with one argument, or (spec action, {parameters})")
    if name == "preempt":
        r = _index(spec, ev, "r", cfg.requests)
        return Event(f"preempt(r={r})", (spec.instance("preempt", {"r": r}),))
    j = _index(spec, ev, "j", cfg.blocks)
    label = f"{name}(j={j})"
    if name == "evict":
        live = [o for o in lay.objects if o.block == j
                and s[lay.o(o.group, o.kind, j, "st")] in (WRITING, READY)]
        return Event(label, tuple(spec.instance("evict", {"g": o.group, "kind": o.kind, "j": j})
                                  for o in live))
    if name == "drop_hash":
        if s[lay.b(j, "hashed")] == 0:
            return Event(label)
        try:
            return Event(label, (spec.instance("drop_hash", {"j": j}),))
        except KeyError:
            return Event(label, claim="drop_hash", block=j)
    if name == "duplicate":
        return Event(label, claim="duplicate", block=j)
    return Event(label, claim="held" if name == "free" else "published", block=j)


def claim_fails(spec: Any, s: tuple, e: Event) -> str | None:
    """What is wrong with a claim event in state s (None: the spec agrees)."""
    lay, j = spec.lay, e.block
    if e.claim == "held":
        held = [lay.label(o, block=False) for o in lay.objects
                if o.block == j and s[lay.o(o.group, o.kind, j, "ref")] > 0]
        return f"block {j} is still held ({', '.join(held)})" if held else None
    if e.claim == "published":
        return None if s[lay.b(j, "hashed")] == 1 else f"the spec has not published block {j}"
    if e.claim == "duplicate":
        if spec.cfg.duplicates != "allow":
            return (f"the engine keeps a second physical copy of block {j}; the spec keeps one copy "
                    "per block (duplicates = \"forbid\"); an engine that may keep both needs "
                    "duplicates = \"allow\" in the config")
        return None if all(s[lay.o(o.group, o.kind, j, "dup")] == 1 for o in lay.objects if o.block == j) \
            else f"the spec has no second copy of block {j} after this step"
    if e.claim == "drop_hash":
        return ("the spec keeps an evicted block's hash (eviction = tombstone); an engine that "
                "drops hashes needs eviction = \"drop_hash\" in the config")
    return None
