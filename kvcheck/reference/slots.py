"""The configurable semantics in the reference cache manager: one physical block per position
with the content it holds (prompts > 1), hashes dropped on eviction (eviction = "drop_hash"),
and capacity-limited allocation that evicts by LRU or fails and preempts (alloc = "evict").

Prompts: the prefix table maps chained hashes of real token content to entries; every entry
at position j shares position j's physical block (`Slots`), which records the tokens its KV
was computed from (`content`) and the one hash the table maps to it (`key`, with the tokens
that hash was computed from, `keyed_by`). Writing other content into a block unpublishes the
old hash first (the block is reused) and is refused while anyone references the block.

Allocation: when block j's new objects do not fit, `append_evict` picks the least recently
used block whose every live object is unreferenced (not pinned, not graph-captured, not being
offloaded) and whose eviction makes room, evicts it and writes j; with no such block
`append_fail` fails the allocation and preempts the newest scheduled request.

Two collaborators of CacheManager, over the manager's records (`ManagerState`): `SlotTable`
(which hash and content each position's block holds) and `Allocator` (room in the pools,
eviction, allocation that evicts or fails; it drives the manager's `RequestOps`).
The records themselves (`Slots`) are in records.py.
"""
from __future__ import annotations

from typing import Any

from kvcheck.spec.objects import D_OFFLOADING, EVICTED, R_BOUND, R_DECIDED, R_RUNNING

from . import faults as EF
from .manager_state import ManagerState, RequestOps
from .records import BlockEntry, ObjRec, Refused, Request, Slots
from .structure import Structure

__all__ = ["Allocator", "Evictable", "SlotTable", "Slots", "content_key"]


class Evictable(Refused):
    """The allocation does not fail: a block can be evicted to make room (append_evict)."""


def content_key(salt: str, tokens: list[int]) -> tuple:
    """What a block's KV was computed for: the tenant (cache salt: an extra key of the chained
    hash, salted_prompts) and the whole token prefix to the block's end."""
    return (salt, *tokens)


class SlotTable:
    """The hash each position's block is published under, and the content it holds."""

    def __init__(self, m: ManagerState, structure: Structure) -> None:
        self.m, self.s = m, structure

    def set_base(self, prefix: list[int], hashes: list[str], salt: str = "") -> None:
        """The engine's prompt 0 (the shared system prompt): its hashes name each position's
        block for operations by position; before any write a block counts as holding it."""
        m = self.m
        m.base_hashes = list(hashes)
        if m.slots is not None:
            for j in range(m.cfg.blocks):
                t = content_key(salt, prefix[:(j + 1) * m.B])
                m.slots.content[j] = m.slots.keyed_by[j] = t

    def slot_published(self, j: int) -> bool:
        m = self.m
        if m.slots is None:
            e = m.entries.get(m.base_hashes[j])
            return e is not None and e.published
        k = m.slots.key[j]
        return k is not None and m.entries[k].published

    def unpublish(self, j: int) -> None:
        """The table forgets position j's hash (the block's memory is free or forgotten)."""
        m = self.m
        if m.slots is None:
            self.s.slot_entry(j).published = False
        elif m.slots.key[j] is not None:
            m.entries[m.slots.key[j]].published = False

    def drop_hash(self, j: int) -> None:
        if self.m.cfg.eviction != "drop_hash":
            raise Refused("eviction keeps hashes (tombstone)")
        if not self.slot_published(j):
            raise Refused(f"block {j} is not published")
        self.unpublish(j)

    def other_content(self, prefix: tuple, j: int) -> bool:
        """Does position j's block hold another prefix than `prefix` (the tokens to block j's end)?"""
        return self.m.slots is not None and self.m.slots.content[j] != prefix

    def publish(self, j: int, e: BlockEntry, prefix: tuple, other: bool) -> None:
        """Block j now holds `prefix`'s KV: map its hash to it (the old hash first unmapped)."""
        m = self.m
        m.clock += 1
        m.last_use[j] = m.clock
        slots = m.slots
        if slots is None:
            e.published = True
            return
        old = slots.key[j]
        slots.content[j] = prefix
        if (other and old is not None and m.entries[old].published
                and m.planted(EF.STALE_HASH_AFTER_REUSE)):
            return                  # the block already has a hash: the faulty table keeps it
        if old is not None and old != e.key:
            m.entries[old].published = False
        slots.key[j], slots.keyed_by[j] = e.key, prefix
        e.published = True


class Allocator:
    """Room in the pools and eviction: of one object (the evict action) and inside capacity
    (alloc = "evict"), the victim an allocation evicts, or the request it preempts when
    nothing can be evicted."""

    def __init__(self, m: ManagerState, structure: Structure, table: SlotTable, ops: RequestOps) -> None:
        self.m, self.s, self.table, self.ops = m, structure, table, ops

    def fits(self, fresh: dict[str, int], room: dict[str, int] | None = None) -> bool:
        room = room or {}
        return all(self.s.occupancy(k) + n - room.get(k, 0) <= self.m.cfg.cap(k) for k, n in fresh.items())

    def victim_room(self, v: int) -> dict[str, int] | None:
        """The pool slots evicting block v frees, or None when v cannot be evicted (nothing
        live, or a live object referenced, graph-captured or being offloaded)."""
        e = self.s.slot_entry(v)
        live = [o for o in e.objs.values() if o.live]
        if not live or e.copy.dst == D_OFFLOADING:
            return None
        if not self.m.planted(EF.ALLOC_EVICTS_REFERENCED):
            if any(o.ref > 0 or self.s.graph_pinned(o) for o in live):
                return None
        room = {o.kind: 0 for o in e.objs.values()}
        for o in live:
            room[o.kind] += 1
        return room

    def _plan(self, rid: int, j: int) -> tuple[Request, dict[str, int]]:
        req = self.ops.request_in(rid, (R_RUNNING,))
        if req.pos != j or j >= req.n:
            raise Refused(f"request {rid} is at block {req.pos}, not {j}")
        e = self.s.entry(req.hashes[j], j)
        fresh: dict[str, int] = {}
        for o in e.objs.values():
            if not o.live:
                fresh[o.kind] = fresh.get(o.kind, 0) + 1
        if self.fits(fresh):
            raise Refused(f"block {j} fits: no allocation failure")
        return req, fresh

    def append_evict(self, rid: int, j: int, data: Any) -> int:
        """Allocate block j into full pools by evicting the least recently used evictable block
        that makes room, then write j. Returns the victim."""
        if self.m.cfg.alloc != "evict":
            raise Refused("allocation does not evict (alloc = refuse)")
        req, fresh = self._plan(rid, j)
        self.ops.write_plan(req, j)                     # refuses (nothing changed) if j cannot be written
        last_use = self.m.last_use
        order = sorted((v for v in range(self.m.cfg.blocks) if v != j), key=lambda v: (last_use[v], v))
        for v in order:
            room = self.victim_room(v)
            if room is not None and self.fits(fresh, room):
                self.evict_block(v)
                self.ops.append(rid, j, data)
                return v
        raise Refused("no block can be evicted to make room")

    def append_fail(self, rid: int, j: int) -> int:
        """The allocation of block j fails (full, nothing evictable): the scheduler preempts the
        newest scheduled request (possibly rid itself). Returns it."""
        if self.m.cfg.alloc != "evict":
            raise Refused("allocation does not fail (alloc = refuse)")
        _, fresh = self._plan(rid, j)
        for v in range(self.m.cfg.blocks):
            room = self.victim_room(v) if v != j else None
            if room is not None and self.fits(fresh, room):
                raise Evictable(f"block {v} can be evicted to make room")
        x = max((q for q in self.m.requests.values() if q.st in (R_DECIDED, R_BOUND, R_RUNNING)),
                key=lambda q: q.serial).rid
        self.ops.preempt(x)
        return x

    def evict(self, o: ObjRec) -> None:
        """The evict action: one unpinned resident object goes back to its pool."""
        e = self.s.entry_of(o)
        if not o.live:
            raise Refused("not resident")
        if not self.m.planted(EF.PINNED_OBJECT_EVICTED):
            if o.ref > 0 or self.s.graph_pinned(o):
                raise Refused("pinned")
        if e.copy.dst == D_OFFLOADING:
            raise Refused("being offloaded")
        if o.page is not None:
            o.page.pool.free(o.page)
        o.page, o.staged, o.state = None, None, EVICTED
        self.s.count(f"{o.kind}:evict")
        if self.m.cfg.eviction == "drop_hash" and not self.m.planted(EF.STALE_HASH_AFTER_EVICT):
            self.table.unpublish(o.j)      # the block goes back to the free list: its hash with it

    def evict_block(self, v: int) -> None:
        """Evict every live object of block v (inside an allocation)."""
        for o in self.s.slot_entry(v).objs.values():
            if o.live:
                if o.page is not None:
                    o.page.pool.free(o.page)
                o.page, o.staged, o.state = None, None, EVICTED
                self.s.count(f"{o.kind}:evict")
        if self.m.cfg.eviction == "drop_hash":
            self.table.unpublish(v)
