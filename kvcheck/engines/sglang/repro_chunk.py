"""The ChunkCache part of an SGLang reproducer script (repro_classes.py puts it after the
shared prelude of repro_template.py and fills in the @NAME@ fields). It plays the trace as
chunk.py and the scheduler path (sched.py) play SGLang's scheduler, with SGLang's
classes only: admission (`match`, or a request's first `chunk`), each later `chunk` published by
cache_unfinished_req (a new row per chunk on 0.4.10-0.5.7), decode into the row, and SGLang's own
release (release_kv_cache, or 0.4.10's cache_finished_req)."""

from .repro_sched import REQ_RECORD

BODY = r'''
import dataclasses, importlib.metadata, inspect, re
from array import array
import sglang.srt.mem_cache.allocator as al
from sglang.srt.mem_cache import base_prefix_cache as bpc
from sglang.srt.mem_cache import radix_cache as rc
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt import server_args as sa

CHUNK_TOKENS, ROWS = @CHUNK@, @ROWS@       # CacheInitParams.chunked_prefill_size; request rows


def kw(fn, **k):
    names = inspect.signature(fn).parameters
    return {a: b for a, b in k.items() if a in names}


''' + REQ_RECORD + r'''class _ServerArgsStandIn:     # no server here: the fields SGLang's Req and release_kv_cache read
    page_size, speculative_eagle_topk, speculative_algorithm, strip_thinking_cache = 1, None, None, False


# (0.5.16+: REQ_RECORD published an unresolved ServerArgs in the runtime context, whose publishing
# resolves what it is given: a stand-in there would not do)
if not OWN_REQ and getattr(sa, "_global_server_args", None) is None and \
        hasattr(sa, "set_global_server_args_for_scheduler"):
    sa.set_global_server_args_for_scheduler(_ServerArgsStandIn())


def row_of(sreq):                             # the request's row, where the release keeps it (req.kv: 0.5.19+)
    return getattr(kv_holder(sreq, "req_pool_idx"), "req_pool_idx")
A = al.TokenToKVPoolAllocator
alloc = A(CAPACITY, torch.int64, "cpu", None, False) if "need_sort" in inspect.signature(A.__init__).parameters \
    else A(CAPACITY, torch.int64, "cpu", None)
rtp = ReqToTokenPool(**kw(ReqToTokenPool.__init__, size=ROWS, max_context_len=MAX_TOKENS + 8, device="cpu",
                          enable_memory_saver=False))
ROWS_ALL = set(rtp.free_slots)
if "params" in inspect.signature(ChunkCache.__init__).parameters:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams as P
    cache = ChunkCache(P(**kw(P, disable=True, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=1,
                              chunked_prefill_size=CHUNK_TOKENS)))
else:
    cache = ChunkCache(**kw(ChunkCache.__init__, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=1))
try:
    from sglang.srt.mem_cache.common import release_kv_cache
except ImportError:           # 0.4.10: the scheduler calls cache_finished_req itself
    release_kv_cache = None
try:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
except Exception:             # 0.4.10 on CPU: a stand-in with the fields ChunkCache reads
    Req = None

    class _Req:
        def __init__(self, rid, tokens):
            self.rid, self.origin_input_ids, self.output_ids, self.fill_ids = rid, list(tokens), [], []
            self.req_pool_idx = self.prefix_indices = self.finished_reason = None
PARAMS_API = hasattr(bpc, "MatchPrefixParams")
ROW_PER_CHUNK = "need_size" in inspect.signature(rtp.alloc).parameters   # 0.4.10-0.5.7: a new row per chunk
RK = getattr(rc, "RadixKey", None)


def key(tokens):
    return list(tokens) if RK is None else RK(array("q", tokens) if PARAMS_API else list(tokens))


# ---- what the checks watch: every slot handed back to the allocator must be in use ----------
reqs, written, bugs, last_admitted, leaked = {}, {}, [], [], [0]


def free_set():
    return {int(x) for t in (alloc.free_pages, getattr(alloc, "release_pages", None)) if t is not None for x in t.tolist()}


_free_real = alloc.free


def _free_observed(idx):
    slots = [int(x) for x in idx.reshape(-1).tolist()]
    now = free_set()
    dup = [s for s in slots if s in now or slots.count(s) > 1]
    if dup:
        bugs.append(f"slot {dup[0]} handed back to the allocator while already free (a double free)")
    return _free_real(idx)


alloc.free = _free_observed
if FAULT == "chunk_reports_hit":             # ==== PLANTED FAULT: the last admitted request's slots as a hit
    _match_real = cache.match_prefix
    def _match(*a, **k):
        m = _match_real(*a, **k)
        return m._replace(device_indices=torch.tensor(last_admitted[:2], dtype=torch.int64), last_device_node=object()) if last_admitted else m
    cache.match_prefix = _match
if FAULT == "chunk_frees_unfinished":        # ==== PLANTED FAULT: frees the KV it hands back as prefix_indices
    _unf_real = cache.cache_unfinished_req
    def _unf(req, *a, **k):
        out = _unf_real(req, *a, **k); alloc.free(req.prefix_indices.to(torch.int64).clone()); return out
    cache.cache_unfinished_req = _unf
if FAULT in ("chunk_double_free", "chunk_finish_leaks"):   # ==== PLANTED FAULT around cache_finished_req
    _fin_real = cache.cache_finished_req
    def _fin(req, *a, **k):
        last = reqs[req.rid]["slots"][-1:]
        if FAULT == "chunk_finish_leaks":    # all but the last committed slot go back
            alloc.free = lambda idx: _free_observed(idx[:-1])
        try:
            out = _fin_real(req, *a, **k)
        finally:
            alloc.free = _free_observed
        if FAULT == "chunk_double_free":     # the last committed slot freed a second time
            alloc.free(torch.tensor(last, dtype=torch.int64))
        return out
    cache.cache_finished_req = _fin
if FAULT == "lock_ref_leak":                 # ==== PLANTED FAULT: a released lock keeps its tokens protected
    _dec_real = cache.dec_lock_ref
    def _dec(*a, **k):
        out = _dec_real(*a, **k); leaked[0] += 1; cache.protected_size = lambda: leaked[0]; return out
    cache.dec_lock_ref = _dec
if FAULT == "evict_locked":                  # ==== PLANTED FAULT: evict frees a running request's first slot
    _ev_real = cache.evict
    def _ev(*a, **k):
        out = _ev_real(*a, **k)
        run = [q for q in reqs.values() if q["state"] == "running"]
        if run: alloc.free(torch.tensor(run[0]["slots"][:1], dtype=torch.int64))
        return out
    cache.evict = _ev


def delta(res):
    return int(res) if isinstance(res, int) else int(getattr(res, "delta", 0) or 0)


def lock_call(name, node):
    d = delta(getattr(cache, name)(node))
    if d:
        bugs.append(f"ChunkCache.{name} reported delta {d}; it keeps no references")


def evict(n):
    before = free_set()
    cache.evict(bpc.EvictParams(num_tokens=n)) if PARAMS_API else cache.evict(n)
    freed = free_set() - before
    if freed:
        bugs.append(f"evict({n}) freed slots {sorted(freed)[:4]} that running requests hold (ChunkCache keeps none)")


def allocate(n):
    out = alloc.alloc(n)
    if out is None:
        evict(n - alloc.available_size())
        out = alloc.alloc(n)
    return None if out is None else [int(x) for x in out.tolist()]


def alloc_row(sreq):
    if not ROW_PER_CHUNK:                    # 0.5.12+: rows per request (recorded on it)
        return None if rtp.alloc([sreq]) is None else row_of(sreq)
    out = rtp.alloc(1)
    if out is not None:
        kvset(sreq, req_pool_idx=out[0])
    return None if out is None else out[0]


def free_row(sreq):
    if row_of(sreq) is None or row_of(sreq) in rtp.free_slots:
        return                               # the release already gave it back
    if not ROW_PER_CHUNK:
        rtp.free(sreq)
    else:
        rtp.free(row_of(sreq)); kvset(sreq, req_pool_idx=None)


def write_row(sreq, lo, vals):
    t = vals if hasattr(vals, "dtype") else torch.tensor(vals, dtype=torch.int32)
    if len(t):
        rtp.write((row_of(sreq), slice(lo, lo + len(t))), t.to(rtp.req_to_token.dtype))


def set_len(q):                              # what is computed, in the request's fields
    sreq, n = q["sreq"], q["computed"]
    if OWN_REQ:                              # 0.5.16+: where the release keeps them (its kv record)
        kvset(sreq, kv_committed_len=n, kv_allocated_len=n)
    else:
        sreq.kv_committed_len = sreq.kv_allocated_len = n
    set_filled(sreq, q["tokens"], n)


def set_filled(sreq, tokens, n):             # 0.5.14's Req: the whole sequence and how much is filled
    if Req is not None and hasattr(sreq, "fill_len"):
        sreq.full_untruncated_fill_ids, sreq.fill_len = array("q", tokens), n
    elif Req is not None and hasattr(sreq, "extend_range"):     # 0.5.15+: the round's range
        from sglang.srt.utils.common import Range
        sreq.full_untruncated_fill_ids, sreq.extend_range = array("q", tokens), Range(0, n)
    else:
        sreq.fill_ids = tokens[:n]


def match(r, limit=None):
    """Admission: match_prefix (no hit), a row, inc_lock_ref, the KV of the prompt or of its first chunk."""
    q = reqs[r]
    toks = q["tokens"]
    m = cache.match_prefix(bpc.MatchPrefixParams(key=key(toks[:-1]))) if PARAMS_API else cache.match_prefix(key=key(toks[:-1]))
    print(f"  match_prefix: {len(m.device_indices)} tokens, node {m.last_device_node}")
    if len(m.device_indices) or m.last_device_node is not None:
        bugs.append(f"{r}: ChunkCache (prefix caching off) reported a {len(m.device_indices)}-token hit"); return
    sreq = Req(r, "", list(toks), SamplingParams()) if Req is not None else _Req(r, toks)
    if alloc_row(sreq) is None:
        print("  admission refused (no row)"); return
    lock_call("inc_lock_ref", m.last_device_node)
    need = len(toks) if limit is None else min(len(toks), limit)
    slots = allocate(need)
    if slots is None:
        free_row(sreq); lock_call("dec_lock_ref", m.last_device_node); print("  admission refused (pool short)"); return
    q.update(state="running", slots=slots, sreq=sreq, prompt=len(toks), computed=need)
    for p in range(need):
        written[slots[p]] = tuple(toks[:p + 1])
    write_row(sreq, 0, slots); set_len(q)
    last_admitted[:] = slots
    print(f"  admitted: row {row_of(sreq)}, {need} of {len(toks)} tokens computed in slots {slots}")


def publish(r):
    """The scheduler after a chunk: cache_unfinished_req hands the request its KV back as prefix_indices;
    0.4.10-0.5.7's scheduler then frees the row and writes them into a new one for the next chunk."""
    q = reqs[r]
    sreq, n = q["sreq"], q["computed"]
    cache.cache_unfinished_req(sreq, **kw(cache.cache_unfinished_req, chunked=True))
    got = [int(x) for x in sreq.prefix_indices.tolist()]
    print(f"  chunk [0, {n}): cache_unfinished_req -> prefix_indices {got}")
    if any(s in free_set() for s in q["slots"][:n]) or got != q["slots"][:n]:
        bugs.append(f"{r}: after cache_unfinished_req its KV {q['slots'][:n]} is freed or not its prefix_indices {got}")
        return
    if ROW_PER_CHUNK:
        free_row(sreq); alloc_row(sreq); write_row(sreq, 0, sreq.prefix_indices)
        print(f"  the scheduler moves it to row {row_of(sreq)} for its next chunk")


def chunk(r, n):
    q = reqs[r]
    if q["state"] == "waiting":
        match(r, limit=n)
        if q["state"] != "running":
            return
    else:
        k = min(q["prompt"] - q["computed"], n)
        new = allocate(k)
        if new is None:
            print("  chunk refused (pool short)"); return
        for i, s in enumerate(new):
            written[s] = tuple(q["tokens"][:q["computed"] + i + 1])
        write_row(q["sreq"], q["computed"], new)
        q["slots"] += new; q["computed"] += k; set_len(q)
    if q["computed"] < q["prompt"]:
        publish(r)


def decode(r, tok):
    q = reqs[r]
    if len(q["tokens"]) >= MAX_TOKENS:
        return
    new = allocate(1)
    if new is None:
        print("  decode refused (pool short)"); return
    write_row(q["sreq"], q["computed"], new)
    q["tokens"].append(tok); q["slots"].append(new[0]); written[new[0]] = tuple(q["tokens"])
    q["computed"] += 1; set_len(q)


def release(r, insert):
    """SGLang's release of a finished or aborted request: release_kv_cache (0.5.7+) or cache_finished_req
    (0.4.10, which frees the row itself), then dec_lock_ref."""
    q = reqs[r]
    if q["state"] == "running":
        sreq = q["sreq"]
        sreq.output_ids = q["tokens"][q["prompt"]:] + [0]     # the last sampled token: its KV not computed yet
        set_filled(sreq, q["tokens"], q["computed"])
        sreq.finished_reason = "length" if insert else "abort"
        if release_kv_cache is not None:
            release_kv_cache(sreq, cache, **kw(release_kv_cache, is_insert=insert, checkpoint=insert))
        else:
            cache.cache_finished_req(sreq)
        free_row(sreq)
        lock_call("dec_lock_ref", None)
        print(f"  released {len(q['slots'])} slots")
    del reqs[r]


def check_state():
    free = free_set()
    for r, q in reqs.items():
        if q["state"] != "running":
            continue
        row = [int(x) for x in rtp.req_to_token[row_of(q["sreq"]), :len(q["slots"])].tolist()]
        for p, s in enumerate(q["slots"]):
            if s in free or written.get(s) != tuple(q["tokens"][:p + 1]) or row[p] != s:
                bugs.append(f"{r} holds position {p} in slot {s}, which is free or overwritten"); return
    if cache.protected_size() or cache.evictable_size():
        bugs.append(f"ChunkCache reports {cache.protected_size()} protected / {cache.evictable_size()} evictable tokens")
    run = [q for q in reqs.values() if q["state"] == "running"]
    for name, owned, pfree, every in (("KV", [s for q in run for s in q["slots"]], sorted(free), set(range(1, CAPACITY + 1))),
                                      ("rows", [row_of(q["sreq"]) for q in run], list(rtp.free_slots), ROWS_ALL)):
        seen = owned + pfree
        if len(seen) != len(set(seen)) or set(seen) != every:
            bugs.append(f"{name}: {len(owned)} held + {len(pfree)} free of {len(every)}: "
                        f"{len(seen) - len(set(seen))} counted twice, {len(every - set(seen))} leaked")


print(f"SGLang {importlib.metadata.version('sglang')} (finding recorded on {RECORDED_RELEASE}); ChunkCache, "
      f"{CAPACITY} slots, chunked prefill as the steps say; fault {FAULT}")
for n, (action, p) in enumerate(STEPS):
    print(f"step {n}: {action} {p}")
    r = p.get("r")
    if action in ("submit", "match", "chunk") and "tokens" in p and r not in reqs:
        reqs[r] = {"tokens": list(p["tokens"]), "state": "waiting"}
    q = reqs.get(r, {})
    mid = q.get("state") == "running" and q["computed"] < q["prompt"]
    if action == "match" and q.get("state") == "waiting":
        match(r)
    elif action == "chunk" and (q.get("state") == "waiting" or mid):
        chunk(r, p["n"])
    elif action == "decode" and q.get("state") == "running" and not mid:
        for t in p.get("toks", [p.get("tok")]):
            decode(r, t)
    elif action == "finish" and q.get("state") == "running" and not mid:
        release(r, True)
    elif action == "abort" and r in reqs and not (mid and "is_insert" not in
                                                   inspect.signature(cache.cache_finished_req).parameters):
        release(r, False)                    # 0.4.10 aborts a request only after its prefill
    elif action == "evict":
        evict(p["n"])
    if not bugs:
        check_state()
    if bugs:
        print(f"    free slots {sorted(free_set())}")
        print("BUG: " + "; ".join(dict.fromkeys(bugs)))
        sys.exit(1)
print("OK: every condition holds on every step (fixed, or not this release)")
sys.exit(0)
'''
