"""SGLang's scheduler paths around the tree: chunked prefill, and a request cached and released
by SGLang's own methods.

`chunk(r, n)` prefills the next n tokens of a request's prompt. The first chunk is the class's
own admission (match, lock, allocation) limited to n tokens; every later one allocates its n
slots (evicting when short, as the scheduler does) and writes them into the request's row of a
real `ReqToTokenPool`. After each chunk that leaves the prompt unfinished, SGLang's own code
publishes it, as the scheduler calls it before it schedules anything else: `cache_unfinished_req`
(0.4.10-0.5.12, on the request's flat fields) or `checkpoint_kv_cache` (0.5.23, on its `kv`
record), which inserts the computed prefix, re-matches it, rewrites the row to the tree's slots,
frees the duplicates and moves the request's lock to the new last node. A request admitted this
way is finished and aborted by SGLang's own `cache_finished_req` / `release_kv_cache` too.

The request SGLang sees is its own `Req` where the release keeps a `kv` record (0.5.23: its
release path reads dozens of fields), else `FlatReq` below: exactly the fields the flat-API
caches read, set as the scheduler sets them. After every call the adapter reads back what SGLang
changed (last node, lock receipt, row, protected length) and the checks judge it: the row must
read live slots holding its prefix (`hit_sound_full` / `hit_sound_swa_window`: the next chunk
resumes there), the lock references must equal the holders (the lock moved at each chunk), the
pools must account for every slot (a duplicate not freed, or freed twice, shows there).
"""
from __future__ import annotations

from typing import Any

from kvcheck.spec.sut import ActionRejected

from .checks import Req, Violation
from .compat import (alloc_row, free_row, kv_record_api, method_reads, own_req_cls, row_pool, runtime_config, takes,
                     token_seq)
from .layouts import FAULTS, MAX_TOKENS
from .mamba_state import set_server_args_stand_in
from .sched_req import (PENDING, ROWS, FlatReq, Sched, fill_own, frees_committed,  # noqa: F401 (FlatReq)
                        keep_lock, kept_lock, req_get, req_has, req_set)


class SchedMixin:
    """Mixed into SglangAdapter: the `chunk` action and SGLang's own caching of such requests.
    A class adapts it through hooks, each documented where it is defined: `_sched_admit` (SGLang's
    request and row), `_sched_new`, `_lock_receipt`, `_computed` (a chunk's forward), `_sglang_call`
    (what SGLang does inside its call), `_between_chunks` (the scheduler's step after publishing),
    `_protected_len`, `_relocked` (the lock SGLang moved), `_holds`, `row_check`, `_remember` (the
    twin), `_release_call` (SGLang's release) and `_released`."""

    _chunk_limit: int | None = None
    row_check: str | None = None    # the check a bad row after publishing breaks (None: hit_sound_full / _swa_window)

    # ---- state, rebuilt with every cache -------------------------------------------------
    def _sched_state(self) -> dict[str, Sched]:
        if getattr(self, "_sched_for", None) is not self.cache:
            self._sched_for, self.sched = self.cache, {}
            self.kv_api = kv_record_api()
            self.own_req = self.kv_api or own_req_cls() is not None
            if self.kv_api:
                runtime_config()
            elif self.own_req:          # release_kv_cache reads the global server args
                set_server_args_stand_in()
            pool = getattr(self.cache, "req_to_token_pool", None)
            if pool is None or not hasattr(pool, "req_to_token"):
                pool = row_pool(ROWS, MAX_TOKENS + 8)
                self.cache.req_to_token_pool = pool
            self.rows = pool
        return self.sched

    def _need(self, req: Req, hit: int) -> int:
        """How many tokens past the hit an admission computes now: all, or a chunk of whole pages."""
        rest = len(req.tokens) - hit
        if self._chunk_limit is None:
            return rest
        ps = self.lay.page_size
        return min(rest, -(-self._chunk_limit // ps) * ps)

    def _lock_receipt(self, r: str) -> Any:
        """What the scheduler keeps of the admission's lock in its request: the IncLockRefResult
        behind a `TreeLock` (kv records), else nothing for a radix tree without SWA receipts."""
        return getattr(self, "last_receipt", None) if self.kv_api else None

    def _relocked(self, r: str, s: Sched) -> None:
        """After SGLang moved a request's lock: the class's own record of it."""

    def _sched_new(self, r: str, sreq: Any) -> None:
        """SGLang's request for r is built (before its row): a class adds what it carries."""

    def _computed(self, r: str, upto: int) -> None:
        """A chunk's forward ran up to `upto` (a class with per-request state writes it)."""

    # ---- the action ------------------------------------------------------------------------
    def _a_chunk(self, r: str, n: int) -> dict:
        sched = self._sched_state()
        req = self._get(r)
        if n < 1:
            raise ActionRejected("a chunk computes at least one token")
        if req.state == "waiting":
            self._chunk_limit = n
            try:
                out = self._a_match(r)
            finally:
                self._chunk_limit = None
            if not out.get("admitted"):
                return out
            s = self._sched_admit(req)
            if s is None:
                return dict(out, admitted=False)
            sched[r] = s
        else:
            s = sched.get(r)
            if s is None or s.computed >= s.prompt:
                raise ActionRejected(f"request {r} is not mid-prefill on the scheduler path")
            ps = self.lay.page_size
            k = min(s.prompt - s.computed, -(-n // ps) * ps)
            new = self._alloc(-(-k // ps) * ps)
            if new is None:
                self.coverage["state:chunk_refused"] += 1
                return {"computed": s.computed, "allocated": False}
            req.slots += new[:k]
            req.spare = new[k:]
            for p in range(s.computed, s.computed + k):
                self._write(req, p, req.slots[p])
            self._row_write(s, s.computed, new[:k])
            s.computed += k
            self._set_len(s, s.computed)
            self._computed(r, s.computed)
        if s.computed < s.prompt:
            self._publish(r, s)
        else:
            self.coverage["state:prefill_done"] += 1
        return {"computed": s.computed, "hit": req.hit}

    # ---- building SGLang's request --------------------------------------------------------
    def _sched_admit(self, req: Req) -> Sched | None:
        """SGLang's request for an admitted one (its lock, hit, row), as the scheduler has it
        after the match and the first chunk's allocation."""
        prompt = list(req.tokens)
        computed = len(req.slots)
        hit, node, rec = req.hit, req.node, self._lock_receipt(req.rid)
        if self.kv_api:
            from array import array

            from sglang.srt.managers.schedule_batch import Req as SReq
            from sglang.srt.mem_cache.base_prefix_cache import TreeLock
            from sglang.srt.sampling.sampling_params import SamplingParams
            sreq = SReq(req.rid, "", array("q", prompt), SamplingParams(max_new_tokens=MAX_TOKENS))
            sreq.refresh_fill_ids()
            sreq.prefix_len, sreq.last_node = hit, node
            sreq.kv.cache_protected_len = hit
            sreq.lock = TreeLock(node, rec.to_dec_params() if hasattr(rec, "to_dec_params") else rec)
        else:
            sreq = self._own_or_flat_req(req.rid, prompt, computed)
            req_set(sreq, last_node=node, cache_protected_len=hit,
                    prefix_indices=self.torch.tensor(req.slots[:hit], dtype=self.torch.int64))
            for k, v in (("last_matched_prefix_len", hit), ("is_chunked", 1)):
                if req_has(sreq, k):     # what this release's Req has of them (FlatReq: all)
                    req_set(sreq, **{k: v})
            keep_lock(sreq, rec)
        self._sched_new(req.rid, sreq)
        row = alloc_row(self.rows, sreq)
        if row is None:         # no row: as a refused admission (cannot happen with ROWS > requests)
            raise Violation("bookkeeping", "sglang_internal_error", "the ReqToTokenPool has no free row")
        if not self.kv_api:
            req_set(sreq, req_pool_idx=row)
        s = Sched(sreq, row, len(prompt), computed)
        self._row_write(s, 0, req.slots[:computed])
        self._set_len(s, computed)
        self.coverage["state:sched_admitted"] += 1
        return s

    def _own_or_flat_req(self, rid: str, prompt: list[int], computed: int) -> Any:
        """SGLang's own Req where it keeps a KV record (0.5.16-0.5.21, before 0.5.22's API), as the
        tokenizer manager builds it (real SamplingParams); else the flat stand-in (0.4.10-0.5.15)."""
        if not self.own_req:
            return FlatReq(rid, self._seq(prompt), fill_ids=self._seq(prompt[:computed]))
        req_cls, sampling = own_req_cls()
        return req_cls(rid, "", self._seq(prompt), sampling(max_new_tokens=MAX_TOKENS))

    def _seq(self, tokens: list[int]) -> Any:
        return token_seq(tokens, self.params_api)

    def _row_write(self, s: Sched, lo: int, slots: list[int]) -> None:
        if slots:
            self.rows.write((s.row, slice(lo, lo + len(slots))), self.torch.tensor(slots, dtype=self.torch.int32))

    def _set_len(self, s: Sched, n: int) -> None:
        """The computed length, in the release's fields: what is committed and allocated, and
        (flat API) what this round filled."""
        q = s.req
        if self.kv_api:
            q.kv.kv_committed_len = q.kv.kv_allocated_len = n
            q.extend_end = n
        elif isinstance(q, FlatReq):
            q.kv_committed_len = q.kv_allocated_len = n
            q.fill_ids = self._seq(self.reqs[q.rid].tokens[:n])
        else:                   # SGLang's own Req (ChunkCache 0.5.2+; every class 0.5.16-0.5.21)
            fill_own(q, self._seq(self.reqs[q.rid].tokens), n)

    # ---- SGLang's own publishing and release ----------------------------------------------
    def _publish(self, r: str, s: Sched) -> None:
        """The scheduler's call after a chunk: insert what is computed, move the lock."""
        q, c = s.req, self.cache
        old = q.last_node
        if self.kv_api:
            from sglang.srt.mem_cache import common
            self._sglang_call(lambda: common.checkpoint_kv_cache(q, c))
        elif takes(c.cache_unfinished_req, "chunked"):
            self._sglang_call(lambda: c.cache_unfinished_req(q, chunked=True))
        else:
            self._sglang_call(lambda: c.cache_unfinished_req(q))
        if self.planted(FAULTS["unfinished_lock_not_moved"]):
            self._lock_stays(s, old)
        self._between_chunks(r, s)
        self._read_back(r, s)
        self._remember(self.reqs[r], s.computed)
        self.coverage["state:chunk_cached"] += 1
        self.coverage["state:lock_moved"] += q.last_node is not old

    def _sglang_call(self, fn: Any) -> None:
        """Run one of SGLang's scheduler-side calls; what it evicted on its own (a state fork
        short of slots evicts) leaves the no-eviction twin, and must not have been locked."""
        if getattr(self, "core", "python") == "rust":
            fn()
            return
        states = getattr(self, "state_prefixes", None)
        before, s_before = self.tree_prefixes(), set(states()) if states else set()
        locked = self._locked_prefixes()
        fn()
        gone = before - self.tree_prefixes()
        self.twin -= gone | (s_before - set(states()) if states else set())
        if gone & locked:
            raise Violation("bookkeeping", "no_evict_locked", "SGLang's own eviction inside a scheduler call "
                            f"removed a locked node ({len(max(gone & locked, key=len))} tokens deep)")

    def _lock_stays(self, s: Sched, old: Any) -> None:
        """PLANTED FAULT unfinished_lock_not_moved: after the re-insert the lock stays on the old
        node and the new last node is left unlocked (SGLang's request still names the new one)."""
        q, c = s.req, self.cache
        if q.last_node is old:
            return
        if self.kv_api:
            c.unlock(q.lock)
            c.lock(old)
            return
        c.inc_lock_ref(old)
        rec, params = kept_lock(q), getattr(self.S["bpc"], "DecLockRefParams", None)
        if rec is None or not (takes(c.dec_lock_ref, "params") or takes(c.dec_lock_ref, "swa_uuid_for_lock")):
            c.dec_lock_ref(q.last_node)
        elif takes(c.dec_lock_ref, "params"):
            c.dec_lock_ref(q.last_node, rec if isinstance(rec, params) else params(swa_uuid_for_lock=rec))  # type: ignore
        else:
            c.dec_lock_ref(q.last_node, rec)

    def _read_back(self, r: str, s: Sched) -> None:
        """The adapter's request follows SGLang's: its node, its row, the part the tree owns
        (`cache_protected_len` where the release tracks it, else the prefix indices: 0.4.10);
        then the row must read live slots that hold its prefix (the next chunk resumes there)."""
        req, q = self.reqs[r], s.req
        req.node = q.last_node
        row = [int(x) for x in self.rows.req_to_token[s.row, :s.computed].tolist()]
        req.slots = row + req.slots[s.computed:]
        req.hit = self._protected_len(q)
        self._relocked(r, s)
        self._check_row(req, s.computed)

    def _protected_len(self, q: Any) -> int:
        """The part of a published request's row the tree owns (its own part starts there): SGLang's
        `cache_protected_len` where the release tracks it, else the prefix indices (0.4.10)."""
        if self.own_req:
            return req_get(q, "cache_protected_len")
        if method_reads(self.cache, "cache_unfinished_req", "cache_protected_len"):
            return q.cache_protected_len
        return len(q.prefix_indices)

    def _between_chunks(self, r: str, s: Sched) -> None:
        """The scheduler's own step after publishing a chunk, before the next one (a class whose
        release's scheduler moves the request to a new row does it here: `_next_chunk_row`)."""

    def _next_chunk_row(self, s: Sched) -> None:
        """0.4.10-0.5.7's scheduler after `cache_unfinished_req`: the chunked request's row is freed,
        and the next chunk gets a new one with `prefix_indices` written back into it
        (`prepare_for_extend`); 0.5.12+ keep the row (`alloc(reqs)` records it on the request)."""
        q = s.req
        free_row(self.rows, q, s.row)
        row = alloc_row(self.rows, q)
        if row is None:
            raise Violation("bookkeeping", "size_accounting", f"{q.rid}: no req_to_token row for its next chunk "
                            "right after its own was freed")
        q.req_pool_idx = s.row = row
        self._row_write(s, 0, [int(x) for x in q.prefix_indices.tolist()])
        self.coverage["state:new_row_per_chunk"] += 1

    def row_per_chunk(self) -> bool:
        """Whether this release's scheduler gives a chunked request a new row per chunk: its pool
        hands out rows by count (`alloc(need_size)`, 0.4.10-0.5.7), not per request (0.5.12+)."""
        return not self.kv_api and takes(self.rows.alloc, "need_size")

    def _check_row(self, req: Req, upto: int) -> None:
        """Every position a resume at `upto` reads is live and holds its prefix: full KV for all
        of [0, upto) (or, all-SWA, the window), SWA KV for the window behind it."""
        comps = self.lay.components
        free, holds = set(self.free_slots()), self._holds()
        lo = max(0, upto - self.lay.window) if comps == ("swa",) else 0
        for p in range(lo, upto):
            sl = req.slots[p]
            if sl is None or sl in free or not holds(sl, tuple(req.tokens[:p + 1])):
                got = "free" if sl in free else self.written.get(sl)
                raise Violation("safety", self.row_check or ("hit_sound_swa_window" if comps == ("swa",)
                                                             else "hit_sound_full"),
                                f"{req.rid}: after publishing its chunk, its row reads position {p} from slot {sl}, "
                                f"which holds {got!r:.60} instead of its prefix")
        if "swa" in comps and comps != ("swa",) and hasattr(self, "swa_live"):
            _, swa_free = self._free_sets()
            for p in range(max(0, upto - self.lay.window), upto):
                if not self.swa_live(req.slots[p], tuple(req.tokens[:p + 1]), swa_free):
                    raise Violation("safety", "hit_sound_swa_window", f"{req.rid}: after publishing its chunk, the "
                                    f"SWA KV of position {p} (window {self.lay.window}) is not live")

    def _holds(self) -> Any:
        """How the row check reads what a slot holds: the shadow of what was written there."""
        return lambda slot, prefix: self.written.get(slot) == prefix

    def _remember(self, req: Req, n: int) -> None:
        """The no-eviction twin learns what an insert of tokens[:n] keeps (page-aligned prefixes)."""
        ps = self.lay.page_size
        for end in range(ps, n // ps * ps + 1, ps):
            self.twin.add(tuple(req.tokens[:end]))

    # ---- decode, finish and abort of a scheduler-path request -----------------------------
    def _s_decode(self, r: str, tok: int) -> dict:
        s = self.sched[r]
        if s.computed < s.prompt:
            raise ActionRejected(f"request {r} is mid-prefill")
        out = self._a_decode(r, tok)
        if out.get("allocated"):
            req = self.reqs[r]
            self._row_write(s, s.computed, [req.slots[s.computed]])
            s.computed += 1
            if self.own_req:
                s.req.output_ids.append(tok)
            self._set_len(s, s.computed)
        return out

    def _s_finish(self, r: str) -> dict:
        s = self.sched[r]
        if s.computed < s.prompt:
            raise ActionRejected(f"request {r} is mid-prefill")
        return self._release_sched(r, s, insert=True)

    def _s_abort(self, r: str) -> dict:
        s = self.sched[r]
        if not self.own_req and not takes(self.cache.cache_finished_req, "is_insert") and s.computed < s.prompt:
            raise ActionRejected("this release aborts a request only after its prefill (no is_insert)")
        return self._release_sched(r, s, insert=False)

    def _release_sched(self, r: str, s: Sched, insert: bool) -> dict:
        """SGLang's own release: insert (or not), free the request's own slots, unlock."""
        req = self.reqs[r]
        insert = self._release_call(r, s, insert)
        s.inserted = insert
        if insert:
            self._remember(req, s.computed)
        self._released(r, s)
        del self.reqs[r], self.sched[r]
        self.coverage["state:sched_released"] += 1
        return {"inserted": insert}

    def _release_call(self, r: str, s: Sched, insert: bool) -> bool:
        """SGLang's call that releases a finished (insert) or aborted request, as the release's
        scheduler makes it; whether the request was cached (0.4.10 caches an aborted one)."""
        q, c = s.req, self.cache
        if self.own_req:        # SGLang's own release: the tree's insert, the request's tail, its row
            from sglang.srt.managers import schedule_batch as sb
            from sglang.srt.mem_cache import common
            q.finished_reason = sb.FINISH_LENGTH(length=len(q.output_ids)) if insert else sb.FINISH_ABORT()
            key = "checkpoint" if self.kv_api else "is_insert"
            self._sglang_call(lambda: common.release_kv_cache(q, c, **{key: insert}))
            return insert
        self._finished_fields(r, s, insert)
        if takes(c.cache_finished_req, "is_insert"):
            self._sglang_call(lambda: c.cache_finished_req(q, is_insert=insert))
        else:
            self._sglang_call(lambda: c.cache_finished_req(q))
            insert = True       # 0.4.10 caches an aborted request as a finished one
        free_row(self.rows, q, s.row)
        return insert

    def _finished_fields(self, r: str, s: Sched, insert: bool) -> None:
        """A flat request's fields as the scheduler leaves them when it finishes or aborts it."""
        req, q = self.reqs[r], s.req
        q.output_ids = self._seq(req.tokens[s.prompt:] + [PENDING])    # the sampled token has no KV yet
        q.fill_ids = self._seq(req.tokens[:s.computed])
        q.finished_reason = "length" if insert else "abort"

    def _released(self, r: str, s: Sched) -> None:
        """The class's own records of a released request (receipts, holds) are dropped."""

    # ---- which requests may act ------------------------------------------------------------
    def sched_enabled(self, out: dict[str, list[str]]) -> dict[str, list[str]]:
        sched = self._sched_state()
        mid = {r for r, s in sched.items() if s.computed < s.prompt}
        for a in ("decode", "finish"):
            out[a] = [r for r in out[a] if r not in mid]
        if not self.own_req and not frees_committed(self.cache):
            out["abort"] = [r for r in out["abort"] if r not in mid]
        out["chunk"] = [r for r, q in self.reqs.items() if q.state == "waiting" or r in mid]
        return out
