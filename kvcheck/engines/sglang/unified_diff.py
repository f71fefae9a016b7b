"""UnifiedRadixCache's Python and Rust tree cores driven in lockstep, as a differential.

Both cores get the same operations, each on its own allocator and shadow, so slot numbers may
differ; what must agree is everything SGLang lets a caller see: each operation's result (hit,
the full-KV hit, the SWA branching point, the inserted prefix, what an eviction freed), the
sizes per component, the allocators' free counts, the contents of the tree's values (mapped
through each side's shadow to the token prefixes they hold), and, along every key ever
inserted, the read-only full-KV match and the SWA tombstone ranges. Any difference is a
finding (`tree_core_differential`). The Python side runs every node-level check; the Rust
side runs those its production interface allows (sglang_unified_checks._rust_checks).

In a campaign (incremental checks, incremental.py) a core's answers along the keys and
its tree contents are asked again only when a step called that core's cache (or wrote the
shadow), and all of them every `full_scan_every` steps; shrinking and replay ask every step.
"""
from __future__ import annotations

from typing import Any

from .checks import Violation
from .layouts import ACTIONS, Layout, get_layout
from .unified import UnifiedAdapter


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
        self._memo: dict[str, tuple] = {}       # core -> (its cache calls so far, written, contents, answers)

    incremental_pays = True         # (the cores' answers along every key: asked again only when needed)

    @property
    def full_scan_every(self) -> int:
        return self.py.full_scan_every

    @full_scan_every.setter
    def full_scan_every(self, n: int) -> None:      # each core's own checks: incremental or exact
        self.py.full_scan_every = self.rs.full_scan_every = n

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
        with P.checking(), R.checking():            # (the comparison's own calls are no step's)
            for name in ("full_evictable_size", "full_protected_size", "total_size") + \
                    (("swa_evictable_size", "swa_protected_size") if P.swa else ()):
                self._diff(name, getattr(P.cache, name)(), getattr(R.cache, name)())
            fa, sa = (P._free_sets(), R._free_sets())
            self._diff("free slots (full, swa)", (len(fa[0]), len(fa[1])), (len(sa[0]), len(sa[1])))
            keys = sorted(P.keys | R.keys)
            cp, ap = self._asked("python", P, keys)
            cr, ar = self._asked("rust", R, keys)
        self._diff("tree contents (the prefixes its full values hold)", cp, cr)
        for key in keys:
            (mp, tp), (mr, tr) = ap[key], ar[key]
            self._diff(f"full-KV match along a {len(key)}-token key (length, pinned)", mp, mr)
            if P.swa:
                self._diff(f"SWA tombstones along a {len(key)}-token key", tp, tr)

    def _asked(self, core: str, ad: UnifiedAdapter, keys: list) -> tuple[list, dict]:
        """A core's tree contents and its answers along the keys: asked afresh, or (incremental
        mode) kept from the last step while no step called its cache and the shadow is as it was."""
        ep, every = ad.epoch(), ad.full_scan_every
        old = self._memo.get(core)
        keep = ep is not None and old is not None and old[0] == ep and self.compared % every != 0
        written = dict(ad.written) if ep is not None else None
        contents = old[2] if keep and old[1] == written else self._contents(ad)
        answers = {}
        for key in keys:
            a = old[3].get(key) if keep else None
            if a is None:
                mp = ad.cache.tree_core.match_full_device_prefix(ad._key(list(key)))
                a = answers[key] = ((mp[0], mp[2]), ad.cache.tree_core.swa_tombstone_ranges(
                    ad._key(list(key)), 0, len(key)) if ad.swa else None)
            answers[key] = a
        if ep is not None:
            self._memo[core] = (ep, written, contents, answers)
        return contents, answers

    @staticmethod
    def _contents(ad: UnifiedAdapter) -> list:
        vals = ad.cache.all_values_flatten().tolist()
        return sorted(ad.written.get(s, ()) for s in vals)


def lockstep_available(lay: Layout) -> str | None:
    from .unified import rust_core_gap
    return rust_core_gap()


__all__ = ["LockstepAdapter", "lockstep_available"]
