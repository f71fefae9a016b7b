"""UnifiedRadixCache's Python and Rust tree cores driven in lockstep, as a differential.

Both cores get the same operations, each on its own allocator and shadow, so slot numbers may
differ; what must agree is everything SGLang lets a caller see: each operation's result (hit,
the full-KV hit, the SWA branching point, the inserted prefix, what an eviction freed), the
sizes per component, the allocators' free counts, the contents of the tree's values (mapped
through each side's shadow to the token prefixes they hold), and, along every key ever
inserted, the read-only full-KV match and the SWA tombstone ranges. Any difference is a
finding (`tree_core_differential`). The Python side runs every node-level check; the Rust
side runs those its production interface allows (sglang_unified_checks._rust_checks).
"""
from __future__ import annotations

from typing import Any

from .sglang_checks import Violation
from .sglang_layouts import ACTIONS, Layout, get_layout
from .sglang_unified import UnifiedAdapter


BOTH = ("drop_insert", "insert_shifted_values", "match_overreach", "evict_no_free")


class LockstepAdapter:
    """Two UnifiedAdapters (python = primary, rust = twin) behind one adapter protocol. A planted
    fault goes to both cores where it is a wrapper of the cache's calls (so the cores still agree
    and the fault's own check catches it), to the Python core alone where it edits tree nodes
    (lock_ref_leak, evict_locked), and `core_drops_insert` to the Rust core alone."""

    name = "sglang"
    actions = frozenset(ACTIONS)
    side: type = UnifiedAdapter          # the adapter each core runs under (FULL+MAMBA: its subclass)

    def __init__(self, layout: str | Layout, fault: str | None = None, capacity: int | None = None) -> None:
        self.lay = get_layout(layout)
        twin_fault = fault if fault in BOTH + ("core_drops_insert",) else None
        self.py = self.side(self.lay, None if fault == "core_drops_insert" else fault, capacity, core="python")
        self.rs = self.side(self.lay, twin_fault, capacity, core="rust")
        self.fault, self.capacity = fault, self.py.capacity
        self.broken: Violation | None = None
        self.compared = 0

    # the generator and the drivers read the primary's state
    reqs = property(lambda self: self.py.reqs)
    next_id = property(lambda self: self.py.next_id)
    hits = property(lambda self: self.py.hits)

    @property
    def coverage(self) -> Any:
        c = self.py.coverage.copy()
        c["state:lockstep_compared"] = self.compared
        return c

    def reset(self, cfg: Any = None) -> None:
        self.py.reset(cfg)
        self.rs.reset(cfg)

    def observe(self) -> None:
        return None

    def enabled(self) -> dict[str, list[str]]:
        return self.py.enabled()

    def apply(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        a = self.py.apply(action, dict(params))
        b = self.rs.apply(action, dict(params))
        for side, ad in (("python", self.py), ("rust", self.rs)):
            v, ad.broken = ad.broken, None
            if v is not None and self.broken is None:
                self.broken = Violation(v.kind, v.check, f"[{side} core] {v.message}")
        if self.broken is None:
            try:
                self._compare(action, a, b)
            except Violation as v:
                self.broken = v
        self.compared += 1
        return a

    def extra_checks(self, action: str, params: dict[str, Any]) -> tuple[str, str, str] | None:
        v, self.broken = self.broken, None
        return None if v is None else (v.kind, v.check, v.message)

    # ---- the differential ------------------------------------------------------------------
    def _diff(self, what: str, a: Any, b: Any) -> None:
        if a != b:
            raise Violation("bookkeeping", "tree_core_differential",
                            f"{what}: python core {a!r:.120}, rust core {b!r:.120}")

    def _compare(self, action: str, a: dict, b: dict) -> None:
        self._diff(f"{action} result", a, b)
        self._diff("request states", {r: q.state for r, q in self.py.reqs.items()},
                   {r: q.state for r, q in self.rs.reqs.items()})
        P, R = self.py, self.rs
        for name in ("full_evictable_size", "full_protected_size", "total_size") + \
                (("swa_evictable_size", "swa_protected_size") if P.swa else ()):
            self._diff(name, getattr(P.cache, name)(), getattr(R.cache, name)())
        fa, sa = (P._free_sets(), R._free_sets())
        self._diff("free slots (full, swa)", (len(fa[0]), len(fa[1])), (len(sa[0]), len(sa[1])))
        self._diff("tree contents (the prefixes its full values hold)", self._contents(P), self._contents(R))
        for key in sorted(P.keys | R.keys):
            k = P._key(list(key))
            mp, mr = P.cache.tree_core.match_full_device_prefix(k), R.cache.tree_core.match_full_device_prefix(k)
            self._diff(f"full-KV match along a {len(key)}-token key (length, pinned)", (mp[0], mp[2]), (mr[0], mr[2]))
            if P.swa:
                self._diff(f"SWA tombstones along a {len(key)}-token key",
                           P.cache.tree_core.swa_tombstone_ranges(k, 0, len(key)),
                           R.cache.tree_core.swa_tombstone_ranges(P._key(list(key)), 0, len(key)))

    @staticmethod
    def _contents(ad: UnifiedAdapter) -> list:
        vals = [int(v) for v in ad.cache.all_values_flatten().tolist()]
        return sorted(ad.written.get(s, ()) for s in vals)


def lockstep_available(lay: Layout) -> str | None:
    from .sglang_unified import rust_core_gap
    return rust_core_gap()


__all__ = ["LockstepAdapter", "lockstep_available"]
