"""SGLang's ChunkCache (the cache of a server with prefix caching off: chunked prefill without a
radix tree) as a system under test, 0.4.10-0.5.15 (0.5.23 has none).

It keeps nothing between requests: `match_prefix` answers every lookup with no prefix, the lock
calls are no-ops, `evict` frees nothing, `cache_unfinished_req` hands a chunked request its own
KV back as `prefix_indices`, and `cache_finished_req` frees a finished request's committed KV (and
on 0.4.10-0.5.7 its req_to_token row; 0.5.12's `release_kv_cache` frees the row after it). The
adapter plays the scheduler on real pools (a `ReqToTokenPool` and a `TokenToKVPoolAllocator` on
CPU): a request is admitted with a row and its prompt's slots, prefilled in chunks of
`CHUNK_TOKENS` with `cache_unfinished_req` after each but the last (0.4.10-0.5.7 then free the
row and give the next chunk a new one, writing `prefix_indices` back into it; 0.5.12 keeps the
row), decoded a token at a time, and released through `release_kv_cache` where the release has
it (0.5.7+), else `cache_finished_req` as 0.4.10's scheduler calls it. The request is SGLang's
own `Req` where it imports on CPU (0.5.7+); 0.4.10's does not (its chain needs a torch API 2.13
dropped), so there a stand-in carries the fields ChunkCache reads.

Checks after every step: `disabled_cache_no_hit` (a match reports no reusable prefix),
`request_kv_intact` (every running request's slots are allocated, hold its prefix, its
req_to_token row and `prefix_indices` name them), `kv_freed_once` (no slot freed while free),
`no_evict_locked` (evict freed nothing: all KV belongs to running requests),
`lock_ref_equals_holders` (the lock calls change nothing: delta 0, protected size 0) and
`size_accounting` (running requests' slots + free = capacity, disjoint; rows likewise).
"""
from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

from kvcheck.spec.sut import ActionRejected

from .sglang_adapter import SglangAdapter
from .sglang_checks import Req, Violation
from .sglang_compat import kw, new_allocator
from .sglang_install import cache_class, load
from .sglang_layouts import MAX_TOKENS
from .sglang_mamba_state import set_server_args_stand_in

CHUNK_TOKENS = 8       # the chunked prefill size: prompts up to MAX_TOKENS run in up to 5 chunks
ROWS = 8               # req_to_token rows (the generator keeps at most 4 requests)


class ChunkReqStandIn:
    """KVCHECK_CPU_STUB: the scheduler's Req as 0.4.10's ChunkCache reads it (SGLang's own Req does
    not import there on CPU)."""

    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.rid, self.origin_input_ids, self.output_ids = rid, list(tokens), []
        self.fill_ids: list[int] = []
        self.req_pool_idx: Any = None
        self.prefix_indices: Any = None


def _delta(res: Any) -> int:
    """A lock call's reported change: an int (0.4.10-0.5.7) or a result's `delta` (0.5.12)."""
    return int(res) if isinstance(res, int) else int(getattr(res, "delta", 0) or 0)


class ChunkAdapter(SglangAdapter):
    """SglangAdapter for ChunkCache: no tree, the requests own every KV slot."""

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
        self.rows_by_req = "reqs" in inspect.signature(self.rtp.alloc).parameters   # 0.5.12: rows kept per Req
        try:
            from sglang.srt.mem_cache.common import release_kv_cache
            self.release_kv_cache: Any = release_kv_cache
        except ImportError:                        # 0.4.10: the scheduler calls cache_finished_req
            self.release_kv_cache = None
        self.req_cls = _sglang_req()
        self.reqs: dict[str, Req] = {}
        self.sreq: dict[str, Any] = {}            # running request -> the Req SGLang's cache sees
        self.written: dict[int, tuple[int, ...]] = {}
        self.twin: set[tuple[int, ...]] = set()
        self.coverage: Counter = Counter()
        self.lost: list[Violation] = []
        self.hits = self.next_id = self._inserts = self._leaked = 0
        self.broken: Violation | None = None
        self.double: list[str] = []               # double frees seen by the free observer
        self.last_admitted: list[int] = []
        self.coverage["state:sglang_req" if self.req_cls else "state:req_stand_in"] += 1
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

    # ---- SGLang's request and the row pool ------------------------------------------------
    def _new_req(self, r: str, tokens: list[int]) -> Any:
        if self.req_cls is None:
            return ChunkReqStandIn(r, tokens)
        Req_, SamplingParams = self.req_cls
        return Req_(r, "", list(tokens), SamplingParams())

    def _alloc_row(self, sreq: Any) -> int | None:
        if self.rows_by_req:
            out = self.rtp.alloc([sreq])
            return None if out is None else sreq.req_pool_idx
        out = self.rtp.alloc(1)
        if out is None:
            return None
        sreq.req_pool_idx = out[0]
        return out[0]

    def _free_row(self, sreq: Any) -> None:
        if self.rows_by_req:
            self.rtp.free(sreq)
        else:
            self.rtp.free(sreq.req_pool_idx)
            sreq.req_pool_idx = None

    def _write_row(self, sreq: Any, lo: int, vals: Any) -> None:
        t = vals if hasattr(vals, "dtype") else self.torch.tensor(vals, dtype=self.torch.int32)
        self.rtp.write((sreq.req_pool_idx, slice(lo, lo + len(t))), t.to(self.rtp.req_to_token.dtype))

    # ---- actions -------------------------------------------------------------------------
    def _a_match(self, r: str) -> dict:
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
        sreq = self._new_req(r, toks)
        if self._alloc_row(sreq) is None:
            self.coverage["state:admission_refused"] += 1
            return {"hit": 0, "admitted": False}
        self._lock_call("inc_lock_ref", m.last_device_node)
        slots = self._alloc(len(toks))
        if slots is None:
            self._free_row(sreq)
            self._lock_call("dec_lock_ref", m.last_device_node)
            self.coverage["state:admission_refused"] += 1
            return {"hit": 0, "admitted": False}
        req.node, req.hit, req.state, req.slots, req.spare, req.floor = None, 0, "running", slots, [], len(toks)
        self.sreq[r] = sreq
        pre = 0
        for end in range(CHUNK_TOKENS, len(toks) + CHUNK_TOKENS, CHUNK_TOKENS):
            end = min(end, len(toks))
            self._write_row(sreq, pre, slots[pre:end])
            for p in range(pre, end):
                self._write(req, p, slots[p])
            sreq.fill_ids = toks[:end]
            sreq.kv_committed_len = sreq.kv_allocated_len = end
            if end < len(toks):
                self._chunked(r, sreq, slots[:end])
            pre = end
        sreq.output_ids = [0]                     # the first sampled token (its KV is the next decode's)
        self.last_admitted = slots
        self.coverage["state:miss"] += 1
        return {"hit": 0, "admitted": True}

    def _chunked(self, r: str, sreq: Any, held: list[int]) -> None:
        """A chunk ends: cache_unfinished_req hands the request its KV back as prefix_indices; the
        scheduler of 0.4.10-0.5.7 then frees the row and the next chunk writes them into a new one."""
        self.cache.cache_unfinished_req(sreq, **kw(self.cache.cache_unfinished_req, chunked=True))
        got, free = [int(x) for x in sreq.prefix_indices.tolist()], set(self.free_slots())
        if any(s in free for s in held):
            raise Violation("safety", "request_kv_intact", f"{r}: after cache_unfinished_req slot "
                            f"{next(s for s in held if s in free)} of its KV is free while it runs")
        if got != held:
            raise Violation("safety", "request_kv_intact", f"{r}: cache_unfinished_req gave prefix_indices "
                            f"{got[:8]}..., the request's KV is in {held[:8]}...")
        self.coverage["state:chunked"] += 1
        if not self.rows_by_req:
            self._free_row(sreq)
            if self._alloc_row(sreq) is None:
                raise Violation("bookkeeping", "size_accounting", f"{r}: no req_to_token row for the next chunk "
                                "right after its own was freed")
            self._write_row(sreq, 0, sreq.prefix_indices)

    def _lock_call(self, name: str, node: Any) -> None:
        d = _delta(getattr(self.cache, name)(node))
        if d:
            raise Violation("bookkeeping", "lock_ref_equals_holders", f"ChunkCache.{name} reported delta {d}: it "
                            "keeps no references (every KV slot is its request's)")

    def _a_decode(self, r: str, tok: int) -> dict:
        req = self._get(r, "running")
        if len(req.tokens) >= MAX_TOKENS:
            raise ActionRejected(f"request {r} is at {MAX_TOKENS} tokens")
        new = self._alloc(1)
        if new is None:
            self.coverage["state:decode_refused"] += 1
            return {"allocated": False}
        sreq = self.sreq[r]
        self._write_row(sreq, len(req.tokens), new)
        req.tokens.append(tok)
        req.slots.append(new[0])
        self._write(req, len(req.tokens) - 1, new[0])
        sreq.output_ids = req.tokens[req.floor:] + [0]
        sreq.kv_committed_len = sreq.kv_allocated_len = len(req.tokens)
        return {"allocated": True}

    def _a_finish(self, r: str) -> dict:
        req = self._get(r, "running")
        self._release(req)
        del self.reqs[r]
        return {"freed": len(req.slots)}

    def _a_abort(self, r: str) -> dict:
        req = self._get(r)
        if req.state == "running":
            self._release(req)
        del self.reqs[r]
        return {}

    def _release(self, req: Req) -> None:
        """The scheduler's release of a finished or aborted request: release_kv_cache (0.5.7+:
        cache_finished_req, then the overallocated tail and the row) or cache_finished_req (0.4.10)."""
        sreq = self.sreq.pop(req.rid)
        if self.release_kv_cache is not None:
            self.release_kv_cache(sreq, self.cache)
        else:
            self.cache.cache_finished_req(sreq)
        self._lock_call("dec_lock_ref", None)

    def _evict(self, n: int, swa: int | None = None) -> int:
        """ChunkCache.evict must free nothing: every KV slot belongs to a running request."""
        before = set(self.free_slots())
        if self.params_api:
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
            row = [int(x) for x in rows[self.sreq[r].req_pool_idx, :len(req.slots)].tolist()]
            for p, s in enumerate(req.slots):
                if s in free or self.written.get(s) != tuple(req.tokens[:p + 1]) or row[p] != s:
                    raise Violation("safety", "request_kv_intact", f"{r} holds position {p} in slot {s}, which is "
                                    f"{'free' if s in free else 'overwritten'} (its row names slot {row[p]})")
        if self.cache.protected_size() != 0:
            raise Violation("bookkeeping", "lock_ref_equals_holders", "ChunkCache reports "
                            f"{self.cache.protected_size()} protected tokens; it holds no references")
        if self.cache.evictable_size() != 0:
            raise Violation("bookkeeping", "size_accounting", f"ChunkCache reports {self.cache.evictable_size()} "
                            "evictable tokens; it keeps none")
        run = [r for r, q in self.reqs.items() if q.state == "running"]
        rows_held = [self.sreq[r].req_pool_idx for r in run]
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


def _sglang_req() -> tuple[Any, Any] | None:
    """SGLang's Req and SamplingParams where they import on CPU (0.5.7+), else None."""
    try:
        from sglang.srt.managers.schedule_batch import Req as Req_
        from sglang.srt.sampling.sampling_params import SamplingParams
    except Exception:        # 0.4.10: its import chain needs torch._C._cpu._is_amx_tile_supported
        return None
    return Req_, SamplingParams
