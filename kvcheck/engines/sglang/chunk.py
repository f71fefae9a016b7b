"""SGLang's ChunkCache (the cache of a server with prefix caching off: chunked prefill without a
radix tree) as a system under test, 0.4.10-0.5.15 (0.5.23 has none).

It keeps nothing between requests: `match_prefix` answers every lookup with no prefix, the lock
calls are no-ops, `evict` frees nothing, `cache_unfinished_req` hands a chunked request its own
KV back as `prefix_indices`, and `cache_finished_req` frees a finished request's committed KV (and
on 0.4.10-0.5.7 its req_to_token row; 0.5.12's `release_kv_cache` frees the row after it). The
adapter plays the scheduler on real pools (a `ReqToTokenPool` and a `TokenToKVPoolAllocator` on
CPU). Admission (`match`, or a request's first `chunk`) is here: match_prefix, a row, the lock
calls, the KV of the prompt or of its first chunk. Everything after it is the scheduler path that
every class shares (sched.py), with ChunkCache's hooks: each later `chunk(r, n)` (other
requests may act in between, as in SGLang's scheduler) computes n more tokens, then SGLang's
`cache_unfinished_req` publishes the chunk (it hands the request's own KV back as prefix_indices;
0.4.10-0.5.7's scheduler then frees the row and writes them into a new one for the next chunk,
0.5.12 keeps the row); decode appends a token to the row; finish and abort are SGLang's
`release_kv_cache` where the release has it (0.5.7+), else `cache_finished_req` as 0.4.10's
scheduler calls it. The request is SGLang's own `Req` where it imports on CPU (0.5.7+); 0.4.10's
does not (its chain needs a torch API 2.13 dropped), so there the scheduler path's `FlatReq` (the
fields the flat-API caches read) stands in.

Checks after every step: `disabled_cache_no_hit` (a match reports no reusable prefix),
`request_kv_intact` (every running request's slots are allocated, hold its prefix, its
req_to_token row and, after `cache_unfinished_req`, its `prefix_indices` name them), `kv_freed_once`
(no slot freed while free), `no_evict_locked` (evict freed nothing: all KV belongs to running
requests), `lock_ref_equals_holders` (the lock calls change nothing: delta 0, protected size 0) and
`size_accounting` (running requests' slots + free = capacity, disjoint; rows likewise).
"""
from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

from .adapter import SglangAdapter
from .checks import Req, Violation
from .compat import (alloc_row, free_row, has_params, kw, method_reads, new_allocator, sglang_req)
from .install import cache_class, load
from .layouts import MAX_TOKENS
from .mamba_state import set_server_args_stand_in
from .sched_req import ROWS, FlatReq, Sched, req_set

CHUNK_TOKENS = 12      # CacheInitParams.chunked_prefill_size: the largest chunk the generator draws


def _delta(res: Any) -> int:
    """A lock call's reported change: an int (0.4.10-0.5.7) or a result's `delta` (0.5.12)."""
    return int(res) if isinstance(res, int) else int(getattr(res, "delta", 0) or 0)


class ChunkAdapter(SglangAdapter):
    """SglangAdapter for ChunkCache: no tree, the requests own every KV slot."""

    row_check = "request_kv_intact"     # a chunk's row reading a freed or overwritten slot

    def reset(self, cfg: Any = None) -> None:
        import torch
        S = load()
        self.S, self.torch = S, torch
        set_server_args_stand_in()                # SGLang's Req and release_kv_cache read them
        self.alloc = new_allocator(S["allocator"].TokenToKVPoolAllocator, self.capacity, torch.int64, "cpu", None)
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        self.rtp = ReqToTokenPool(**kw(ReqToTokenPool.__init__, size=ROWS, max_context_len=MAX_TOKENS + 8,
                                       device="cpu", enable_memory_saver=False))
        self.rows_all = set(self.rtp.free_slots)
        cls = cache_class("ChunkCache")
        if "params" in inspect.signature(cls.__init__).parameters:
            P = S["CacheInitParams"]
            self.cache = cls(P(**kw(P, disable=True, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc,
                                    page_size=1, chunked_prefill_size=CHUNK_TOKENS)))
        else:
            self.cache = cls(**kw(cls.__init__, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc,
                                  page_size=1))
        self.params_api = hasattr(S["bpc"], "MatchPrefixParams")
        try:
            from sglang.srt.mem_cache.common import release_kv_cache
            self.release_kv_cache: Any = release_kv_cache
        except ImportError:                        # 0.4.10: the scheduler calls cache_finished_req
            self.release_kv_cache = None
        self.req_cls = sglang_req()
        self.reqs: dict[str, Req] = {}
        self.written: dict[int, tuple[int, ...]] = {}
        self.twin: set[tuple[int, ...]] = set()
        self.coverage: Counter = Counter()
        self.lost: list[Violation] = []
        self.hits = self.next_id = self._inserts = self._leaked = 0
        self.broken: Violation | None = None
        self.double: list[str] = []               # double frees seen by the free observer
        self.last_admitted: list[int] = []
        self.coverage["state:sglang_req" if self.req_cls else "state:req_stand_in"] += 1
        self._sched_state()                       # every admitted request is on the scheduler path
        self._observe_frees()
        self._plant()

    def _observe_frees(self) -> None:
        """The instrument of `kv_freed_once`: every slot the allocator is handed back must be in use."""
        real = self.alloc.free

        def free(idx: Any) -> Any:
            slots = [int(x) for x in idx.reshape(-1).tolist()] if hasattr(idx, "reshape") else list(idx)
            now = set(self.free_slots())
            dup = [s for s in slots if s in now] + [s for s, n in Counter(slots).items() if n > 1]
            if dup:
                self.double.append(f"slot {dup[0]} handed back to the allocator while already free")
            return real(idx)
        self.alloc.free = free

    # ---- SGLang's request ------------------------------------------------------------------
    def _new_req(self, r: str, tokens: list[int]) -> Any:
        if self.req_cls is None:                  # KVCHECK_CPU_STUB: 0.4.10's Req does not import on CPU
            return FlatReq(r, list(tokens))
        Req_, SamplingParams = self.req_cls
        return Req_(r, "", list(tokens), SamplingParams())

    # ---- actions: admission here; chunks, decode and release on the scheduler path --------
    def _a_match(self, r: str) -> dict:
        """match_prefix (no hit, no node), a row, `inc_lock_ref`, the KV of the whole prompt or (the
        `chunk` action) of its first chunk. Every admitted request is a scheduler-path request
        (sched.py): its later chunks, decode and release are the scheduler's, on SGLang's calls."""
        req = self._get(r, "waiting")
        toks = req.tokens
        key = self._key(toks[:-1])
        m = (self.cache.match_prefix(self.S["bpc"].MatchPrefixParams(key=key)) if self.params_api
             else self.cache.match_prefix(key=key))
        hit = len(m.device_indices)
        if hit or m.last_device_node is not None:
            raise Violation("safety", "disabled_cache_no_hit", f"{r}: ChunkCache (prefix caching off) matched {hit} "
                            f"tokens (slots {[int(x) for x in m.device_indices.tolist()][:8]}): it keeps no KV "
                            "between requests, so these slots are not this prompt's")
        sched, sreq = self._sched_state(), self._new_req(r, toks)
        row = alloc_row(self.rtp, sreq)
        if row is None:
            self.coverage["state:admission_refused"] += 1
            return {"hit": 0, "admitted": False}
        req_set(sreq, req_pool_idx=row)
        self._lock_call("inc_lock_ref", m.last_device_node)
        need = self._need(req, 0)                  # the whole prompt, or its first chunk
        slots = self._alloc(need)
        if slots is None:
            free_row(self.rtp, sreq, row)
            self._lock_call("dec_lock_ref", m.last_device_node)
            self.coverage["state:admission_refused"] += 1
            return {"hit": 0, "admitted": False}
        req.node, req.hit, req.state, req.slots, req.spare, req.floor = None, 0, "running", slots, [], len(toks)
        for p in range(need):
            self._write(req, p, slots[p])
        sched[r] = Sched(sreq, row, len(toks), need)
        self._row_write(sched[r], 0, slots)
        self._set_len(sched[r], need)
        self.last_admitted = slots
        self.coverage["state:miss"] += 1
        return {"hit": 0, "admitted": True}

    # ---- the scheduler path's hooks (sched.py) --------------------------------------
    def _sched_admit(self, req: Req) -> Sched:
        """SGLang's request and its row exist from the admission (`_a_match`)."""
        self.coverage["state:sched_admitted"] += 1
        return self.sched[req.rid]

    def _sglang_call(self, fn: Any) -> None:
        fn()                                       # no tree: nothing SGLang could evict inside

    def _protected_len(self, q: Any) -> int:
        return 0                                   # the request owns all its KV; the cache protects none

    def _remember(self, req: Req, n: int) -> None:
        """ChunkCache keeps nothing: no twin (lost reuse does not apply)."""

    def _between_chunks(self, r: str, s: Sched) -> None:
        """`cache_unfinished_req` hands the request its own KV back as prefix_indices: exactly the slots
        it computed, none freed; then 0.4.10-0.5.7's scheduler moves it to a new row (`_next_chunk_row`)."""
        held = self.reqs[r].slots[:s.computed]
        got, free = [int(x) for x in s.req.prefix_indices.tolist()], set(self.free_slots())
        if any(x in free for x in held):
            raise Violation("safety", "request_kv_intact", f"{r}: after cache_unfinished_req slot "
                            f"{next(x for x in held if x in free)} of its KV is free while it runs")
        if got != held:
            raise Violation("safety", "request_kv_intact", f"{r}: cache_unfinished_req gave prefix_indices "
                            f"{got[:8]}..., the request's KV is in {held[:8]}...")
        self.coverage["state:chunked"] += 1
        if self.row_per_chunk():
            self._next_chunk_row(s)

    def _release_call(self, r: str, s: Sched, insert: bool) -> bool:
        """The scheduler's release of a finished or aborted request: `release_kv_cache` (0.5.7+:
        cache_finished_req, the overallocated tail, on 0.5.12 the row), else `cache_finished_req`
        as 0.4.10's scheduler calls it (it frees the row itself); then `dec_lock_ref`."""
        if self.release_kv_cache is None:
            insert = super()._release_call(r, s, insert)
        else:
            self._finished_fields(r, s, insert)
            self.release_kv_cache(s.req, self.cache, **kw(self.release_kv_cache, is_insert=insert, checkpoint=insert))
            free_row(self.rtp, s.req, s.row)      # 0.5.7's cache_finished_req and 0.5.12's release freed it
        self._lock_call("dec_lock_ref", None)
        return insert

    def _lock_call(self, name: str, node: Any) -> None:
        d = _delta(getattr(self.cache, name)(node))
        if d:
            raise Violation("bookkeeping", "lock_ref_equals_holders", f"ChunkCache.{name} reported delta {d}: it "
                            "keeps no references (every KV slot is its request's)")

    def _evict(self, n: int, swa: int | None = None) -> int:
        """ChunkCache.evict must free nothing: every KV slot belongs to a running request."""
        before = set(self.free_slots())
        if has_params("EvictParams"):
            self.cache.evict(self.S["bpc"].EvictParams(num_tokens=n))
        else:
            self.cache.evict(n)
        freed = set(self.free_slots()) - before
        if freed:
            raise Violation("bookkeeping", "no_evict_locked", f"evict({n}) freed {len(freed)} slots "
                            f"(e.g. {min(freed)}) that running requests hold: ChunkCache keeps none of its own")
        return 0

    # ---- checks ---------------------------------------------------------------------------
    def check_all(self) -> None:
        if self.double:
            raise Violation("bookkeeping", "kv_freed_once", self.double[0])
        free = set(self.free_slots())
        rows = self.rtp.req_to_token
        for r, req in self.reqs.items():
            if req.state != "running":
                continue
            row = [int(x) for x in rows[self.sched[r].row, :len(req.slots)].tolist()]
            for p, s in enumerate(req.slots):
                if s in free or self.written.get(s) != tuple(req.tokens[:p + 1]) or row[p] != s:
                    raise Violation("safety", "request_kv_intact", f"{r} holds position {p} in slot {s}, which is "
                                    f"{'free' if s in free else 'overwritten'} (its row names slot {row[p]})")
        # 0.5.3-0.5.4's ChunkCache counts the KV its chunked requests published as protected
        # (protected_size_: + at cache_unfinished_req, - at cache_finished_req); others count none
        held = (sum(len(s.req.prefix_indices) for s in self.sched.values() if s.req.prefix_indices is not None)
                if method_reads(self.cache, "cache_unfinished_req", "protected_size_") else 0)
        if self.cache.protected_size() != held:
            raise Violation("bookkeeping", "lock_ref_equals_holders", "ChunkCache reports "
                            f"{self.cache.protected_size()} protected tokens; its requests' published KV is {held}")
        if self.cache.evictable_size() != 0:
            raise Violation("bookkeeping", "size_accounting", f"ChunkCache reports {self.cache.evictable_size()} "
                            "evictable tokens; it keeps none")
        run = [r for r, q in self.reqs.items() if q.state == "running"]
        rows_held = [self.sched[r].row for r in run]
        for name, owned, pool_free, every in (
                ("KV", [s for r in run for s in self.reqs[r].slots], self.free_slots(), self.all_slots()),
                ("req_to_token rows", rows_held, list(self.rtp.free_slots), self.rows_all)):
            seen = list(owned) + list(pool_free)
            if len(seen) != len(set(seen)) or set(seen) != every:
                raise Violation("bookkeeping", "size_accounting", f"{name}: {len(owned)} held by running requests + "
                                f"{len(pool_free)} free of {len(every)}: {len(seen) - len(set(seen))} counted twice, "
                                f"{len(every - set(seen))} leaked")
        if self.alloc.available_size() != len(free):
            raise Violation("bookkeeping", "size_accounting", f"available_size {self.alloc.available_size()} != "
                            f"{len(free)} free slots")

    # ---- planted faults (thin wrappers on this cache instance) -----------------------------
    def _plant(self) -> None:
        f, c, torch = self.fault, self.cache, self.torch
        if f == "chunk_reports_hit":              # the last admitted request's slots as a hit
            real_match = c.match_prefix

            def match(*a: Any, **k: Any) -> Any:
                m = real_match(*a, **k)
                if not self.last_admitted:
                    return m
                return m._replace(device_indices=torch.tensor(self.last_admitted[:2], dtype=torch.int64),
                                  last_device_node=object())
            c.match_prefix = match
        elif f == "chunk_frees_unfinished":       # frees the KV it hands back as prefix_indices
            real_unfinished = c.cache_unfinished_req

            def unfinished(req: Any, *a: Any, **k: Any) -> Any:
                out = real_unfinished(req, *a, **k)
                self.alloc.free(req.prefix_indices.to(torch.int64).clone())
                return out
            c.cache_unfinished_req = unfinished
        elif f in ("chunk_double_free", "chunk_finish_leaks"):
            real_finished, observed = c.cache_finished_req, self.alloc.free

            def finished(req: Any, *a: Any, **k: Any) -> Any:
                last = self.sreq_slots(req)[-1:]
                if f == "chunk_finish_leaks":     # all but the last committed slot go back
                    self.alloc.free = lambda idx: observed(idx[:-1])
                try:
                    out = real_finished(req, *a, **k)
                finally:
                    self.alloc.free = observed
                if f == "chunk_double_free" and last:
                    self.alloc.free(torch.tensor(last, dtype=torch.int64))
                return out
            c.cache_finished_req = finished
        elif f == "lock_ref_leak":                # a released lock keeps its tokens protected
            real_dec = c.dec_lock_ref

            def dec(*a: Any, **k: Any) -> Any:
                out = real_dec(*a, **k)
                self._leaked += 1
                c.protected_size = lambda: self._leaked
                return out
            c.dec_lock_ref = dec
        elif f == "evict_locked":                 # evict frees a running request's first slot
            real_evict = c.evict

            def evict(*a: Any, **k: Any) -> Any:
                out = real_evict(*a, **k)
                run = [q for q in self.reqs.values() if q.state == "running"]
                if run:
                    self.alloc.free(torch.tensor(run[0].slots[:1], dtype=torch.int64))
                return out
            c.evict = evict

    def sreq_slots(self, sreq: Any) -> list[int]:
        """The slots a running request's Req holds (by its rid)."""
        q = self.reqs.get(sreq.rid)
        return list(q.slots) if q is not None else []
