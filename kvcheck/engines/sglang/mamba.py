"""SGLang's MambaRadixCache (full attention + Mamba recurrent state) as a system under test.

The tree keeps full-attention KV for every node but a Mamba state slot only at some: a request
resumes at a hit only if the node the hit ends at holds the recurrent state for exactly that
prefix (the spec's "recurrent state needed at the resume point"), plus full KV for all of it.
`evict_mamba` tombstones internal nodes (their state freed, their KV kept). The pools are real:
`HybridReqToTokenPool`'s `MambaPool` (tiny state tensors on CPU) and a `HybridLinearKVPool` under
a `TokenToKVPoolAllocator`. The adapter writes a fingerprint of each state's prefix into the
state tensor itself, so a hit's state is checked byte for byte after SGLang's `copy_from`.
Slot ownership on insert: the caller frees a request's duplicate KV slots on 0.5.7, the tree
does on 0.5.12 (`InsertParams.prev_prefix_len`); the request's state slot is the tree's when the
insert reports `mamba_exist=False`, else the caller's to free.
"""
from __future__ import annotations

from typing import Any

from .adapter import SglangAdapter
from .checks import (Req, Violation, key_tokens, slots_of, tokens_of)
from .layouts import FAULTS
from .compat import has_params, kw, method_reads
from .mamba_state import (MambaStates, fingerprint, mamba_pools, set_server_args_stand_in)  # noqa: F401
from .sched_req import req_get, req_set


def tree_frees_duplicates(cache: Any) -> bool:
    """Who frees a finished request's duplicate KV slots [hit, prefix_len): the tree where its
    insert reads `prev_prefix_len` (0.5.12: `_insert_helper` frees them from there), else the
    caller (0.5.7; 0.5.9 has InsertParams but its Mamba tree does not read that field)."""
    return method_reads(cache, "insert", "prev_prefix_len")


class MambaAdapter(MambaStates, SglangAdapter):
    """SglangAdapter for MambaRadixCache: two pools (KV slots, Mamba state slots), state only
    at some nodes, full and mamba lock references, per-component size accounting."""

    def reset(self, cfg: Any = None) -> None:
        from collections import Counter

        import torch

        from .install import cache_class, load
        from .layouts import LayoutError
        if self.lay.page_size != 1:
            raise LayoutError(f"layout {self.lay.name}: MambaRadixCache is driven with page_size 1 only "
                              "(SGLang's v1 Mamba tree; paging needs its extra buffer)")
        S = load()
        self.S, self.torch = S, torch
        # SGLang sizes max_running_requests = mamba cache size // 3 (MAMBA_CACHE_SIZE_MAX_RUNNING_
        # REQUESTS_RATIO: a request's own state, the state its lock pins, a fork for its chunk);
        # the generator runs up to 4 requests, so at least 12 state slots
        pools = mamba_pools(self.capacity, 12)       # the shared pools (mamba_state.py)
        self.rtp, self.mpool, self.mslots, self.alloc = pools["rtp"], pools["mpool"], pools["mslots"], pools["alloc"]
        self.mamba_size, self.m_all = pools["size"], pools["every"]
        cls = cache_class(self.lay.cls)
        settings = dict(disable=False, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc, page_size=1)
        self.cache = (cls(S["CacheInitParams"](**settings)) if S["CacheInitParams"] is not None
                      else cls(**kw(cls.__init__, **settings)))      # before CacheInitParams (0.5.3-0.5.4)
        self.params_api = hasattr(S["bpc"], "MatchPrefixParams")
        self.reqs: dict[str, Req] = {}
        self.written: dict[int, tuple[int, ...]] = {}
        self.mwritten: dict[int, tuple[int, ...]] = {}     # state slot -> the prefix it is the state after
        self.mslot: dict[str, int] = {}                    # running request -> its own state slot
        self.mlocked: dict[str, bool] = {}                 # running request -> its node had state when locked
        self.twin: set[tuple[int, ...]] = set()            # every inserted key (state at its end)
        self.finished: set[tuple[int, ...]] = set()        # every finished request's tokens (next turns)
        self.coverage, self.lost, self.hits, self.next_id = Counter(), [], 0, 0
        self.broken, self._inserts, self._last_node = None, 0, None
        self._plant()

    # ---- the release's API ----------------------------------------------------------------
    def _match(self, tokens: list[int]) -> tuple[int, Any]:
        key = self._key(tokens)
        m = self.cache.match_prefix(self.S["bpc"].MatchPrefixParams(key=key) if self.params_api else key)
        hit, node = len(m.device_indices), m.last_device_node
        if self.planted(FAULTS["mamba_hit_without_state"]):   # the deepest matched node, state or not
            node, hit = self._deepest(tokens)
        if self.planted(FAULTS["match_overreach"]) and hit:
            hit += 1
        self._last_node = node
        return hit, node

    def _deepest(self, tokens: list[int]) -> tuple[Any, int]:
        node, p = self.cache.root_node, 0
        while True:
            nxt = next((c for c in node.children.values()
                        if key_tokens(c) == tokens[p:p + len(c.key)]), None)
            if nxt is None:
                return node, p
            node, p = nxt, p + len(nxt.key)

    def _cache_evict(self, n: int, mamba: int | None = 0) -> int:
        c, mamba = self.cache, mamba or 0
        before = self.alloc.available_size()
        if has_params("EvictParams"):
            c.evict(self.S["bpc"].EvictParams(num_tokens=n, mamba_num=mamba))
        else:
            c.evict(n)
            c.evict_mamba(mamba)
        self.coverage["state:tombstoned"] += any(x.mamba_value is None for x, _ in self.tree())
        return self.alloc.available_size() - before

    def state_prefixes(self) -> dict[tuple[int, ...], Any]:
        return {path + tuple(key_tokens(n)): n for n, path in self.tree() if n.mamba_value is not None}

    def _evict(self, n: int, swa: int | None = None) -> int:
        """Evict full KV (n tokens) and Mamba states (swa: their number); the twin forgets
        exactly the states the tree dropped; nothing locked may go."""
        held = {rid: self.reqs[rid].node for rid, ok in self.mlocked.items() if ok}
        before = set(self.state_prefixes())
        got = super()._evict(n, swa)          # no locked node removed; the twin forgets what went
        gone = before - set(self.state_prefixes())
        self.twin -= gone
        self.coverage["state:mamba_evicted"] += bool(gone)
        for rid, node in held.items():
            if node.mamba_value is None:
                raise Violation("bookkeeping", "no_evict_locked", f"{rid}'s locked node lost its Mamba state")
        return got

    # ---- actions -------------------------------------------------------------------------
    def _a_match(self, r: str) -> dict:
        req = self._get(r, "waiting")
        hit, node = self._match(req.tokens[:-1])
        path = self.path_slots(node)
        self.check_hit(req, hit, path)
        self.hits += hit > 0
        want = self.twin_hit(req.tokens)
        if want > hit:
            raise Violation("lost_reuse", "lost_reuse", f"{r}: the no-eviction twin holds the state after a "
                            f"{want}-token prefix, the tree matched {hit}")
        self.cache.inc_lock_ref(node)
        locked = node.mamba_value is not None
        ms = self._mamba_alloc()
        new = None if ms is None else self._alloc(self._need(req, hit))     # all, or the first chunk
        if new is None:
            if ms is not None:
                self._mamba_release(ms)
            self.cache.dec_lock_ref(node)
            self.coverage["state:admission_refused"] += 1
            return {"hit": hit, "admitted": False}
        if hit:     # resume: SGLang copies the node's state into the request's slot (cow_mamba)
            self.mpool.copy_from(node.mamba_value, self.torch.tensor([ms], dtype=self.torch.int64))
            self.mwritten[ms] = self.mwritten.get(int(node.mamba_value[0]), ())   # the shadow follows the copy
            if not self._state_holds(ms, tuple(req.tokens[:hit])):
                raise Violation("safety", "hit_sound_mamba_state", f"{r}: the state copied from the hit node is "
                                f"not the state after its {hit}-token prefix")
        self._state_write(ms, tuple(req.tokens[:hit + len(new)]))        # prefill runs the rest
        self.mslot[r], self.mlocked[r] = ms, locked
        req.node, req.hit, req.state = node, hit, "running"
        req.slots, req.spare, req.floor = path + new, [], len(req.tokens)
        for p in range(hit, hit + len(new)):
            self._write(req, p, req.slots[p])
        self.coverage["state:hit" if hit else "state:miss"] += 1
        return {"hit": hit, "admitted": True}

    def _insert_state(self, req: Req, vals: Any, mv: Any) -> tuple[int, bool]:
        """The release's insert (MambaStates._a_finish): (prefix_len, mamba_exist). The duplicate
        KV slots [hit, prefix_len) are the caller's to free on 0.5.7 and when the insert is
        declined, the tree's on 0.5.12 (`tree_frees_duplicates`)."""
        dropped = self.planted(FAULTS["drop_insert"]) and self._inserts % 2 == 0
        if dropped:
            prefix_len, exist = len(req.tokens), True     # declined: the caller frees all it has
        elif has_params("InsertParams"):
            res = self.cache.insert(self.S["bpc"].InsertParams(key=self._key(req.tokens), value=vals,
                                                                mamba_value=mv, prev_prefix_len=req.hit))
            prefix_len, exist = res.prefix_len, res.mamba_exist
        else:
            prefix_len, exist = self.cache.insert(self._key(req.tokens), vals, mv)
        if dropped or not tree_frees_duplicates(self.cache):
            self._free(req.slots[req.hit:prefix_len])           # duplicates of the tree's
        return prefix_len, exist

    def _a_abort(self, r: str) -> dict:
        req = self._get(r)
        if req.state == "running":
            self._mamba_release(self.mslot.pop(r))
            self.mlocked.pop(r)
        return super()._a_abort(r)

    def _a_evict(self, n: int, mamba: int = 0) -> dict:
        return {"evicted": self._evict(n, mamba)}

    # ---- checks ---------------------------------------------------------------------------
    def check_hit(self, req: Req, hit: int, path: list[int]) -> None:
        """Full KV for all of [0, hit), and the node the hit ends at holds a live state slot
        whose bytes are the state after exactly tokens[:hit]."""
        super().check_hit(req, hit, path)
        node = self._last_node
        if hit == 0 or node is self.cache.root_node:
            return
        if node.mamba_value is None:
            raise Violation("safety", "hit_sound_mamba_state", f"{req.rid}: hit {hit} ends at a node with no "
                            "Mamba state (a tombstone): the resume has no recurrent state")
        s = int(node.mamba_value[0])
        if s in self.mamba_free() or not self._state_holds(s, tuple(req.tokens[:hit])):
            raise Violation("safety", "hit_sound_mamba_state", f"{req.rid}: hit {hit} resumes from state slot {s}, "
                            f"which holds {self.mwritten.get(s)!r:.60} (free: {s in self.mamba_free()})")

    def snapshot(self) -> dict[str, list]:
        """What dirties a slot: KV (free, prefix written), state (free, prefix, bytes)."""
        return {"full": [frozenset(self.free_slots()), dict(self.written)],
                "mamba": [frozenset(self.mamba_free()), dict(self.mwritten), *self._state_rows()]}

    def req_sig(self) -> Any:
        return super().req_sig(), tuple(sorted(self.mlocked.items())), tuple(sorted(self.mslot.items()))

    def check_state(self, inc: Any = None) -> None:
        nodes = self.walk(inc, self.tree)
        if inc is None or not inc.reqs_same:
            self._mamba_locks(nodes)
        self._content(nodes, inc)
        self._mamba_content(nodes, inc)
        self._mamba_sizes(nodes, inc)
        if any(r.state == "running" for r in self.reqs.values()) or not self.sanity_due(inc):
            return                  # SGLang's sanity_check asserts an idle tree (no locks)
        try:
            self.cache.sanity_check()
        except Exception as e:      # it raises a plain Exception
            raise Violation("bookkeeping", "tree_sanity_check", f"sanity_check failed: {e}") from None
        self.sanity_passed(inc)

    def _mamba_locks(self, nodes: list) -> None:
        """full_lock_ref = holders through the node; mamba_lock_ref = holders locked at it
        (with its state)."""
        full: dict[int, int] = {}
        mamba: dict[int, int] = {}
        root = self.cache.root_node
        for r in self.reqs.values():
            if r.state != "running":
                continue
            if self.mlocked.get(r.rid):
                mamba[id(r.node)] = mamba.get(id(r.node), 0) + 1
            n = r.node
            while n is not root:
                if n.parent is None or not any(c is n for c in n.parent.children.values()):
                    raise Violation("bookkeeping", "no_evict_locked", f"{r.rid} holds a node no longer in the tree")
                full[id(n)] = full.get(id(n), 0) + 1
                n = n.parent
        for node, path in nodes:
            got, want = (node.full_lock_ref, node.mamba_lock_ref), (full.get(id(node), 0), mamba.get(id(node), 0))
            if got != want:
                raise Violation("bookkeeping", "lock_ref_equals_holders", f"node at depth {len(path)}: "
                                f"(full, mamba) lock_ref {got}, holders {want}")

    def _mamba_content(self, nodes: list, inc: Any = None) -> None:
        """Every state slot in the tree is allocated and holds the state after its node's prefix."""
        free, rows = self.mamba_free(), self._state_rows()
        for node, path in nodes:
            if node.mamba_value is None:
                if not node.children:
                    raise Violation("bookkeeping", "tree_sanity_check", f"a leaf at depth {len(path)} is a tombstone")
                continue
            s = self.conv(node.mamba_value, slots_of)[0]
            if inc is not None and inc.clean(node, (id(path), id(node.key), id(node.mamba_value)), "mamba", mamba=[s]):
                continue
            want = self.prefix_of(path, node.key, tokens_of)
            if s in free:
                raise Violation("bookkeeping", "tree_slots_live", f"node at depth {len(path)} keeps state slot {s}, "
                                "which the Mamba pool has free")
            if not self._state_holds(s, want, rows):
                raise Violation("bookkeeping", "tree_content_matches", f"node at depth {len(path)}: state slot {s} "
                                f"holds the state after {self.mwritten.get(s)!r:.60}, not after its prefix")

    def _mamba_sizes(self, nodes: list, inc: Any = None) -> None:
        """Per component: evictable + protected = the tree's; tree + requests' own + free =
        capacity, disjoint (full: KV slots; mamba: state slots)."""
        c = self.cache
        total = sum(len(self.vals(n)) for n, _ in nodes)
        prot = sum(len(self.vals(n)) for n, _ in nodes if n.full_lock_ref > 0)
        states = [n for n, _ in nodes if n.mamba_value is not None]
        mprot = sum(1 for n in states if n.mamba_lock_ref > 0)
        got = (c.full_evictable_size(), c.full_protected_size(), c.mamba_evictable_size(), c.mamba_protected_size())
        if (inc is None or not inc.same) and got != (total - prot, prot, len(states) - mprot, mprot):
            raise Violation("bookkeeping", "size_accounting", f"full evictable/protected {got[0]}/{got[1]}, mamba "
                            f"{got[2]}/{got[3]}; the tree has {total - prot}/{prot}, {len(states) - mprot}/{mprot}")
        run = [r for r in self.reqs.values() if r.state == "running"]
        full_owned = [v for n, _ in nodes for v in self.vals(n)] + [s for r in run for s in r.slots[r.hit:]]
        m_owned = [self.conv(n.mamba_value, slots_of)[0] for n in states] + [self.mslot[r.rid] for r in run]
        for name, owned, free, every in (("full", full_owned, self.free_slots(), self.all_slots()),
                                         ("mamba", m_owned, sorted(self.mamba_free()), self.m_all)):
            seen = owned + list(free)
            if len(seen) != len(set(seen)) or set(seen) != every:
                raise Violation("bookkeeping", "size_accounting", f"{name}: {len(owned)} owned + {len(free)} free of "
                                f"{len(every)}: {len(seen) - len(set(seen))} counted twice, "
                                f"{len(every - set(seen))} leaked")
        if self.alloc.available_size() != len(self.free_slots()):
            raise Violation("bookkeeping", "size_accounting", "available_size != free KV slots")

    # ---- the scheduler path (sched.py): the request's state slot travels with it ---
    def _sched_new(self, r: str, sreq: Any) -> None:
        """The row SGLang's HybridReqToTokenPool hands out maps to the state slot the admission took
        (its `alloc` takes a new state slot only for a request that holds none), set where the
        release keeps `mamba_pool_idx` (`req_set`): on the request up to 0.5.18, in its `ReqKvInfo`
        record from 0.5.19. Set on the request there, the field was a stray attribute: `alloc` saw
        `req.kv.holds_mamba` False, gave the request a second, never-written state slot, and
        `cache_unfinished_req` copied that one into the tree (a false tree_content_matches).
        The resume copy of a hit node's state (0.5.16+: deferred to the forward through
        `kv.mamba_cow_src_index`, set only by a match that is passed the request with `cow_mamba`)
        is the adapter's own, made at admission (`_a_match`): its match passes no request."""
        req_set(sreq, mamba_pool_idx=self.torch.tensor(self.mslot[r], dtype=self.torch.int64))

    def _computed(self, r: str, upto: int) -> None:
        self._state_write(self.mslot[r], tuple(self.reqs[r].tokens[:upto]))    # the chunk's forward

    def _sglang_call(self, fn: Any) -> None:
        """cache_unfinished_req forks the request's state into a new slot for the tree: with the
        pool's `fork_from` where the release has it, else a new slot and `copy_from` (0.5.14):
        the shadow follows each copy either way."""
        pool, parent = self.mpool, super()._sglang_call
        held = {rid: self.reqs[rid].node for rid, ok in self.mlocked.items() if ok}
        if hasattr(pool, "fork_from"):
            real = pool.fork_from

            def fork_from(src: Any) -> Any:
                out = real(src)
                if out is not None:
                    for d, s in zip(out.flatten().tolist(), src.flatten().tolist()):
                        self.mwritten[int(d)] = self.mwritten.get(int(s))
                return out
            pool.fork_from = fork_from
        try:
            self.following_state_copies(lambda: parent(fn))
        finally:
            if "fork_from" in vars(pool):
                del pool.fork_from
        for rid, node in held.items():
            if node.mamba_value is None:
                raise Violation("bookkeeping", "no_evict_locked", f"{rid}'s locked node lost its Mamba state "
                                "inside SGLang's scheduler call")

    def _relocked(self, r: str, s: Any) -> None:
        """The lock SGLang moved is a mamba lock if the new last node keeps a state."""
        self.mlocked[r] = req_get(s.req, "last_node").mamba_value is not None

    def _released(self, r: str, s: Any) -> None:
        self.mslot.pop(r, None)
        self.mlocked.pop(r, None)
        if s.inserted:
            self.finished.add(tuple(self.reqs[r].tokens))

    def _remember(self, req: Req, n: int) -> None:
        self.twin.add(tuple(req.tokens[:n]))        # a state kept at the inserted key's end

