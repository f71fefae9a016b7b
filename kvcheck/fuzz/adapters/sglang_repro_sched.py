"""The scheduler-path part of an SGLang reproducer script (sglang_reproducer.py puts it into
sglang_repro_template.TEMPLATE at @SCHED@): chunked prefill published by SGLang's own
cache_unfinished_req / checkpoint_kv_cache, and such a request released by SGLang's own
cache_finished_req / release_kv_cache, on SGLang's Req (0.5.23) or the fields it reads (<= 0.5.12).
"""

SCHED = r'''# ---- the scheduler path: chunked prefill; SGLang's own cache_unfinished_req / checkpoint, and its own
# ---- cache_finished_req / release_kv_cache for such a request (on SGLang's Req, or its fields)
from sglang.srt.mem_cache import memory_pool as _mp
try:
    from sglang.srt.mem_cache import common as _common
except ImportError:
    _common = None
KV_API = _common is not None and hasattr(_common, "checkpoint_kv_cache") and \
    "checkpoint" in inspect.signature(_common.release_kv_cache).parameters     # 0.5.23: req.kv records
_rp = inspect.signature(_mp.ReqToTokenPool.__init__).parameters
rows = _mp.ReqToTokenPool(**{k: v for k, v in dict(size=8, max_context_len=MAX_TOKENS + 8, device="cpu",
                                                   enable_memory_saver=False).items() if k in _rp})
cache.req_to_token_pool = rows
if KV_API:
    from sglang.srt import runtime_context as _rc
    if not _rc._CONTEXT.is_config_namespace_published("serving"):
        _rc._CONTEXT.override_server_args().install()      # SGLang's test default config


def seq(tokens):
    return array("q", tokens) if PARAMS_API else list(tokens)


def takes(fn, name):
    return name in inspect.signature(fn).parameters


class FlatReq:          # the fields of SGLang's Req that cache_unfinished_req / cache_finished_req read (<= 0.5.12)
    def __init__(self, rid, prompt, computed, node, hit, receipt, prefix):
        self.rid, self.origin_input_ids, self.output_ids, self.fill_ids = rid, seq(prompt), seq([]), seq(prompt[:computed])
        self.prefix_indices = torch.tensor(prefix, dtype=torch.int64)
        self.req_pool_idx, self.last_node, self.cache_protected_len = None, node, hit
        self.extra_key, self.priority, self.is_chunked, self.session, self.to_finish = None, 0, 1, None, None
        self.kv_committed_len = self.kv_allocated_len = computed
        self.kv_committed_freed = self.kv_overallocated_freed = False
        self.swa_uuid_for_lock, self.swa_prefix_lock_released, self.swa_evicted_seqlen = receipt, False, 0
        self.finished_reason = self.finished_len = None
    def pop_committed_kv_cache(self):
        assert not self.kv_committed_freed; self.kv_committed_freed = True; return self.kv_committed_len
    def pop_overallocated_kv_cache(self):
        self.kv_overallocated_freed = True; return self.kv_committed_len, self.kv_allocated_len
    def finished(self):
        return self.finished_reason is not None


def set_len(q):
    s, n = q["sched"], q["sched"]["computed"]
    if KV_API:
        s["req"].kv.kv_committed_len = s["req"].kv.kv_allocated_len = n; s["req"].extend_end = n
    else:
        s["req"].kv_committed_len = s["req"].kv_allocated_len = n; s["req"].fill_ids = seq(q["tokens"][:n])


def row_write(q, lo, slots):
    if slots:
        rows.write((q["sched"]["row"], slice(lo, lo + len(slots))), torch.tensor(slots, dtype=torch.int32))


def admit_sched(q, r):
    prompt, computed = list(q["tokens"]), len(q["slots"])
    if KV_API:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.base_prefix_cache import TreeLock
        from sglang.srt.sampling.sampling_params import SamplingParams
        sr = Req(r, "", array("q", prompt), SamplingParams(max_new_tokens=MAX_TOKENS))
        sr.refresh_fill_ids(); sr.prefix_len, sr.last_node = q["hit"], q["node"]; sr.kv.cache_protected_len = q["hit"]
        rec = q["lockrec"]
        sr.lock = TreeLock(q["node"], rec.to_dec_params() if hasattr(rec, "to_dec_params") else rec)
    else:
        sr = FlatReq(r, prompt, computed, q["node"], q["hit"], q["receipt"] if SWA else None, q["slots"][:q["hit"]])
    a = inspect.signature(rows.alloc).parameters
    row = rows.alloc([sr])[0] if "reqs" in a else rows.alloc(1)[0]
    if not KV_API:
        sr.req_pool_idx = row
    q["sched"] = {"req": sr, "row": row, "prompt": len(prompt), "computed": computed}
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
    if KV_API:
        sglang_call(lambda: _common.checkpoint_kv_cache(sr, cache))
    elif takes(cache.cache_unfinished_req, "chunked"):
        sglang_call(lambda: cache.cache_unfinished_req(sr, chunked=True))
    else:
        sglang_call(lambda: cache.cache_unfinished_req(sr))
    if FAULT == "unfinished_lock_not_moved" and sr.last_node is not old:   # ==== PLANTED FAULT: the lock
        if KV_API:                                                          # stays on the old node
            cache.unlock(sr.lock); cache.lock(old)
        else:
            cache.inc_lock_ref(old)
            unlock(sr.last_node, sr.swa_uuid_for_lock)
    q["node"], n = sr.last_node, s["computed"]
    q["slots"] = [int(x) for x in rows.req_to_token[s["row"], :n].tolist()] + q["slots"][n:]
    if KV_API:
        q["hit"] = sr.kv.cache_protected_len
    elif "cache_protected_len" in type(cache).cache_unfinished_req.__code__.co_names:
        q["hit"] = sr.cache_protected_len
    else:
        q["hit"] = len(sr.prefix_indices)
    if SWA:
        q["receipt"] = sr.swa_uuid_for_lock
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
    if KV_API:
        from sglang.srt.managers import schedule_batch as sb
        sr.finished_reason = sb.FINISH_LENGTH(length=len(sr.output_ids)) if insert else sb.FINISH_ABORT()
        sglang_call(lambda: _common.release_kv_cache(sr, cache, checkpoint=insert))
    else:
        sr.output_ids = seq(q["tokens"][s["prompt"]:] + [0]); sr.fill_ids = seq(q["tokens"][:s["computed"]])
        sr.finished_reason = "length" if insert else "abort"
        if takes(cache.cache_finished_req, "is_insert"):
            sglang_call(lambda: cache.cache_finished_req(sr, is_insert=insert))
        else:
            sglang_call(lambda: cache.cache_finished_req(sr)); insert = True
        if s["row"] not in rows.free_slots:
            rows.free(sr) if "req" in inspect.signature(rows.free).parameters else rows.free(s["row"])
    if insert:
        for end in range(PAGE, s["computed"] // PAGE * PAGE + 1, PAGE):
            twin.add(tuple(q["tokens"][:end]))
    print(f"  SGLang's own release ({'insert' if insert else 'no insert'}) of {s['computed']} tokens")


'''
