"""The vLLM adapter's bookkeeping check, incremental: each step checks only what it touched.

A full scan (``check_bookkeeping``: every block, the free queue, the whole prefix-cache map,
every running request's window) per step was most of the checks' time. vLLM changes blocks
only through the requests a step passes to its manager (allocation, free, the scheduler's
helpers) and through ``evict_blocks`` / ``reset_prefix_cache``; the manager's methods are
wrapped to note those requests, so a step checks the blocks in their tables (before and
after the step), the evicted ids, the map entries that point at those blocks (found through
the keys each block carried when last checked) and the windows of the running requests that
hold one. An index of holders is kept per request, so refcounts are compared without a walk.

What the step did *not* announce is still caught: a count check per step (free + held
blocks = the pool), and the full scan every ``full_scan_every`` steps (1: every step, the
exact mode that shrinking and replay use; in a campaign 32, or a pool of thousands of blocks
divided by SCAN_BLOCKS_PER_STEP: a real-size pool's scan costs ~0.1 s, and 32 steps apart it
was a third of the check), after a ``reset_prefix_cache``, and whenever the
count check fails. A violation only a full scan saw is counted (``state:full_scan_only``),
and the shrinker re-locates it in exact mode (drivers.py ``_shrink``).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from .runtime import map_blocks, map_entries, vllm_modules
from .violation import Violation
from .mamba import MAMBA, holds, prev_index, retained_counts

# groups whose blocks vLLM frees while a request runs (remove_skipped_blocks), and what they leave
WINDOWED = {"swa": "sliding window", "swa_mla": "sliding window", "chunked_local": "local-attention chunk"}

# the manager's methods that change a request's blocks (those a release lacks are skipped)
_REQUEST_METHODS = ("allocate_slots", "free", "remove_skipped_blocks", "pop_blocks_for_free",
                    "cache_blocks", "truncate_computed_blocks")
FULL_SCAN_EVERY = 32      # the campaigns' period (steps) of the full scan, at least;
SCAN_BLOCKS_PER_STEP = 32  # at real size longer: the scan's walk of the pool comes to ~32 blocks a step


class Bookkeeping:
    """Mixed into the adapter (its pool, coordinator, groups, requests and shadow model)."""

    full_scan_every: int = 1        # exact by default; run_campaign sets FULL_SCAN_EVERY

    # ---- set-up ----------------------------------------------------------------------------
    def _bk_reset(self) -> None:
        """Fresh index for a fresh manager; wrap its request-changing methods."""
        self._bk_held: dict[str, tuple] = {}    # rid -> (per group: block ids, computed tokens)
        self._bk_where: dict[int, set[tuple[str, int, int]]] = {}   # block id -> (rid, g, index)
        self._bk_keys: dict[int, set] = {}                  # block id -> map keys it carried
        self._bk_nheld = 0                                  # blocks with a holder
        self._bk_ok: dict[Any, tuple] = {}       # map key -> (block, content) found sound
        self._bk_msig: dict[int, tuple] = {}     # block id -> (its keys, content) found sound
        self._bk_touched: set[str] = set()
        self._bk_evicted: set[int] = set()
        self._bk_full = True            # the first check is a full scan (builds the index)
        self._bk_steps = 0
        mgr = self.mgr
        for name in _REQUEST_METHODS:
            fn = getattr(mgr, name, None)
            if fn is not None:
                setattr(mgr, name, self._bk_noting(fn))
        for name in ("evict_blocks", "reset_prefix_cache"):
            fn = getattr(mgr, name, None)
            if fn is not None:
                setattr(mgr, name, self._bk_noting_pool(fn, name))

    def _bk_noting(self, fn: Any) -> Any:
        touched = self._bk_touched

        def wrapped(*a: Any, **k: Any) -> Any:
            r = a[0] if a else next(iter(k.values()))      # the request (or its id)
            touched.add(r if isinstance(r, str) else r.request_id)
            return fn(*a, **k)
        return wrapped

    def _bk_noting_pool(self, fn: Any, name: str) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            out = fn(*a, **k)
            if name == "evict_blocks":
                self._bk_evicted.update(int(i) for i in (a[0] if a else k.get("block_ids", ())))
            else:
                self._bk_full = True
            return out
        return wrapped

    # ---- the check of one step -------------------------------------------------------------
    def check_step(self) -> None:
        """The bookkeeping check after a step: incremental, or the full scan when due."""
        self._bk_steps += 1
        touched, evicted = set(self._bk_touched), set(self._bk_evicted)
        self._bk_touched.clear()            # (the wrappers hold these very sets)
        self._bk_evicted.clear()
        if self._bk_full or self.full_scan_every <= 1:
            self._bk_scan(counted=False)
            return
        if self._bk_steps % max(self.full_scan_every, len(self.pool.blocks) // SCAN_BLOCKS_PER_STEP) == 0:
            self._bk_scan(counted=True)
            return
        dirty, since = set(evicted), {}
        for rid in touched:
            since[rid] = self._bk_update(rid, dirty)
        ret = retained_counts(self)     # references a step's queued copies hold (mamba.py)
        if self.pool.get_num_free_blocks() + self._bk_nheld + sum(not self._bk_where.get(b) for b in ret) \
                != len(self.pool.blocks) - 1:
            self._bk_scan(counted=True)     # something changed that no step announced
            return
        dirty.discard(self.pool.null_block.block_id)
        try:
            self._check_blocks(sorted(dirty))
            self._check_windows({rid for b in dirty for rid, _, _ in self._bk_where.get(b, ())} | touched,
                                since, dirty)
        except Exception:
            self._bk_full = True            # the index may be stale: rebuild at the next check
            raise

    def _bk_scan(self, counted: bool) -> None:
        """The full scan, then a fresh index. `counted`: a violation it finds was missed by the
        incremental check (counted in coverage)."""
        self._bk_full = True
        try:
            self.check_bookkeeping()
        except Exception:
            if counted:
                self.coverage["state:full_scan_only"] += 1
            raise
        self._bk_held.clear()
        self._bk_where.clear()
        self._bk_nheld = 0
        for rid in {rid for m in self.coord.single_type_managers for rid in m.req_to_blocks}:
            self._bk_update(rid, set())
        self._bk_keys, self._bk_msig = {}, {}
        for key, blk in self._map_entries():
            self._bk_keys.setdefault(blk.block_id, set()).add(key)
        self._bk_full = False

    def _bk_update(self, rid: str, dirty: set[int]) -> int:
        """Re-index request rid's tables. `dirty` gets the blocks the step may have changed:
        those whose holders changed, and those at the positions its computed tokens moved
        over (written, published) since the last check. Returns the computed tokens then."""
        old, old_L = self._bk_held.pop(rid, None) or ([], 0)
        req = self.reqs.get(rid)
        L = req.obj.num_computed_tokens if req is not None else 0
        new = [[b.block_id for b in self._table(g, rid)] for g in range(len(self.groups))]
        null = self.pool.null_block.block_id
        where = self._bk_where
        for g, (_, bs, _) in enumerate(self.groups):
            o = old[g] if g < len(old) else []
            n = new[g]
            for i in range(max(len(o), len(n))):
                a = o[i] if i < len(o) else None
                b = n[i] if i < len(n) else None
                if a == b:
                    continue
                if a is not None and a != null:
                    hs = where[a]
                    hs.discard((rid, g, i))
                    self._bk_nheld -= not hs
                    dirty.add(a)
                if b is not None and b != null:
                    hs = where.setdefault(b, set())
                    self._bk_nheld += not hs
                    hs.add((rid, g, i))
                    dirty.add(b)
            dirty.update(n[old_L // bs: -(-L // bs)])
        if any(new):
            self._bk_held[rid] = (new, L)
        return old_L

    # ---- the parts of the check --------------------------------------------------------------
    def _check_blocks(self, ids: list[int]) -> None:
        """Refcount, free-queue membership, aliasing and the map entries of these blocks (in
        the full scan's order of checks, so both report the same violation first)."""
        pool = self.pool
        blocks = [pool.blocks[i] for i in sorted(ids)]
        where, ret = self._bk_where, retained_counts(self)
        for b in blocks:
            hs = where.get(b.block_id, ())
            if b.ref_cnt != len(hs) + ret.get(b.block_id, 0):
                raise Violation("bookkeeping", "refcount_equals_holders",
                                f"block #{b.block_id}: ref_cnt {b.ref_cnt} but {len(hs)} holder(s) {sorted(hs)}")
            queued = b.prev_free_block is not None or b.next_free_block is not None
            if queued != (b.ref_cnt == 0):
                raise Violation("bookkeeping", "free_queue_iff_unreferenced",
                                f"block #{b.block_id}: ref_cnt {b.ref_cnt}, in free queue: {queued}")
        self._null_inert()
        for b in blocks:
            hs = where.get(b.block_id, ())
            if len(hs) >= 2:
                self._check_alias(b.block_id, sorted(hs))
        cache = pool.cached_block_hash_to_block
        by_block = getattr(pool, "cached_block_hashes_by_block", {})
        msig = self._bk_msig
        for b in blocks:
            old, more = self._bk_keys.get(b.block_id), by_block.get(b.block_id)
            if b.block_hash is None and not old and not more:
                continue                    # no map entry can point here (found from the block)
            now = (b.block_hash, tuple(more or ()), self.written.get(b.block_id))
            if msig.get(b.block_id) == now:
                continue                    # its keys and content as when last found sound
            keys = set(old or ())
            if b.block_hash is not None:
                keys.add(b.block_hash)
            keys.update(more or ())
            live = set()
            for key in _key_order(keys) if len(keys) > 1 else keys:
                held = map_blocks(cache, key)
                if any(x is b for x in held):    # (the key's other blocks: checked as theirs)
                    self._check_entry(key, b)
                    live.add(key)
                else:                     # the entry moved to another block (vLLM's move_block_hashes)
                    for other in held:
                        self._check_entry(key, other)
            self._bk_keys[b.block_id] = live
            msig[b.block_id] = now

    def _check_windows(self, rids: set[str], since: dict[str, int] | None = None,
                       dirty: set[int] = frozenset()) -> None:
        """The blocks each running request's next token reads hold its prefix. With `since`
        (rid -> computed tokens at the last check), only what may have changed: a touched
        request's blocks from there on, and any request's blocks in `dirty`."""
        for rid in sorted(rids):
            req = self.reqs.get(rid)
            if req is None or req.state != "running":
                continue
            # (async scheduling counts the in-flight frame's drafts, placeholders for tokens no one
            # knows yet: the blocks promise the known tokens)
            L = min(req.obj.num_computed_tokens, req.obj.num_tokens)
            for g, (kind, bs, _) in enumerate(self.groups):
                table = self._table(g, req.rid)
                start = 0 if since is None else since[rid] // bs if rid in since else L
                # (a Mamba state: where the worker keeps it, drafts counted: mamba_worker.py)
                for i in self.needed_running(g, L) if kind != MAMBA or not L else \
                        [prev_index(self.timeline, rid, L, bs)]:
                    b = table[i] if i < len(table) else None
                    if i < start and b is not None and b.block_id not in dirty:
                        continue
                    # (the block holds the prefix its next token reads: a request cut back by a failed
                    # connector load keeps the longer promise of its first allocation)
                    w, want = (None, None) if b is None else (self.written.get(b.block_id),
                                                              self._content(req, min((i + 1) * bs, L)))
                    if b is None or b.is_null or (w != want if kind == MAMBA else not holds(w, want, False)):
                        raise Violation("bookkeeping", "toctou_bound_stable",
                                        f"running {req.rid} at {L} tokens: group {g} ({kind}) block {i} that "
                                        "its next token reads is missing or overwritten" + self._freed_early(req, g, b))

    def _freed_early(self, req: Any, g: int, b: Any) -> str:
        """Why a running request's block is gone, where the state says: vLLM's count of its computed
        tokens runs ahead of the tokens known (async scheduling's in-flight frame, drafts included)
        and the block is out of the window by that count, in it by the known tokens."""
        o = req.obj
        kind = self.groups[g][0]
        if b is None or not b.is_null or kind not in WINDOWED or o.num_computed_tokens <= o.num_tokens:
            return ""
        return (f" (vLLM freed it as out of its {WINDOWED[kind]} at a schedule that counted the in-flight frame's "
                f"tokens as computed: {o.num_computed_tokens} computed, {o.num_tokens} known"
                + ("; its drafts may be rejected)" if self.drafter else ")"))

    def _check_alias(self, bid: int, hs: list[tuple[str, int, int]]) -> None:
        for rid, g, i in hs:
            req = self.reqs.get(rid)
            bs = self.groups[g][1]
            # (its extent: what vLLM computed, or promised at allocation -- a connector load in flight
            # on 0.14-0.2x, which count no computed token until it ends; a request a failed load cut back)
            if req is None or (i + 1) * bs > max(req.obj.num_computed_tokens, req.stamped) \
                    or self.written.get(bid) != self._content(req, (i + 1) * bs):
                raise Violation("bookkeeping", "no_alias",
                                f"block #{bid} is in several tables {hs} but is not a complete "
                                f"block with identical content for {rid}")

    def _check_entry(self, key: Any, b: Any) -> None:
        """One prefix-cache map entry: its block carries the key and holds the hash's prefix."""
        pool = self.pool
        if b.is_null or not (b.block_hash == key or key in getattr(pool, "cached_block_hashes_by_block", {}).get(b.block_id, ())):
            raise Violation("bookkeeping", "hash_map_sound",
                            f"prefix-cache map entry points at block #{b.block_id} that does not carry it")
        w = self.written.get(b.block_id)
        done = self._bk_ok.get(key)
        if done is not None and done[0] is b and done[1] is w:
            return                          # this very content was found sound for this key
        ku = vllm_modules()["ku"]
        want = self.hash_content.get(bytes(ku.get_block_hash(key)))
        kind, bs, _ = self.groups[ku.get_group_id(key)]
        # The block must hold the hash's prefix, and the hash must end inside the block
        # (vLLM also registers interior hash-block boundaries of a larger block); a Mamba state
        # block holds the state after exactly the key's tokens.
        if want is not None and (w is None or (w != want if kind == MAMBA else not (
                w[0] == want[0] and len(w[1]) >= len(want[1]) > ((len(w[1]) - 1) // bs) * bs
                and w[1][:len(want[1])] == want[1]))):
            raise Violation("bookkeeping", "hash_map_sound",
                            f"a published hash maps to block #{b.block_id}, which now holds "
                            + ("nothing written" if w is None else "other content (stale prefix-cache entry)"))
        if want is not None and w is not None:
            self._bk_ok[key] = (b, w)

    def _map_entries(self) -> list[tuple[Any, Any]]:
        return map_entries(self.pool.cached_block_hash_to_block)

    def _null_inert(self) -> None:
        pool, null = self.pool, self.pool.null_block
        if null.prev_free_block is not None or null.next_free_block is not None or null.block_hash is not None \
                or null.block_id in getattr(pool, "cached_block_hashes_by_block", {}):
            raise Violation("bookkeeping", "null_block_inert", "the null block is queued or hashed")

    # ---- the full scan -----------------------------------------------------------------------
    def check_bookkeeping(self) -> None:
        """Every block, the free queue, the whole map and every running request's window."""
        pool = self.pool
        null = pool.null_block
        holders: Counter = Counter(retained_counts(self))   # a step's queued copies hold their endpoints
        where: dict[int, list[tuple[str, int, int]]] = {}
        for g, mgr in enumerate(self.coord.single_type_managers):
            for rid, lst in mgr.req_to_blocks.items():
                for i, b in enumerate(lst):
                    if b.is_null:
                        continue
                    holders[b.block_id] += 1
                    where.setdefault(b.block_id, []).append((rid, g, i))
        free = pool.free_block_queue.get_all_free_blocks()
        free_ids = [b.block_id for b in free]
        if len(free_ids) != pool.get_num_free_blocks():
            raise Violation("bookkeeping", "free_count",
                            f"free queue holds {len(free_ids)} blocks, num_free_blocks says "
                            f"{pool.get_num_free_blocks()}")
        fset = set(free_ids)
        if len(fset) != len(free_ids):
            raise Violation("bookkeeping", "free_queue_iff_unreferenced", "a block is queued twice")
        for b in pool.blocks:
            if b.is_null:
                continue
            if b.ref_cnt != holders[b.block_id]:
                raise Violation("bookkeeping", "refcount_equals_holders",
                                f"block #{b.block_id}: ref_cnt {b.ref_cnt} but {holders[b.block_id]} "
                                f"holder(s) {sorted(where.get(b.block_id, []))}")
            if (b.block_id in fset) != (b.ref_cnt == 0):
                raise Violation("bookkeeping", "free_queue_iff_unreferenced",
                                f"block #{b.block_id}: ref_cnt {b.ref_cnt}, in free queue: {b.block_id in fset}")
        if null.block_id in fset or null.block_hash is not None \
                or null.block_id in getattr(pool, "cached_block_hashes_by_block", {}):
            raise Violation("bookkeeping", "null_block_inert", "the null block is queued or hashed")
        for bid, hs in where.items():
            if len(hs) >= 2:
                self._check_alias(bid, sorted(hs))
        by_block: dict[int, list] = {}
        for key, b in self._map_entries():
            by_block.setdefault(b.block_id, []).append((key, b))
        for bid in sorted(by_block):            # the incremental check's order
            ents = dict(by_block[bid])
            for key in _key_order(ents):
                self._check_entry(key, ents[key])
        self._check_windows(set(self.reqs))


def _key_order(keys: Any) -> list:
    """Map keys in one order whatever the hash seed (group, then hash bytes)."""
    ku = vllm_modules()["ku"]
    return sorted(keys, key=lambda k: (ku.get_group_id(k), bytes(ku.get_block_hash(k))))
