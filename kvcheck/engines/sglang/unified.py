"""SGLang's UnifiedRadixCache (tree components FULL or FULL+SWA) as a system under test.

One radix tree carries every component; a node's SWA value may be None (a tombstone) while its
full KV stays. Two generations are driven: 0.5.11-0.5.12 (the tree lives in the cache and
hands out node objects) and the TreeCore releases (0.5.23: the cache hands out NodeIds and the
tree is a pluggable core, Python or Rust, chosen by `tree_core_backend` /
SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND). Slot ownership as in SWARadixCache: `insert` with
`prev_prefix_len` = the hit frees the duplicate slots itself, the caller frees only what lies
past the key. Locks return a receipt (`IncLockRefResult`) that `dec_lock_ref` replays.
The checks live in unified_checks.py; the Python/Rust lockstep in unified_diff.py.
"""
from __future__ import annotations

import importlib
import logging
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from .adapter import SglangAdapter
from .checks import Req, Violation
from .compat import dec_params, swa_pools
from .sched_req import kept_lock
from .install import SglangUnavailable, cache_class, load
from .layouts import FAULTS, LayoutError
from .plant import frees_disabled
from .unified_checks import Hold, UnifiedChecks
from .compat import component_types, has_tree_cores, rust_core_gap  # noqa: F401 (re-exported)


class UnifiedAdapter(UnifiedChecks, SglangAdapter):
    """SglangAdapter for UnifiedRadixCache on one tree core (`core`: python | rust)."""

    core = "python"

    def __init__(self, layout: Any, fault: str | None = None, capacity: int | None = None,
                 core: str | None = None, plant: bool = True) -> None:
        self.core = core or "python"
        self._plant_here = plant
        super().__init__(layout, fault, capacity)

    # ---- construction --------------------------------------------------------------------
    def reset(self, cfg: Any = None) -> None:
        import torch
        S = load()
        self.S, self.torch, self.CT = S, torch, component_types()
        if logging.getLogger("sglang").level != logging.CRITICAL:   # (setLevel clears every logger's cache)
            logging.getLogger("sglang").setLevel(logging.CRITICAL)
        # 0.5.12's SWA lock walk skips tombstones (listing them in the receipt); 0.5.11 asserts
        # there are none, TreeCore releases count them
        self.skips_tombstones = "skip_lock_node_ids" in {f.name for f in fields(S["bpc"].IncLockRefResult)}
        if self.core == "rust" and rust_core_gap():
            raise SglangUnavailable(rust_core_gap())
        self.swa = "swa" in self.lay.components
        self.W = self.lay.window or 0
        self.cache = self._build()
        # node handles are ids into a tree core (0.5.17+, whether or not its backend is pluggable)
        self.tree_cores = hasattr(self.cache, "tree_core")
        if has_tree_cores() and type(self.cache.tree_core).__name__ != \
                {"python": "UnifiedTreeCore", "rust": "RustUnifiedTreeCore"}[self.core]:
            raise SglangUnavailable(f"asked for the {self.core} tree core, SGLang built "
                                    f"{type(self.cache.tree_core).__name__} (it fell back)")
        self.params_api = True
        self.reqs: dict[str, Req] = {}
        self.holds: dict[str, Hold] = {}
        self.written: dict[int, tuple[int, ...]] = {}
        self.written_swa: dict[int, tuple[int, ...]] = {}
        self.twin: set[tuple[int, ...]] = set()
        self.keys: set[tuple[int, ...]] = set()          # every key inserted (the lockstep compares along them)
        self.coverage: Counter = Counter()
        self.lost: list[Violation] = []
        self.hits = self.next_id = self._inserts = 0
        self.broken: Violation | None = None
        self.last_obs: dict[str, Any] = {}
        if self._plant_here:
            self._plant()

    def _build(self) -> Any:
        """The pools (self.alloc) and the cache on them, FULL or FULL+SWA (a subclass builds others)."""
        S, torch = self.S, self.torch
        al, ps, cap = S["allocator"], self.lay.page_size, self.capacity
        if self.swa:
            self.size_swa = max(2 * self.W, cap // 2)   # short of SWA: the tree tombstones by itself
            self.alloc = swa_pools(cap, self.size_swa)
            comps = (self.CT.FULL, self.CT.SWA)
        else:
            if ps == 1:
                self.alloc = al.TokenToKVPoolAllocator(cap, torch.int64, "cpu", None, False)
            else:
                self.alloc = al.PagedTokenToKVPoolAllocator(cap, ps, torch.int64, "cpu", None, False)
            comps = (self.CT.FULL,)
        return self._new_cache(comps, None, sliding_window_size=self.W if self.swa else None)

    def _new_cache(self, comps: tuple, req_to_token_pool: Any, **extra: Any) -> Any:
        """UnifiedRadixCache(CacheInitParams(...)) with the fields this release takes, on this core."""
        P = self.S["CacheInitParams"]
        names = {f.name for f in fields(P)}
        kw: dict[str, Any] = dict(disable=False, req_to_token_pool=req_to_token_pool,
                                  token_to_kv_pool_allocator=self.alloc, page_size=self.lay.page_size,
                                  tree_components=comps, tree_core_backend=self.core,
                                  **{k: v for k, v in extra.items() if v is not None})
        return cache_class("UnifiedRadixCache")(P(**{k: v for k, v in kw.items() if k in names}))

    # ---- the release's API ----------------------------------------------------------------
    def handle_node(self, h: Any) -> Any:
        """The Python node object behind a match's handle (None on the Rust core)."""
        if self.core == "rust":
            return None
        return self.cache.tree_core.node_by_id(h) if self.tree_cores else h

    def root(self) -> Any:
        return self.cache.root_node

    def path_slots_of(self, h: Any) -> list[int]:
        if self.core == "rust":
            t = self.cache.tree_core.collect_full_device_indices(h, self.cache.root_node_handle())
            return [int(x) for x in t.tolist()]
        out, node, root = [], self.handle_node(h), self.root()
        while node is not root:
            out.append([int(v) for v in node.component_data[self.CT.FULL].value.tolist()])
            node = node.parent
        return [v for part in reversed(out) for v in part]

    def _match_u(self, tokens: list[int]) -> tuple[int, Any, Any]:
        P = self.S["bpc"].MatchPrefixParams
        swa_comp = self.cache.components.get(self.CT.SWA) if self.swa else None
        W = swa_comp.sliding_window_size if swa_comp is not None else None
        if swa_comp is not None and self.planted(FAULTS["match_ignores_tombstones"]):
            swa_comp.sliding_window_size = 1     # one live SWA token past a tombstone will do
        try:
            m = self.cache.match_prefix(P(key=self._key(tokens)))
        finally:
            if swa_comp is not None:
                swa_comp.sliding_window_size = W
        hit = m.device_prefix_len if hasattr(m, "device_prefix_len") else len(m.device_indices)
        if self.planted(FAULTS["match_overreach"]) and hit:
            hit += self.lay.page_size
        return hit, m.last_device_node, m

    def _cache_evict(self, n: int, swa: int | None = None) -> int:
        E = self.S["bpc"].EvictParams
        r = self.cache.evict(E(num_tokens=n, swa_num_tokens=(n if swa is None else swa) if self.swa else 0))
        self.last_obs["evicted"] = (r.num_tokens_evicted, getattr(r, "swa_num_tokens_evicted", 0))
        if self.swa and self.core == "python":
            self.coverage["state:tombstoned"] += any(v.swa is None for v in self.views())
        return r.num_tokens_evicted

    def _alloc(self, n: int) -> list[int] | None:
        if not self.swa:
            return super()._alloc(n)
        if n == 0:
            return []
        out = self.alloc.alloc(n)
        if out is None:
            self._evict(max(0, n - self.alloc.full_available_size()), max(0, n - self.alloc.swa_available_size()))
            out = self.alloc.alloc(n)
        return None if out is None else [int(x) for x in out.tolist()]

    def _write(self, req: Req, p: int, slot: int) -> None:
        self.written[slot] = tuple(req.tokens[:p + 1])
        if self.swa:
            self.written_swa[self.swa_of(slot)] = tuple(req.tokens[:p + 1])

    def _evict(self, n: int, swa: int | None = None) -> int:
        """Evict; on the Python core the twin forgets exactly what the tree dropped."""
        if self.core == "rust":
            return self._cache_evict(n, swa)
        return super()._evict(n, swa)

    def _locked_prefixes(self) -> set[tuple[int, ...]]:
        return {v.path + v.key for v in self.views() if v.full_lock > 0}

    # ---- actions -------------------------------------------------------------------------
    def _a_match(self, r: str) -> dict:
        req = self._get(r, "waiting")
        ps = self.lay.page_size
        hit, h, m = self._match_u(req.tokens[:-1])
        path = self.path_slots_of(h)
        self.check_hit(req, hit, path)
        self.hits += hit > 0
        self.check_reuse(req, hit)
        hold = self.lock_model(h, hit)
        rec = self.cache.inc_lock_ref(h)
        hold.receipt = rec
        need = self._need(req, hit)            # all of the prompt, or its first chunk
        new = self._alloc(-(-need // ps) * ps)
        obs = {"hit": hit, "full_hit": getattr(m, "full_kv_hit_length", None),
               "swa_branch": getattr(m, "swa_branching_seqlen", None)}
        if new is None:
            self.cache.dec_lock_ref(h, dec_params(rec))
            self.coverage["state:admission_refused"] += 1
            return dict(obs, admitted=False)
        self.holds[r] = hold
        req.node, req.hit, req.state = h, hit, "running"
        req.slots, req.spare, req.floor = path + new[:need], new[need:], len(req.tokens)
        for p in range(hit, hit + need):
            self._write(req, p, req.slots[p])
        self.coverage["state:hit" if hit else "state:miss"] += 1
        if self.swa and self.core == "python":
            self.coverage["state:hit_past_tombstone"] += any(v.swa is None for v in self.path_views(h))
        return dict(obs, admitted=True)

    def _a_finish(self, r: str) -> dict:
        req = self._get(r, "running")
        ps = self.lay.page_size
        n = len(req.tokens) // ps * ps
        vals = self.torch.tensor(req.slots[:n], dtype=self.torch.int64)
        if self.planted(FAULTS["insert_shifted_values"]):
            vals = self.torch.roll(vals, 1)
        self._inserts += 1
        dropped = (self.planted(FAULTS["drop_insert"]) and self._inserts % 2 == 0) or \
            (self.planted(FAULTS["core_drops_insert"]) and self._inserts % 3 == 0)
        if dropped:                          # declined: the new slots are freed, nothing cached
            self._free(req.slots[req.hit:n])
            prefix_len = n
        else:
            I = self.S["bpc"].InsertParams
            prefix_len = self.cache.insert(I(key=self._key(req.tokens[:n]), value=vals,
                                             prev_prefix_len=req.hit)).prefix_len
            self.keys.add(tuple(req.tokens[:n]))
        self._free([s for s in req.slots[n:] if s is not None] + req.spare)   # past the key: the caller's
        self._release(req)
        for end in range(ps, n + 1, ps):
            self.twin.add(tuple(req.tokens[:end]))
        del self.reqs[r]
        return {"prefix_len": prefix_len}

    # ---- the scheduler path (sched.py): SGLang moves the lock, the holds follow ------
    def _lock_receipt(self, r: str) -> Any:
        """The admission's whole receipt: the request keeps what its release keeps of it (0.5.22+ a
        TreeLock, 0.5.20-0.5.21 its DecLockRefParams, 0.5.11-0.5.19 its `swa_uuid_for_lock`, as
        the scheduler's `_req_inc_lock_ref` does): sched_req.keep_lock."""
        return self.holds[r].receipt

    def _relocked(self, r: str, s: Any) -> None:
        """The lock SGLang moved: the SWA segment it covers is the one an inc_lock_ref at the new
        node takes (computed on the tree as the re-insert left it), the receipt SGLang keeps."""
        req = self.reqs[r]
        hit = len(self.path_slots_of(req.node))
        hold = self.lock_model(req.node, hit) if hit else Hold(None)
        hold.receipt = kept_lock(s.req)
        self.holds[r] = hold
        self.keys.add(tuple(req.tokens[:hit]))

    def _released(self, r: str, s: Any) -> None:
        self.holds.pop(r, None)
        self.keys.add(tuple(self.reqs[r].tokens[:s.computed // self.lay.page_size * self.lay.page_size]))

    def _release(self, req: Req) -> None:
        self.cache.dec_lock_ref(req.node, dec_params(self.holds.pop(req.rid).receipt))

    def _a_evict(self, n: int) -> dict:
        """Explicit eviction; on FULL+SWA it asks for SWA tokens only (the full side is evicted by
        allocation pressure), so internal nodes are tombstoned and matches cross tombstones."""
        self._evict(0, n) if self.swa else self._evict(n)
        return {"evicted": self.last_obs.get("evicted")}

    # ---- planted faults (thin wrappers on this cache instance) ----------------------------
    def _plant(self) -> None:
        f, c = self.fault, self.cache
        if f == "lock_ref_leak":
            real_dec = c.dec_lock_ref

            def dec(h: Any, *rest: Any, **kw: Any) -> Any:
                out = real_dec(h, *rest, **kw)
                node = self.handle_node(h)
                if node is not None and node is not self.root():       # a reference nobody holds:
                    node.component_data[self.CT.SWA if self.swa else self.CT.FULL].lock_ref += 1   # SWA's, if any
                return out
            c.dec_lock_ref = dec
        elif f in ("evict_locked", "evict_no_free"):
            real_evict = c.evict

            def evict(*params: Any, **kw: Any) -> Any:
                if f == "evict_no_free":
                    with frees_disabled(c):
                        return real_evict(*params, **kw)
                out = real_evict(*params, **kw)
                locked = [v.node for v in self.views() if v.full_lock > 0 and not v.node.children]
                if locked:                   # free and unlink the deepest locked leaf
                    n = locked[0]
                    self.alloc.free(n.component_data[self.CT.FULL].value)
                    n.parent.children = {k: ch for k, ch in n.parent.children.items() if ch is not n}
                return out
            c.evict = evict

    def _fault_ok(self) -> None:
        if self.fault in ("lock_ref_leak", "evict_locked") and self.core == "rust":
            raise LayoutError(f"fault {self.fault!r} edits tree nodes: it is planted on the Python core only")
