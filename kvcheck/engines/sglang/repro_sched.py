"""The scheduler-path part of an SGLang reproducer script: chunked prefill published by SGLang's own
cache_unfinished_req / checkpoint_kv_cache, and such a request released by SGLang's own
cache_finished_req / release_kv_cache, on SGLang's Req (0.5.16+: REQ_RECORD, which the ChunkCache script
shares too) or the fields it reads (<= 0.5.15). SCHED_API is what every class's script shares (the request SGLang sees, its row, the calls); SCHED
(SCHED_API and the RadixCache / SWARadixCache part) goes into sglang_repro_template.TEMPLATE at
@SCHED@; the UnifiedRadixCache FULL+MAMBA script takes SCHED_API (repro_mamba_sched.py).
"""

REQ_RECORD = r'''# ---- SGLang's request: its own Req where it keeps a KV record (0.5.16+), its fields' holder
try:
    from sglang.srt.mem_cache import common as _common
except ImportError:
    _common = None
KV_API = _common is not None and hasattr(_common, "checkpoint_kv_cache") and \
    "checkpoint" in inspect.signature(_common.release_kv_cache).parameters     # 0.5.22+: req.kv records
try:
    from sglang.srt.managers import schedule_batch as _sb
    OWN_REQ = KV_API or re.search(r"self\.kv\s*[:=]", inspect.getsource(_sb.Req.__init__)) is not None
except Exception:       # 0.4.10: its import chain does not run on CPU
    _sb, OWN_REQ = None, False
_KVF = {f.name: f for f in dataclasses.fields(_sb.ReqKvInfo)} if OWN_REQ and hasattr(_sb, "ReqKvInfo") else {}
if KV_API:
    from sglang.srt import runtime_context as _rc
    if not _rc._CONTEXT.is_config_namespace_published("serving"):     # SGLang's test default config,
        _rc._CONTEXT.override_server_args(_mamba_cache_chunk_size=64).install()   # the Mamba chunk seeded
elif OWN_REQ:           # release_kv_cache reads the global server args: an unresolved dummy one
    from sglang.srt import runtime_context as _rc, server_args as _sa
    try:
        _rc.get_server_args()
    except ValueError:  # a dataclass: its defaults without __post_init__ (it would load the model's config)
        if dataclasses.is_dataclass(_sa.ServerArgs):
            _args = _sa.ServerArgs.__new__(_sa.ServerArgs)
            for _f in dataclasses.fields(_sa.ServerArgs):
                setattr(_args, _f.name, _f.default if _f.default is not dataclasses.MISSING else
                        _f.default_factory() if _f.default_factory is not dataclasses.MISSING else None)
            _args.model_path, _args.device, _args.page_size = "dummy", "cpu", 1
        else:           # 0.5.20+: a Struct that resolves nothing when built
            _args = _sa.ServerArgs(model_path="dummy", device="cpu", page_size=1)
        _args._mamba_cache_chunk_size = 64
        _rc.get_context().set_server_args(_args)


def kv_holder(sr, k):   # where the release keeps request field k: its kv record if declared there
    if k not in _KVF:
        return sr
    if sr.kv is None:   # 0.5.16-0.5.18 make it at allocation: its required fields 0
        sr.kv = _sb.ReqKvInfo(**{n: 0 for n, f in _KVF.items() if f.default is dataclasses.MISSING
                                 and f.default_factory is dataclasses.MISSING})
    return sr.kv


def kvset(sr, **values):
    for k, v in values.items():
        setattr(kv_holder(sr, k), k, v)


def keep_lock(sr, rec):     # the admission's lock receipt, in the field the release's Req keeps it in
    if hasattr(sr, "lock_receipt"):         # 0.5.20-0.5.21: its DecLockRefParams
        P = bpc.DecLockRefParams
        sr.lock_receipt = P() if rec is None else rec.to_dec_params() if hasattr(rec, "to_dec_params") else \
            P(swa_uuid_for_lock=getattr(rec, "swa_uuid_for_lock", rec))
    elif "swa_uuid_for_lock" in _KVF or hasattr(sr, "swa_uuid_for_lock"):     # its SWA uuid alone
        kvset(sr, swa_uuid_for_lock=getattr(rec, "swa_uuid_for_lock", rec))


def kept_uuid(sr):          # the SWA uuid of the receipt the request keeps after SGLang moved its lock
    r = getattr(sr, "lock_receipt", None) or getattr(kv_holder(sr, "swa_uuid_for_lock"), "swa_uuid_for_lock", None)
    return getattr(r, "swa_uuid_for_lock", r)


'''
SCHED_API = REQ_RECORD + r'''# ---- the scheduler path: chunked prefill; SGLang's own cache_unfinished_req / checkpoint, and its own
# ---- cache_finished_req / release_kv_cache for such a request (on SGLang's Req, or its fields)
def seq(tokens):
    return array("q", tokens) if PARAMS_API else list(tokens)


def takes(fn, name):
    return name in inspect.signature(fn).parameters


class FlatReq:          # the fields of SGLang's Req that cache_unfinished_req / cache_finished_req read (< 0.5.23)
    def __init__(self, rid, prompt, computed, node, hit, receipt, prefix):
        self.rid, self.origin_input_ids, self.output_ids, self.fill_ids = rid, seq(prompt), seq([]), seq(prompt[:computed])
        self.prefix_indices = torch.tensor(prefix, dtype=torch.int64)
        self.req_pool_idx, self.last_node, self.cache_protected_len = None, node, hit
        self.extra_key, self.priority, self.is_chunked, self.session, self.to_finish = None, 0, 1, None, None
        self.kv_committed_len = self.kv_allocated_len = computed
        self.kv_committed_freed = self.kv_overallocated_freed = False
        self.swa_uuid_for_lock, self.swa_prefix_lock_released, self.swa_evicted_seqlen = receipt, False, 0
        self.swa_evict_floor = 0
        self.mamba_pool_idx = self.mamba_last_track_seqlen = self.mamba_ping_pong_track_buffer = None
        self.mamba_next_track_idx = self.mamba_branching_seqlen = None
        self.finished_reason = self.finished_len = None
    def pop_committed_kv_cache(self):
        assert not self.kv_committed_freed; self.kv_committed_freed = True; return self.kv_committed_len
    def pop_overallocated_kv_cache(self):
        self.kv_overallocated_freed = True; return self.kv_committed_len, self.kv_allocated_len
    def finished(self):
        return self.finished_reason is not None
    @property
    def fill_len(self):     # releases after 0.5.12 (0.5.14) read the filled tokens through these
        return len(self.fill_ids)
    def get_fill_ids(self):
        return self.fill_ids
    @property
    def extend_range(self):  # 0.5.15: what this round computes (the caches read .end)
        import collections
        return collections.namedtuple("Range", "start end")(len(self.prefix_indices), len(self.fill_ids))
    def is_dllm(self):      # 0.5.9's ReqToTokenPool.alloc asks
        return False


def sched_req(r, prompt, computed, node, hit, rec, receipt, prefix):
    """SGLang's request as the scheduler has it after the match and the first chunk's allocation."""
    if KV_API:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.base_prefix_cache import TreeLock
        from sglang.srt.sampling.sampling_params import SamplingParams
        sr = Req(r, "", array("q", prompt), SamplingParams(max_new_tokens=MAX_TOKENS))
        sr.refresh_fill_ids(); sr.prefix_len, sr.last_node = hit, node; sr.kv.cache_protected_len = hit
        sr.lock = TreeLock(node, rec.to_dec_params() if hasattr(rec, "to_dec_params") else rec)
        return sr
    if OWN_REQ:
        from sglang.srt.sampling.sampling_params import SamplingParams
        sr = _sb.Req(r, "", seq(prompt), SamplingParams(max_new_tokens=MAX_TOKENS))
        kvset(sr, last_node=node, cache_protected_len=hit, prefix_indices=torch.tensor(prefix, dtype=torch.int64))
        for k, v in (("last_matched_prefix_len", hit), ("is_chunked", 1)):
            if k in _KVF or hasattr(sr, k):
                kvset(sr, **{k: v})
        keep_lock(sr, rec if rec is not None else receipt)
        return sr
    return FlatReq(r, prompt, computed, node, hit, receipt, prefix)


def sched_row(pool, sr):
    """A row of `pool` for SGLang's request, as the release's pool hands it out: alloc(1) (<= 0.5.7),
    alloc(1, [req]) (0.5.7's HybridReqToTokenPool), alloc([req]) (0.5.12+, recorded on the request)."""
    a = inspect.signature(pool.alloc).parameters
    if "reqs" in a:
        row = int((pool.alloc(1, [sr]) if "need_size" in a else pool.alloc([sr]))[0])
    else:
        row = int(pool.alloc(1)[0])
    if not KV_API:
        kvset(sr, req_pool_idx=row)
    return row


def sched_len(sr, tokens, n):       # the computed length, in the release's fields
    if KV_API:
        sr.kv.kv_committed_len = sr.kv.kv_allocated_len = n; sr.extend_end = n
    elif OWN_REQ:
        from sglang.srt.utils.common import Range
        sr.full_untruncated_fill_ids, sr.extend_range = seq(tokens), Range(0, n)
        kvset(sr, kv_committed_len=n, kv_allocated_len=n)
    else:
        sr.kv_committed_len = sr.kv_allocated_len = n; sr.fill_ids = seq(tokens[:n])


def publish_call(cache, sr):        # the scheduler's call after a chunk that leaves the prompt unfinished
    if KV_API:
        return lambda: _common.checkpoint_kv_cache(sr, cache)
    if takes(cache.cache_unfinished_req, "chunked"):
        return lambda: cache.cache_unfinished_req(sr, chunked=True)
    return lambda: cache.cache_unfinished_req(sr)


def protected_len(cache, sr):       # the part of a published request's row the tree owns
    if OWN_REQ:
        return getattr(kv_holder(sr, "cache_protected_len"), "cache_protected_len")
    if "cache_protected_len" in type(cache).cache_unfinished_req.__code__.co_names:
        return sr.cache_protected_len
    return len(sr.prefix_indices)


def can_abort_mid_prefill(cache):   # 0.4.10 has no is_insert: an abort only after the prefill
    return OWN_REQ or takes(cache.cache_finished_req, "is_insert")


def release_call(cache, sr, tokens, prompt, computed, insert):
    """(SGLang's release of a finished (insert) or aborted request, whether it caches it)."""
    if OWN_REQ:     # SGLang's own release: the tree's insert, the request's tail, its row
        sr.finished_reason = _sb.FINISH_LENGTH(length=len(sr.output_ids)) if insert else _sb.FINISH_ABORT()
        kw = {"checkpoint" if KV_API else "is_insert": insert}
        return (lambda: _common.release_kv_cache(sr, cache, **kw)), insert
    sr.output_ids = seq(tokens[prompt:] + [0]); sr.fill_ids = seq(tokens[:computed])   # the sampled token: no KV
    sr.finished_reason = "length" if insert else "abort"
    if takes(cache.cache_finished_req, "is_insert"):
        return (lambda: cache.cache_finished_req(sr, is_insert=insert)), insert
    return (lambda: cache.cache_finished_req(sr)), True      # 0.4.10 caches an aborted request too


def free_row(pool, sr, row):        # the flat API's scheduler frees the request's row itself
    if not OWN_REQ and row not in pool.free_slots:
        pool.free(sr) if "req" in inspect.signature(pool.free).parameters else pool.free(row)


'''
SCHED = SCHED_API + r'''from sglang.srt.mem_cache import memory_pool as _mp
_rp = inspect.signature(_mp.ReqToTokenPool.__init__).parameters
rows = _mp.ReqToTokenPool(**{k: v for k, v in dict(size=8, max_context_len=MAX_TOKENS + 8, device="cpu",
                                                   enable_memory_saver=False).items() if k in _rp})
cache.req_to_token_pool = rows


def set_len(q):
    sched_len(q["sched"]["req"], q["tokens"], q["sched"]["computed"])


def row_write(q, lo, slots):
    if slots:
        rows.write((q["sched"]["row"], slice(lo, lo + len(slots))), torch.tensor(slots, dtype=torch.int32))


def admit_sched(q, r):
    prompt, computed = list(q["tokens"]), len(q["slots"])
    sr = sched_req(r, prompt, computed, q["node"], q["hit"], q.get("lockrec"), q["receipt"] if SWA else None,
                   q["slots"][:q["hit"]])
    q["sched"] = {"req": sr, "row": sched_row(rows, sr), "prompt": len(prompt), "computed": computed}
    row_write(q, 0, q["slots"][:computed]); set_len(q)


def sglang_call(fn):             # SGLang may evict on its own inside: the twin forgets what it dropped
    before = prefixes()
    locked = {path + tuple(int(t) for t in nd.key) for nd, path in tree() if lock_ref(nd) > 0}
    fn()
    gone = before - prefixes(); twin.difference_update(gone)
    if gone & locked:
        bugs.append("SGLang's own eviction inside a scheduler call removed a locked node")


def publish(q, r):
    s, sr = q["sched"], q["sched"]["req"]
    old = sr.last_node
    sglang_call(publish_call(cache, sr))
    if FAULT == "unfinished_lock_not_moved" and sr.last_node is not old:   # ==== PLANTED FAULT: the lock
        if KV_API:                                                          # stays on the old node
            cache.unlock(sr.lock); cache.lock(old)
        else:
            cache.inc_lock_ref(old)
            unlock(sr.last_node, kept_uuid(sr))
    q["node"], n = sr.last_node, s["computed"]
    q["slots"] = [int(x) for x in rows.req_to_token[s["row"], :n].tolist()] + q["slots"][n:]
    q["hit"] = protected_len(cache, sr)
    if SWA:
        q["receipt"] = kept_uuid(sr)
    full_free, swa_free = free_sets()
    print(f"  cache_unfinished_req: {n} tokens published, lock now on a {len(path_slots(q['node']))}-token node, row {q['slots'][:n]}")
    for p in range(n):
        if q["slots"][p] in full_free or written.get(q["slots"][p]) != tuple(q["tokens"][:p + 1]):
            bugs.append(f"{r}: after publishing its chunk, its row reads position {p} from slot {q['slots'][p]}, "
                        "which is free or holds other tokens"); break
    for end in range(PAGE, n // PAGE * PAGE + 1, PAGE):
        twin.add(tuple(q["tokens"][:end]))


def chunk(r, n):
    q = reqs[r]
    if q["state"] == "waiting":
        match(r, limit=n)
        if q["state"] != "running":
            return
        admit_sched(q, r)
    else:
        s = q["sched"]
        k = min(s["prompt"] - s["computed"], -(-n // PAGE) * PAGE)
        new = allocate(k if SWA else -(-k // PAGE) * PAGE)
        if new is None:
            print("  chunk refused (pool short)"); return
        q["slots"] += new[:k]; q["spare"] = new[k:]
        for p in range(s["computed"], s["computed"] + k):
            write(q, p, q["slots"][p])
        row_write(q, s["computed"], new[:k]); s["computed"] += k; set_len(q)
    if q["sched"]["computed"] < q["sched"]["prompt"]:
        publish(q, r)


def release_sched(r, insert):
    q = reqs.pop(r)
    s, sr = q["sched"], q["sched"]["req"]
    fn, insert = release_call(cache, sr, q["tokens"], s["prompt"], s["computed"], insert)
    sglang_call(fn)
    free_row(rows, sr, s["row"])
    if insert:
        for end in range(PAGE, s["computed"] // PAGE * PAGE + 1, PAGE):
            twin.add(tuple(q["tokens"][:end]))
    print(f"  SGLang's own release ({'insert' if insert else 'no insert'}) of {s['computed']} tokens")


'''
