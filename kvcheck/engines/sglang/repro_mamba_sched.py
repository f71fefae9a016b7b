"""The scheduler path of the UnifiedRadixCache FULL+MAMBA reproducer script (repro_classes.py
puts it between repro_mamba.py's World and repro_mamba_run.py): chunked prefill as
sched.py and unified_mamba.py play it. The request SGLang sees, its row and SGLang's
calls are sglang_repro_sched.SCHED_API (shared with the RadixCache script); here the World's side:
its row pool is the cache's HybridReqToTokenPool, SGLang's request carries the request's state slot,
SGLang's own checkpoint / cache_unfinished_req forks the state (the shadow follows its copies) and
moves the lock (full on the path, mamba on the new last node), and a request admitted this way is
finished and aborted by SGLang's own release."""

from .repro_sched import SCHED_API

BODY = r'''
# ---- the scheduler path: a chunk's admission, its next chunks, SGLang's own publish and release ----
PARAMS_API = hasattr(bpc, "MatchPrefixParams")
''' + SCHED_API + r'''
def w_sglang_call(self, fn):  # SGLang's own call: the state shadow follows every state copy it makes
    snap, pool = self.snap(), self.mpool      # (copy_from; fork_from calls it), the twin forgets what
    had, real = "copy_from" in vars(pool), pool.copy_from      # it dropped, no locked node may go
    def copy_from(src, dst):
        out = real(src, dst)
        for d, s in zip(dst.flatten().tolist(), src.flatten().tolist()):
            self.mwritten[int(d)] = self.mwritten.get(int(s))
        return out
    pool.copy_from = copy_from
    try:
        fn()
    finally:
        if had: pool.copy_from = real
        else: del pool.copy_from
    self.forget(*snap)


def w_row_write(self, s, lo, slots):
    if slots:
        self.rtp.write((s["row"], slice(lo, lo + len(slots))), torch.tensor(slots, dtype=torch.int32))


def w_chunk(self, r, n):
    q = self.reqs[r]
    if q["state"] == "waiting":               # the first chunk: the admission, limited to n tokens
        out = self.match(r, limit=n)
        if not out.get("admitted"):
            return out
        prompt, computed = list(q["tokens"]), len(q["slots"])
        sr = sched_req(r, prompt, computed, q["h"], q["hit"], q["rec"], getattr(q["rec"], "swa_uuid_for_lock", None),
                       q["slots"][:q["hit"]])
        kvset(sr, mamba_pool_idx=torch.tensor(q["ms"], dtype=torch.int64))   # its state slot
        s = q["sched"] = {"req": sr, "row": sched_row(self.rtp, sr), "prompt": len(prompt), "computed": computed}
        self.row_write(s, 0, q["slots"][:computed]); sched_len(sr, q["tokens"], computed)
    else:
        s = q["sched"]
        k = min(s["prompt"] - s["computed"], n)
        new = self.allocate(k)
        if new is None:
            print(f"  [{self.core}] chunk refused (pool short)")
            return {"computed": s["computed"], "allocated": False}
        q["slots"] += new
        for p in range(s["computed"], s["computed"] + k):
            self.written[q["slots"][p]] = tuple(q["tokens"][:p + 1])
        self.row_write(s, s["computed"], new); s["computed"] += k
        sched_len(s["req"], q["tokens"], s["computed"])
        self.state_write(q["ms"], tuple(q["tokens"][:s["computed"]]))    # the chunk's forward
    if s["computed"] < s["prompt"]:
        self.publish(q, r)
    return {"computed": s["computed"], "hit": q["hit"]}


def w_publish(self, q, r):    # the scheduler's call after a chunk: insert what is computed, move the lock
    s, sr, c = q["sched"], q["sched"]["req"], self.cache
    old = sr.last_node
    self.publishing = True
    try:
        self.sglang_call(publish_call(c, sr))
    finally:
        self.publishing = False
    if self.fault == "unfinished_lock_not_moved" and sr.last_node is not old:   # ==== PLANTED FAULT: the
        if KV_API:                                                               # lock stays on the old node
            c.unlock(sr.lock); c.lock(old)
        else:
            c.inc_lock_ref(old); rec = kept_uuid(sr)
            c.dec_lock_ref(sr.last_node, *([] if rec is None else [bpc.DecLockRefParams(swa_uuid_for_lock=rec)]))
    q["h"], n = sr.last_node, s["computed"]
    q["slots"] = [int(x) for x in self.rtp.req_to_token[s["row"], :n].tolist()] + q["slots"][n:]
    q["hit"] = protected_len(c, sr)
    skipped = tuple(getattr(getattr(getattr(sr, "lock", None), "receipt", None), "skipped_lock_components", ()) or ())
    node = self.node(q["h"])                  # the mamba reference: on the new last node (its forked state)
    q["mnode"] = node if node is not None and node is not c.root_node and CT.MAMBA not in skipped and \
        (not self.skips or self.val(node, CT.MAMBA) is not None) else None
    print(f"  [{self.core}] SGLang's own publish: {n} tokens, lock now on a {len(self.path_slots(q['h']))}-token "
          f"node, row {q['slots'][:n]}")
    free = self.free_kv()
    for p in range(n):
        if q["slots"][p] in free or self.written.get(q["slots"][p]) != tuple(q["tokens"][:p + 1]):
            self.bugs.append(f"{r}: after publishing its chunk, its row reads position {p} from slot "
                             f"{q['slots'][p]}, which is free or holds other tokens"); break
    self.twin.add(tuple(q["tokens"][:n]))     # a state kept at the inserted key's end


def w_sched_decode(self, r, tok):
    q = self.reqs[r]; s = q["sched"]
    out = self.decode(r, tok)
    if out.get("allocated"):
        self.row_write(s, s["computed"], [q["slots"][s["computed"]]]); s["computed"] += 1
        if OWN_REQ:
            s["req"].output_ids.append(tok)
        sched_len(s["req"], q["tokens"], s["computed"])
    return out


def w_release_sched(self, r, insert):         # SGLang's own release: insert (or not), its frees, unlock
    q = self.reqs[r]; s, sr = q["sched"], q["sched"]["req"]
    fn, insert = release_call(self.cache, sr, q["tokens"], s["prompt"], s["computed"], insert)
    self.sglang_call(fn)
    free_row(self.rtp, sr, s["row"])
    del self.reqs[r]
    if insert:
        self.twin.add(tuple(q["tokens"][:s["computed"]]))
    print(f"  [{self.core}] SGLang's own release ({'insert' if insert else 'no insert'}) of {s['computed']} tokens")
    return {"inserted": insert}


World.sglang_call, World.row_write, World.chunk, World.publish = w_sglang_call, w_row_write, w_chunk, w_publish
World.sched_decode, World.release_sched = w_sched_decode, w_release_sched
'''
