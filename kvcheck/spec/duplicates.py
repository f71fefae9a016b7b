"""Duplicate physical copies of one logical block (config `duplicates = "allow"`).

Two requests that recompute the same prefix at once (both allocated block j before either
published it: vLLM schedules both in one step) end up with two physical copies of one logical
block, and an engine may keep both cached. With `duplicates = "forbid"` (the default) the spec
keeps one copy per block (an append of a cached block shares it) and an engine that reports
`("duplicate", j)` is a finding (events.py). With "allow", each object carries `dup` (a second
copy is cached, at most one) and `ref` counts the holders of both copies together: copies are
interchangeable (same content, same versions), so the spec does not track which request holds
which; a copy is unreferenced when there are fewer holders than copies (ref < 2).

Owns, registered into the action table (actions.py imports this module last):
- `append_copy(r, j)`: request r writes block j although it is cached: it computes its own
  copy (pins move on as with `append`; the pool must have room for the second copy).
- `evict_copy(g, kind, j)`: the second copy of an object, unreferenced, goes back to the pool.
- `append_evict_copy(r, j, v)` (with `alloc = "evict"` too): block j does not fit, and the
  allocation evicts the unreferenced second copy of block v to make room — with full
  attention, where a request holds its whole prefix, the one victim an allocation can have.
`evict` and `append_evict` free both copies; a rewrite (another prompt's content, a stale
version) frees the old content's copies (context.py). `copies_cached` (invariants.py): a
second copy exists only of a ready object.
"""
from __future__ import annotations

from typing import Any

from . import content
from . import faults as F
from .action_registry import action
from .context import Ctx, fits, spare, write_block
from .objects import D_OFFLOADING, R_RUNNING, READY


def _on(cfg: Any) -> bool:
    return cfg.duplicates == "allow"


def _rj(lay: Any) -> list[dict[str, int]]:
    cfg = lay.cfg
    return [{"r": r, "j": j} for r in range(cfg.requests) for j in range(cfg.blocks)] if _on(cfg) else []


@action(_rj)
def append_copy(c: Ctx, r: int, j: int) -> Any:
    """Write block j as request r's own second copy although it is cached (duplicates =
    allow: allocated before the other copy was published); its pins move on as with append."""
    L, v, q = c.L, c.v, c.v.req(r)
    objs = c.block_objects(j)
    cached = [L.And(c.ob(o).st == READY, c.current(o), c.ob(o).dup == 0) for o in objs]
    if c.cfg.prompts > 1:
        cached.append(v.disk(j).bcid == content.chain_of(L, c.cfg, q.rp, j))
    kinds: dict[str, int] = {}
    for o in objs:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    room = [] if c.planted(F.COPY_IGNORES_CAPACITY) else [
        c.occupancy(k) + n <= c.cfg.cap(k) for k, n in kinds.items()]
    guard = write_block(c, r, j)
    for o in objs:
        c.set_obj(o, "dup", 1)
    return L.And(q.rst == R_RUNNING, q.rpos == j, j < q.rlen, *cached, *room, *guard)


@action(lambda lay: ({"g": o.group, "kind": o.kind, "j": o.block} for o in lay.objects) if _on(lay.cfg) else ())
def evict_copy(c: Ctx, g: int, kind: str, j: int) -> Any:
    """The unreferenced second copy of an object goes back to its pool (duplicates = allow)."""
    L = c.L
    o = next(x for x in c.block_objects(j) if (x.group, x.kind) == (g, kind))
    ob = c.ob(o)
    c.set_obj(o, "dup", 0)
    return L.And(ob.dup == 1, ob.ref < 2, L.Not(c.gpin(o)), c.v.disk(j).dst != D_OFFLOADING)


def _rjv(lay: Any) -> list[dict[str, int]]:
    cfg = lay.cfg
    if not _on(cfg) or cfg.alloc != "evict":
        return []
    return [{"r": r, "j": j, "v": v} for r in range(cfg.requests) for j in range(cfg.blocks)
            for v in range(cfg.blocks) if v != j]


@action(_rjv)
def append_evict_copy(c: Ctx, r: int, j: int, v: int) -> Any:
    """Append block j into a full pool (alloc = evict, duplicates = allow): the allocation
    evicts the unreferenced second copy of block v and writes block j in the room it made."""
    L, q = c.L, c.v.req(r)
    ok, room = spare(c, v)
    for o in c.block_objects(v):
        c.set_obj(o, "dup", 0)
    return L.And(q.rst == R_RUNNING, q.rpos == j, j < q.rlen, L.Not(L.And(*fits(c, j))), ok,
                 *write_block(c, r, j, room=room))
