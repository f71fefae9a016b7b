"""The cache manager's structure: which objects a block carries, the prefix table's entries,
the recovery / holding sets per prefix (pure functions of the config, memoised), the pools'
occupancy, what a captured graph pins and the stamps a write carries.

A collaborator of CacheManager (split from manager.py to keep each module readable): it reads
the manager's records through `ManagerState` and keeps the memo tables itself.
"""
from __future__ import annotations

from typing import Iterable

from kvcheck.spec.config import Group
from kvcheck.spec.objects import block_objects

from .kinds import manager_for
from .manager_state import ManagerState
from .pools import encode_shift
from .records import BlockEntry, ObjRec, Request


class Structure:
    """Lookups and derived sets over one manager's records (no state of its own but caches)."""

    def __init__(self, m: ManagerState) -> None:
        self.m = m
        self.groups = m.cfg.groups
        self._rs_cache: dict[tuple[int, int], list[tuple[str, int]]] = {}
        self._need_cache: dict[str, list[ObjRec]] = {}
        self._hold_cache: dict[tuple[str, tuple[int, ...]], frozenset[ObjRec]] = {}

    def block_kinds(self, j: int) -> list[tuple[int, str]]:
        """(group, kind) of the objects block j carries (its slots)."""
        return block_objects(self.m.cfg, j)

    def entry(self, key: str, j: int) -> BlockEntry:
        """The prefix table's entry for a chained hash (created unpublished on first ask). With
        prompts > 1 every entry at position j shares that position's physical block (slots.py)."""
        m = self.m
        e = m.entries.get(key)
        if e is None:
            if m.slots is not None:
                e = BlockEntry(key, j, m.slots.objs[j], copy=m.slots.copy[j])
            else:
                e = BlockEntry(key, j, {gk: ObjRec(gk[0], gk[1], j) for gk in self.block_kinds(j)})
            m.entries[key] = e
        return e

    def obj(self, req: Request, g: int, kind: str, j: int) -> ObjRec | None:
        if j >= len(req.hashes):
            return None
        return self.entry(req.hashes[j], j).objs.get((g, kind))

    def slot_entry(self, j: int) -> BlockEntry:
        """The entry naming position j's block for operations by position (prompt 0's hash)."""
        return self.entry(self.m.base_hashes[j], j)

    def entry_of(self, o: ObjRec) -> BlockEntry:
        if self.m.slots is not None:
            return self.slot_entry(o.j)
        for e in self.m.entries.values():
            if e.objs.get((o.g, o.kind)) is o:
                return e
        raise KeyError(o)

    def physical(self) -> Iterable[dict[tuple[int, str], ObjRec]]:
        """Each physical block's objects once (with prompts > 1 entries share their position's)."""
        if self.m.slots is not None:
            return self.m.slots.objs
        return (e.objs for e in self.m.entries.values())

    def occupancy(self, kind: str) -> int:
        """Live objects of one kind (the admission cap's measure)."""
        return sum(o.live for objs in self.physical() for o in objs.values() if o.kind == kind)

    def graph_pinned(self, o: ObjRec) -> bool:
        g = self.m.graph
        if g is None:
            return False
        return manager_for(o.kind).holds(o.j, g["win"][o.g], g["pos"], self.groups[o.g].window is not None)

    def window_lo(self, window: int | None, k: int) -> int:
        if window is None:
            return 0
        B = self.m.B
        return max(0, k * B - window + 1) // B

    def window_starts(self, k: int) -> tuple[int, ...]:
        """Per group, the first block of its window a request resumed at k keeps pinned (each
        group its own window; 0 for full attention)."""
        return tuple(self.window_lo(g.window, k) for g in self.groups)

    def recovery_set(self, g: Group, k: int) -> list[tuple[str, int]]:
        """(kind, block) of every object group g reads to resume at k (memoised: a pure
        function of the config)."""
        key = (g.index, k)
        got = self._rs_cache.get(key)
        if got is None:
            got = self._rs_cache[key] = self._recovery_set(g, k)
        return got

    def _recovery_set(self, g: Group, k: int) -> list[tuple[str, int]]:
        return [(kind, j) for kind in g.objects
                for j in manager_for(kind).recovery(self.m.cfg, g, k, self.window_lo)]

    def needed(self, req: Request, k: int) -> list[ObjRec]:
        """The ObjRecs of the recovery set at k. Entries, once created, keep their records for
        good, so the list is cached per prefix (keyed by the chained hash of block k-1)."""
        if k == 0 or k > len(req.hashes):
            return self._needed(req, k)
        key = req.hashes[k - 1]                 # a chained hash names the whole prefix
        got = self._need_cache.get(key)
        if got is None:
            if len(self._need_cache) > 4096:
                self._need_cache.clear()
            got = self._need_cache[key] = self._needed(req, k)
        return got

    def _needed(self, req: Request, k: int) -> list[ObjRec]:
        out = []
        hashes, entries = req.hashes, self.m.entries
        for g in self.groups:
            gi = g.index
            for kind, j in self.recovery_set(g, k):
                if j >= len(hashes):
                    continue
                e = entries.get(hashes[j]) or self.entry(hashes[j], j)
                o = e.objs.get((gi, kind))
                if o is not None:
                    out.append(o)
        return out

    def holding(self, req: Request, win: tuple[int, ...], pos: int) -> frozenset[ObjRec]:
        """The objects a holder resumed at `pos` whose groups keep SWA pins from `win` (per
        group, `window_starts`) keeps pinned (cached per prefix, like `needed`)."""
        if pos == 0 or pos > len(req.hashes):
            return frozenset(self._holding(req, win, pos))
        key = (req.hashes[pos - 1], win)
        got = self._hold_cache.get(key)
        if got is None:
            if len(self._hold_cache) > 4096:
                self._hold_cache.clear()
            got = self._hold_cache[key] = frozenset(self._holding(req, win, pos))
        return got

    def _holding(self, req: Request, win: tuple[int, ...], pos: int) -> set[ObjRec]:
        out: set[ObjRec] = set()
        for j in range(min(pos, len(req.hashes))):
            for (g, kind), o in self.entry(req.hashes[j], j).objs.items():
                if manager_for(kind).holds(j, win[g], pos, self.groups[g].window is not None):
                    out.add(o)
        return out

    def version_of(self, kind: str) -> int:
        return self.m.cur[manager_for(kind).stamp]

    def shift(self, kind: str, abi: int | None = None, cmp: int | None = None, ix: int | None = None) -> int:
        cur = self.m.cur
        return encode_shift(kind, cur["abi"] if abi is None else abi,
                            cur["cmp"] if cmp is None else cmp, cur["ix"] if ix is None else ix)

    def count(self, key: str) -> None:
        """One more `key` transition in the stats."""
        t = self.m.stats["transitions"]
        t[key] = t.get(key, 0) + 1
