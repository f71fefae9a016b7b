"""Physical capacity with eviction inside allocation (config `alloc = "evict"`): what a paged
block manager does when its free list is empty and a running request needs a block.

Owns `append_evict(r, j, v)` and `append_fail(r, j, x)`, registered into the action table
(actions.py imports this module last). With `alloc = "refuse"` (the default) an append into a
full pool is simply not enabled: something else must evict first. With `alloc = "evict"`:
- `append_evict(r, j, v)`: block j does not fit, so the allocation itself evicts block v — an
  unreferenced cached block (every live object of v unpinned, not in a graph, not being
  offloaded; under `eviction = "drop_hash"` its hash is unpublished) — and writes block j in
  the room it made (the engine's LRU choice is one of the v the spec allows).
- `append_fail(r, j, x)`: block j does not fit and no single block can be evicted to make room:
  the allocation fails and the scheduler preempts request x to free its blocks (vLLM preempts
  the newest running request, possibly r itself); r retries its append later.
"""
from __future__ import annotations

from typing import Any

from . import faults as F
from .action_registry import action
from .context import Ctx, fits, publish_released, spare, write_block
from .objects import D_OFFLOADING, EVICTED, R_BOUND, R_DECIDED, R_PREEMPTED, R_RUNNING, live


def spare_room_with(c: Ctx, j: int, v: int) -> list[Any]:
    ok, room = spare(c, v)
    return [ok, *fits(c, j, room)]


def _params(lay: Any, last: str, n: int) -> list[dict[str, int]]:
    cfg = lay.cfg
    if cfg.alloc != "evict":
        return []
    return [{"r": r, "j": j, last: x} for r in range(cfg.requests) for j in range(cfg.blocks)
            for x in range(n) if last != "v" or x != j]


def _victim(c: Ctx, v: int) -> tuple[Any, dict[str, Any]]:
    """(can block v be evicted to make room — it has a live object and every live one is
    unreferenced, ungraphed, not being offloaded; the slots per kind that frees)."""
    L, objs = c.L, c.block_objects(v)
    alive = {id(o): L.let(live(c.ob(o).st, L)) for o in objs}
    free = [L.And(c.ob(o).ref == 0, L.Not(c.gpin(o)))
            for o in objs if not c.planted(F.ALLOC_EVICTS_REFERENCED)]
    ok = L.And(L.Or(*alive.values()), c.v.disk(v).dst != D_OFFLOADING,
               *[L.Implies(alive[id(o)], f) for o, f in zip(objs, free)])
    room: dict[str, list[Any]] = {}
    for o in objs:
        room.setdefault(o.kind, []).append(alive[id(o)])
    out = {k: L.Count(m) for k, m in room.items()}
    if c.cfg.duplicates == "allow":     # its second copies go too
        for o in objs:
            out[o.kind] = out[o.kind] + c.ob(o).dup
    return ok, out


def _appending(c: Ctx, r: int, j: int) -> Any:
    q = c.v.req(r)
    return c.L.And(q.rst == R_RUNNING, q.rpos == j, j < q.rlen)


@action(lambda lay: _params(lay, "v", lay.cfg.blocks))
def append_evict(c: Ctx, r: int, j: int, v: int) -> Any:
    """Append block j into a full pool (`alloc = "evict"`): the allocation evicts block v, an
    unreferenced cached block, and writes block j in the room it made."""
    L = c.L
    ok, room = _victim(c, v)
    for o in c.block_objects(v):
        st = c.ob(o).st
        c.set_obj(o, "st", L.If(live(st, L), EVICTED, st))
        if c.cfg.duplicates == "allow":
            c.set_obj(o, "dup", 0)
    if c.cfg.eviction == "drop_hash":
        c.set(("b", v, "hashed"), 0)
    return L.And(_appending(c, r, j), L.Not(L.And(*fits(c, j))), ok, *write_block(c, r, j, room=room))


@action(lambda lay: _params(lay, "x", lay.cfg.requests))
def append_fail(c: Ctx, r: int, j: int, x: int) -> Any:
    """Append block j into a full pool with nothing evictable (`alloc = "evict"`): the
    allocation fails and request x is preempted to free its blocks (r retries later)."""
    L, qx = c.L, c.v.req(x)
    c.set(("r", x, "rst"), R_PREEMPTED)
    c.release(x)
    publish_released(c, x)
    no_room = [L.Not(L.And(*_room_with(c, j, v))) for v in range(c.cfg.blocks) if v != j]
    if c.cfg.duplicates == "allow":     # nor a second copy (duplicates.py)
        no_room += [L.Not(L.And(*spare_room_with(c, j, v))) for v in range(c.cfg.blocks) if v != j]
    return L.And(_appending(c, r, j), L.Not(L.And(*fits(c, j))), *no_room,
                 L.In(qx.rst, (R_DECIDED, R_BOUND, R_RUNNING)))


def _room_with(c: Ctx, j: int, v: int) -> list[Any]:
    ok, room = _victim(c, v)
    return [ok, *fits(c, j, room)]
