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

A mixin of CacheManager.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcheck.spec.config import Config
from kvcheck.spec.objects import D_OFFLOADING, EVICTED, R_BOUND, R_DECIDED, R_RUNNING

from . import faults as EF
from .records import BlockEntry, CopyRec, ObjRec, Refused, Request

if TYPE_CHECKING:
    from .manager import CacheManager as _Base
else:
    _Base = object


class Evictable(Refused):
    """The allocation does not fail: a block can be evicted to make room (append_evict)."""


@dataclass
class Slots:
    """Position j's physical block: its objects, its copy, the hash the table maps to it and
    the token prefixes its content and that hash were computed from."""

    objs: list[dict[tuple[int, str], ObjRec]]
    copy: list[CopyRec]
    key: list[str | None]
    content: list[tuple[int, ...]]
    keyed_by: list[tuple[int, ...]]

    @classmethod
    def make(cls, cfg: Config, kinds: Any) -> "Slots":
        n = cfg.blocks
        return cls([{gk: ObjRec(gk[0], gk[1], j) for gk in kinds(j)} for j in range(n)],
                   [CopyRec() for _ in range(n)], [None] * n, [()] * n, [()] * n)


def content_key(salt: str, tokens: list[int]) -> tuple:
    """What a block's KV was computed for: the tenant (cache salt: an extra key of the chained
    hash, salted_prompts) and the whole token prefix to the block's end."""
    return (salt, *tokens)


class SlotsMixin(_Base):
    def set_base(self, prefix: list[int], hashes: list[str], salt: str = "") -> None:
        """The engine's prompt 0 (the shared system prompt): its hashes name each position's
        block for operations by position; before any write a block counts as holding it."""
        self.base_hashes = list(hashes)
        if self.slots is not None:
            for j in range(self.cfg.blocks):
                t = content_key(salt, prefix[:(j + 1) * self.B])
                self.slots.content[j] = self.slots.keyed_by[j] = t

    def slot_entry(self, j: int) -> BlockEntry:
        return self.entry(self.base_hashes[j], j)

    def slot_published(self, j: int) -> bool:
        if self.slots is None:
            e = self.entries.get(self.base_hashes[j])
            return e is not None and e.published
        k = self.slots.key[j]
        return k is not None and self.entries[k].published

    def unpublish(self, j: int) -> None:
        """The table forgets position j's hash (the block's memory is free or forgotten)."""
        if self.slots is None:
            self.slot_entry(j).published = False
        elif self.slots.key[j] is not None:
            self.entries[self.slots.key[j]].published = False

    def drop_hash(self, j: int) -> None:
        if self.cfg.eviction != "drop_hash":
            raise Refused("eviction keeps hashes (tombstone)")
        if not self.slot_published(j):
            raise Refused(f"block {j} is not published")
        self.unpublish(j)

    def other_content(self, prefix: tuple, j: int) -> bool:
        """Does position j's block hold another prefix than `prefix` (the tokens to block j's end)?"""
        return self.slots is not None and self.slots.content[j] != prefix

    def publish(self, j: int, e: BlockEntry, prefix: tuple, other: bool) -> None:
        """Block j now holds `prefix`'s KV: map its hash to it (the old hash first unmapped)."""
        self.clock += 1
        self.last_use[j] = self.clock
        s = self.slots
        if s is None:
            e.published = True
            return
        old = s.key[j]
        s.content[j] = prefix
        if (other and old is not None and self.entries[old].published
                and self.planted(EF.STALE_HASH_AFTER_REUSE)):
            return                  # the block already has a hash: the faulty table keeps it
        if old is not None and old != e.key:
            self.entries[old].published = False
        s.key[j], s.keyed_by[j] = e.key, prefix
        e.published = True

    # ---- allocation inside capacity (alloc = "evict") -------------------------------------
    def fits(self, fresh: dict[str, int], room: dict[str, int] | None = None) -> bool:
        room = room or {}
        return all(self.occupancy(k) + n - room.get(k, 0) <= self.cfg.cap(k) for k, n in fresh.items())

    def victim_room(self, v: int) -> dict[str, int] | None:
        """The pool slots evicting block v frees, or None when v cannot be evicted (nothing
        live, or a live object referenced, graph-captured or being offloaded)."""
        e = self.slot_entry(v)
        live = [o for o in e.objs.values() if o.live]
        if not live or e.copy.dst == D_OFFLOADING:
            return None
        if not self.planted(EF.ALLOC_EVICTS_REFERENCED):
            if any(o.ref > 0 or self.graph_pinned(o) for o in live):
                return None
        room = {o.kind: 0 for o in e.objs.values()}
        for o in live:
            room[o.kind] += 1
        return room

    def _alloc_plan(self, rid: int, j: int) -> tuple[Request, dict[str, int]]:
        req = self._req(rid, (R_RUNNING,))
        if req.pos != j or j >= req.n:
            raise Refused(f"request {rid} is at block {req.pos}, not {j}")
        e = self.entry(req.hashes[j], j)
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
        if self.cfg.alloc != "evict":
            raise Refused("allocation does not evict (alloc = refuse)")
        req, fresh = self._alloc_plan(rid, j)
        self.write_plan(req, j)                         # refuses (nothing changed) if j cannot be written
        order = sorted((v for v in range(self.cfg.blocks) if v != j), key=lambda v: (self.last_use[v], v))
        for v in order:
            room = self.victim_room(v)
            if room is not None and self.fits(fresh, room):
                self.evict_block(v)
                self.append(rid, j, data)
                return v
        raise Refused("no block can be evicted to make room")

    def append_fail(self, rid: int, j: int) -> int:
        """The allocation of block j fails (full, nothing evictable): the scheduler preempts the
        newest scheduled request (possibly rid itself). Returns it."""
        if self.cfg.alloc != "evict":
            raise Refused("allocation does not fail (alloc = refuse)")
        _, fresh = self._alloc_plan(rid, j)
        for v in range(self.cfg.blocks):
            room = self.victim_room(v) if v != j else None
            if room is not None and self.fits(fresh, room):
                raise Evictable(f"block {v} can be evicted to make room")
        x = max((q for q in self.requests.values() if q.st in (R_DECIDED, R_BOUND, R_RUNNING)),
                key=lambda q: q.serial).rid
        self.preempt(x)
        return x

    def evict_block(self, v: int) -> None:
        """Evict every live object of block v (inside an allocation)."""
        for o in self.slot_entry(v).objs.values():
            if o.live:
                if o.page is not None:
                    o.page.pool.free(o.page)
                o.page, o.staged, o.state = None, None, EVICTED
                self._count(f"{o.kind}:evict")
        if self.cfg.eviction == "drop_hash":
            self.unpublish(v)
