"""The cache manager's structure: which objects a block carries, the prefix table's entries,
and the recovery / holding sets per prefix (pure functions of the config, memoised).

A mixin of CacheManager (split from manager.py to keep each module readable).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvcheck.spec.config import Group
from kvcheck.spec.objects import block_objects

from .kinds import manager_for
from .pools import encode_shift
from .records import BlockEntry, ObjRec, Request

if TYPE_CHECKING:
    from .manager import CacheManager as _Base
else:
    _Base = object


class StructureMixin(_Base):
    def block_kinds(self, j: int) -> list[tuple[int, str]]:
        """(group, kind) of the objects block j carries (its slots)."""
        return block_objects(self.cfg, j)

    def entry(self, key: str, j: int) -> BlockEntry:
        """The prefix table's entry for a chained hash (created unpublished on first ask). With
        prompts > 1 every entry at position j shares that position's physical block (slots.py)."""
        e = self.entries.get(key)
        if e is None:
            if self.slots is not None:
                e = BlockEntry(key, j, self.slots.objs[j], copy=self.slots.copy[j])
            else:
                e = BlockEntry(key, j, {gk: ObjRec(gk[0], gk[1], j) for gk in self.block_kinds(j)})
            self.entries[key] = e
        return e

    def obj(self, req: Request, g: int, kind: str, j: int) -> ObjRec | None:
        if j >= len(req.hashes):
            return None
        return self.entry(req.hashes[j], j).objs.get((g, kind))

    def window_lo(self, window: int | None, k: int) -> int:
        if window is None:
            return 0
        return max(0, k * self.B - window + 1) // self.B

    def window_starts(self, k: int) -> tuple[int, ...]:
        """Per group, the first block of its window a request resumed at k keeps pinned (each
        group its own window; 0 for full attention)."""
        return tuple(self.window_lo(g.window, k) for g in self._groups)

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
                for j in manager_for(kind).recovery(self.cfg, g, k, self.window_lo)]

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
        hashes, entries = req.hashes, self.entries
        for g in self._groups:
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
                if manager_for(kind).holds(j, win[g], pos, self._groups[g].window is not None):
                    out.add(o)
        return out

    def version_of(self, kind: str) -> int:
        return self.cur[manager_for(kind).stamp]

    def shift(self, kind: str, abi: int | None = None, cmp: int | None = None, ix: int | None = None) -> int:
        return encode_shift(kind, self.cur["abi"] if abi is None else abi,
                            self.cur["cmp"] if cmp is None else cmp, self.cur["ix"] if ix is None else ix)

    def _count(self, key: str) -> None:
        t = self.stats["transitions"]
        t[key] = t.get(key, 0) + 1
