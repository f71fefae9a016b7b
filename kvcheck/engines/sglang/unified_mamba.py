"""SGLang's UnifiedRadixCache with tree components FULL+MAMBA (the default cache of Mamba-hybrid
models from 0.5.16; 0.5.11-0.5.12 have it with the tree in the cache) as a system under test.

The tree keeps full KV for every node and a Mamba state slot only at some (an inserted key's end;
a split leaves the new parent without one, `evict(mamba_num)` tombstones internal nodes). Map onto
the spec: the state at a node is `objects.RECURRENT_STATE`: a resume at a hit of k tokens reads
the state after exactly k tokens, so a hit may end only at a node whose state slot is live and
holds that state, and the request's own slot must hold it after SGLang's copy-on-write.

The adapter plays the scheduler: `match_prefix(cow_mamba=True, req=...)` (SGLang allocates the
request's state slot and names the node's state as the copy source; 0.5.11-0.5.12 copy inside the
match, 0.5.23 defers the copy to the forward, which the adapter then runs as ScheduleBatch does),
`inc_lock_ref` (full on the path, mamba on the hit node), allocation with eviction, prefill and
decode (the adapter writes the state's fingerprint, mamba_state.py), and at finish
`insert(key, value, mamba_value=the request's slot, prev_prefix_len=hit)`: the tree frees the
duplicate KV slots itself and takes the state slot unless it reports `mamba_exist` (then the
caller frees it, as `cleanup_after_caching_req` does). Pools and state shadow: mamba_state.py;
checks: unified_checks.py (full) plus the Mamba ones here; the Python/Rust lockstep:
unified_diff.py's `LockstepAdapter` with these adapters on both sides.
"""
from __future__ import annotations

import inspect
from typing import Any

from .checks import Req, Violation
from .compat import dec_params
from .sched_req import kept_lock, req_set
from .layouts import FAULTS
from .mamba_state import MambaStates, mamba_pools
from .unified import Hold, UnifiedAdapter
from .unified_diff import LockstepAdapter
from .unified_mamba_checks import UnifiedMambaChecks


class MambaReqStandIn:
    """KVCHECK_CPU_STUB: the scheduler's Req as match_prefix(cow_mamba=True) reads and writes it
    (0.5.11-0.5.12 on the Req itself, 0.5.23 on `req.kv`): the request's state slot and the copy
    source SGLang names for the forward."""

    def __init__(self) -> None:
        self.mamba_pool_idx: Any = None
        self.mamba_cow_src_index: Any = None
        self.mamba_needs_clear = False
        self.lock = None
        self.session = None             # not in a streaming session

    kv = property(lambda self: self)
    holds_mamba = property(lambda self: self.mamba_pool_idx is not None)


class UnifiedMambaAdapter(UnifiedMambaChecks, MambaStates, UnifiedAdapter):
    """UnifiedAdapter for FULL+MAMBA on one tree core (`core`: python | rust)."""

    def reset(self, cfg: Any = None) -> None:
        self.mwritten: dict[int, tuple[int, ...]] = {}     # state slot -> the prefix it is the state after
        self.mslot: dict[str, int] = {}                    # running request -> its own state slot
        self.mlocked: dict[str, Any] = {}                  # running request -> the node its mamba lock is on
        self.finished: set[tuple[int, ...]] = set()        # finished requests' tokens (next turns)
        self._last_node: Any = None
        super().reset(cfg)

    def _build(self) -> Any:
        from .layouts import LayoutError
        if self.lay.page_size != 1:
            raise LayoutError(f"layout {self.lay.name}: FULL+MAMBA is driven with page_size 1 only (without "
                              "the Mamba extra buffer SGLang caches only sequence-end states, page 1)")
        # as MambaRadixCache's: SGLang runs at most (state slots / 3) requests (a request's own state,
        # the state its lock pins, the fork a chunk's checkpoint takes); the generator runs up to 4
        pools = mamba_pools(self.capacity, 12)
        self.rtp, self.mpool, self.mslots, self.alloc = pools["rtp"], pools["mpool"], pools["mslots"], pools["alloc"]
        self.mamba_size, self.m_all = pools["size"], pools["every"]
        return self._new_cache((self.CT.FULL, self.CT.MAMBA), self.rtp, enable_mamba_extra_buffer=False)

    # ---- the tree's Mamba side (Python core) ---------------------------------------------
    def state_of(self, node: Any) -> int | None:
        v = node.component_data[self.CT.MAMBA].value
        return None if v is None else int(v.reshape(-1)[0])

    def state_prefixes(self) -> dict[tuple[int, ...], Any]:
        """Every node with a state, by the token prefix it ends (Python core; {} on Rust)."""
        if self.core == "rust":
            return {}
        return {v.path + v.key: v.node for v in self.views() if self.state_of(v.node) is not None}

    def _forget_lost_states(self, before: dict) -> None:
        """The twin forgets exactly the states that left the tree; none a holder locked may go."""
        if self.core == "rust":
            return
        gone = set(before) - set(self.state_prefixes())
        self.twin -= gone
        self.coverage["state:mamba_evicted"] += bool(gone)
        had = {id(n) for n in before.values()}     # a tombstone may be locked (0.5.23 counts it): only a
        for rid, node in self.mlocked.items():      # state that was there may not go
            if node is not None and id(node) in had and self.state_of(node) is None:
                raise Violation("bookkeeping", "no_evict_locked", f"{rid}'s mamba-locked node lost its state")

    # ---- the release's API ----------------------------------------------------------------
    def _match_m(self, tokens: list[int], sr: MambaReqStandIn) -> tuple[int, Any]:
        P = self.S["bpc"].MatchPrefixParams
        m = self.cache.match_prefix(P(key=self._key(tokens), cow_mamba=True, req=sr))
        hit = m.device_prefix_len if hasattr(m, "device_prefix_len") else len(m.device_indices)
        h = m.last_device_node
        if self.planted(FAULTS["mamba_hit_without_state"]):   # the deepest matched node, state or not
            h, hit = self._deepest(tokens)
        if self.planted(FAULTS["match_overreach"]) and hit:
            hit += 1
        return hit, h

    def _deepest(self, tokens: list[int]) -> tuple[Any, int]:
        node, p = self.root(), 0
        while True:
            nxt = next((c for c in node.children.values()
                        if [int(t) for t in c.key.token_ids] == tokens[p:p + len(c.key)]), None)
            if nxt is None:
                return (node.id if self.tree_cores else node), p
            node, p = nxt, p + len(nxt.key)

    def _cache_evict(self, n: int, mamba: int | None = 0) -> int:
        r = self.cache.evict(self.S["bpc"].EvictParams(num_tokens=n, mamba_num=mamba or 0))
        self.last_obs["evicted"] = (r.num_tokens_evicted, r.mamba_num_evicted)
        if self.core == "python":
            self.coverage["state:tombstoned"] += any(self.state_of(v.node) is None for v in self.views())
        return r.num_tokens_evicted

    def _evict(self, n: int, mamba: int | None = None) -> int:
        before = self.state_prefixes()
        got = super()._evict(n, mamba)       # no locked full KV removed; the twin forgets what went
        self._forget_lost_states(before)
        return got

    # ---- actions -------------------------------------------------------------------------
    def _a_match(self, r: str) -> dict:
        req, sr = self._get(r, "waiting"), MambaReqStandIn()
        before = self.state_prefixes()
        hit, h = self._match_m(req.tokens[:-1], sr)
        self._forget_lost_states(before)     # a state slot for the request may evict one
        ms = None if sr.mamba_pool_idx is None else int(sr.mamba_pool_idx)
        self.coverage["state:cow_slot_from_match"] += ms is not None     # SGLang allocated the request's slot
        src = self.state_slot_at(h)
        if ms is not None and src is not None and sr.mamba_cow_src_index is None:
            self.mwritten[ms] = self.mwritten.get(src, ())    # 0.5.11-0.5.12 copied inside the match
        path = self.path_slots_of(h)
        self._last_node = h
        self.check_hit(req, hit, path)
        self.hits += hit > 0
        if self.core == "python" and self.twin_hit(req.tokens) > hit:
            raise Violation("lost_reuse", "lost_reuse", f"{r}: the no-eviction twin holds the state after a "
                            f"{self.twin_hit(req.tokens)}-token prefix, the tree matched {hit}")
        locked = self._mamba_lock_node(h)
        rec = self.cache.inc_lock_ref(h)
        self.mlocked[r] = locked                   # held from here: allocation below may evict
        if ms is None:
            ms = self._mamba_alloc()
        need = self._need(req, hit)                # all of the prompt, or its first chunk
        new = None if ms is None else self._alloc(need)
        if new is None:
            self.mlocked.pop(r)
            if ms is not None:
                self._mamba_release(ms)
            self.cache.dec_lock_ref(h, dec_params(rec))
            self.coverage["state:admission_refused"] += 1
            return {"hit": hit, "admitted": False}
        if sr.mamba_cow_src_index is not None:   # 0.5.23: the forward's deferred copy-on-write
            self.coverage["state:cow_deferred_copy"] += 1
            s = int(sr.mamba_cow_src_index.reshape(-1)[0])
            self.mpool.copy_from(sr.mamba_cow_src_index.reshape(-1), self.torch.tensor([ms], dtype=self.torch.int64))
            self.mwritten[ms] = self.mwritten.get(s, ())
        if hit and not self._state_holds(ms, tuple(req.tokens[:hit])):
            raise Violation("safety", "hit_sound_mamba_state", f"{r}: the state copied into its slot {ms} is "
                            f"{self.mwritten.get(ms)!r:.60}, not the state after its {hit}-token prefix")
        self._state_write(ms, tuple(req.tokens[:hit + need]))      # prefill runs the rest (or a chunk)
        self.holds[r] = Hold(rec)
        self.mslot[r] = ms
        req.node, req.hit, req.state = h, hit, "running"
        req.slots, req.spare, req.floor = path + new, [], len(req.tokens)
        for p in range(hit, hit + need):
            self._write(req, p, req.slots[p])
        self.coverage["state:hit" if hit else "state:miss"] += 1
        return {"hit": hit, "admitted": True}

    def _mamba_lock_node(self, h: Any, skipped: tuple = ()) -> Any:
        """The node a lock at handle h takes a mamba reference on: the hit node itself (0.5.23 counts a
        tombstone, 0.5.11-0.5.12 skip it), unless the receipt skipped the component; None on the Rust
        core (no nodes) and at the root."""
        node = self.handle_node(h)
        if node is None or node is self.root() or self.CT.MAMBA in skipped:
            return None
        return node if not self.skips_tombstones or self.state_of(node) is not None else None

    def state_slot_at(self, h: Any) -> int | None:
        """The state slot of the node behind handle h (the Rust core: its component value)."""
        if self.core == "rust":
            v = self.cache.tree_core.get_component_device_value(h, self.CT.MAMBA)
            return None if v is None else int(v.reshape(-1)[0])
        node = self.handle_node(h)
        return None if node is self.root() else self.state_of(node)

    def _insert_state(self, req: Req, vals: Any, mv: Any) -> tuple[int, bool]:
        """The release's insert (MambaStates._a_finish): (prefix_len, mamba_exist); the tree frees
        the duplicate KV slots itself (`prev_prefix_len`), a declined insert leaves them the caller's."""
        n = len(req.tokens)
        if (self.planted(FAULTS["drop_insert"]) and self._inserts % 2 == 0) or \
                (self.planted(FAULTS["core_drops_insert"]) and self._inserts % 3 == 0):
            self._free(req.slots[req.hit:n])             # declined: the caller frees what it has
            return n, True
        I = self.S["bpc"].InsertParams
        res = self.cache.insert(I(key=self._key(req.tokens), value=vals, mamba_value=mv, prev_prefix_len=req.hit))
        self.keys.add(tuple(req.tokens))
        return res.prefix_len, res.mamba_exist

    def _a_abort(self, r: str) -> dict:
        if self._get(r).state == "running":
            ms = self.mslot.pop(r)
            if not self.planted(FAULTS["mamba_state_leaked_on_abort"]):
                self._mamba_release(ms)
            self.mlocked.pop(r)
        return super()._a_abort(r)

    def _a_evict(self, n: int, mamba: int = 0) -> dict:
        self._evict(n, mamba)
        return {"evicted": self.last_obs.get("evicted")}

    # ---- the scheduler path (sched.py): SGLang's own checkpoint and release ----------
    # 0.5.23 `checkpoint_kv_cache` / 0.5.12 `cache_unfinished_req` fork the request's state into a new
    # slot for the tree (a slot from the allocator + `copy_from`, or `fork_from`), free the fork when the
    # tree already had a state there (`mamba_exist`), and move the lock; a finished request's own slot is
    # donated to the tree (or freed when it had one); an aborted request's slot is freed by SGLang.
    _publishing = False      # SGLang is publishing a chunk (mamba_state_dropped_on_insert: finished requests only)

    def _publish(self, r: str, s: Any) -> None:
        self._publishing = True
        try:
            super()._publish(r, s)
        finally:
            self._publishing = False

    def _sched_new(self, r: str, sreq: Any) -> None:
        """SGLang's request carries the state slot the admission took, so the row SGLang's
        HybridReqToTokenPool hands out maps to it (else alloc takes a second slot for it)."""
        req_set(sreq, mamba_pool_idx=self.torch.tensor(self.mslot[r], dtype=self.torch.int64))   # (req.kv 0.5.19+)

    def _computed(self, r: str, upto: int) -> None:
        self._state_write(self.mslot[r], tuple(self.reqs[r].tokens[:upto]))    # the chunk's forward

    def _sglang_call(self, fn: Any) -> None:
        """SGLang's call with the state shadow following its copies; the twin forgets the states it
        dropped, and no mamba-locked node may lose its state inside it."""
        before = self.state_prefixes()
        self.following_state_copies(lambda: UnifiedAdapter._sglang_call(self, fn))
        self._forget_lost_states(before)

    def _relocked(self, r: str, s: Any) -> None:
        """The full lock and holds as UnifiedAdapter reads them; the mamba reference is on the new last
        node (where the checkpoint put the forked state), unless the receipt skipped the component."""
        super()._relocked(r, s)
        lock = kept_lock(s.req)       # a TreeLock (0.5.22+: its receipt), DecLockRefParams, or a uuid
        skipped = tuple(getattr(getattr(lock, "receipt", lock), "skipped_lock_components", ()) or ())
        self.mlocked[r] = self._mamba_lock_node(self.reqs[r].node, skipped)

    def _remember(self, req: Req, n: int) -> None:
        self.twin.add(tuple(req.tokens[:n]))        # a state kept at the inserted key's end

    def _released(self, r: str, s: Any) -> None:
        super()._released(r, s)
        self.mslot.pop(r, None)
        self.mlocked.pop(r, None)
        if s.inserted:
            self.finished.add(tuple(self.reqs[r].tokens))

    # ---- planted faults --------------------------------------------------------------------
    def _plant(self) -> None:
        f, c = self.fault, self.cache
        if f == "mamba_lock_leak":                # the hit node keeps one mamba reference after a release
            real_dec = c.dec_lock_ref

            def dec(h: Any, *a: Any, **k: Any) -> Any:
                out = real_dec(h, *a, **k)
                node = self.handle_node(h)
                if node is not None and node is not self.root():
                    node.component_data[self.CT.MAMBA].lock_ref += 1
                return out
            c.dec_lock_ref = dec
            return
        if f == "mamba_evict_locked_state":       # evict also tombstones a mamba-locked node's state
            real_evict = c.evict

            def evict(*a: Any, **k: Any) -> Any:
                out = real_evict(*a, **k)
                locked = [v.node for v in self.views() if v.node.component_data[self.CT.MAMBA].lock_ref > 0
                          and self.state_of(v.node) is not None]
                if locked:
                    cd = locked[-1].component_data[self.CT.MAMBA]
                    self.mslots.free(cd.value.reshape(-1))
                    cd.value = None
                return out
            c.evict = evict
            return
        super()._plant()
        if f != "mamba_state_dropped_on_insert":
            return
        comp = self.cache.components[self.CT.MAMBA]
        real = comp.commit_insert_component_data
        sig = inspect.signature(real)

        def commit(*a: Any, **k: Any) -> Any:
            args = sig.bind(*a, **k).arguments
            node = args["node"]
            if self._publishing:                      # a chunk's forked state: not a finished request's
                return real(*a, **k)
            if not args["is_new_leaf"] and node.component_data[self.CT.MAMBA].value is None:
                args["result"].mamba_exist = True     # the tombstone keeps no state; the caller frees its slot
                return None
            return real(*a, **k)
        comp.commit_insert_component_data = commit


class MambaLockstepAdapter(LockstepAdapter):
    """The Python and Rust tree cores of FULL+MAMBA in lockstep: LockstepAdapter's comparison, plus
    the Mamba side a caller sees (mamba sizes, the state pool's free count, the states' contents)."""

    side = UnifiedMambaAdapter

    def evict_params(self, rng: Any) -> dict:          # the generator's hooks read the primary
        return self.py.evict_params(rng)

    def continue_prompt(self, rng: Any, toks: list[int]) -> list[int]:
        return self.py.continue_prompt(rng, toks)

    def _compare(self, action: str, a: dict, b: dict) -> None:
        super()._compare(action, a, b)
        P, R = self.py, self.rs
        for name in ("mamba_evictable_size", "mamba_protected_size"):
            self._diff(name, getattr(P.cache, name)(), getattr(R.cache, name)())
        self._diff("free state slots", len(P.mamba_free()), len(R.mamba_free()))
        self._diff("tree states (the prefixes they are the states after)", self._states(P), self._states(R))

    @staticmethod
    def _states(ad: UnifiedMambaAdapter) -> list:
        return sorted(ad.mwritten.get(int(s), ()) for s in ad.cache.all_mamba_values_flatten().reshape(-1).tolist())
