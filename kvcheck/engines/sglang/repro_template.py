"""The text of an SGLang reproducer script (reproducer.py fills in the @NAME@ fields):
its prelude, the CPU stand-ins (repro_stubs.py), then the driver: the cache on its
allocator, how it reads the tree and the pools (repro_views.py), the caller's side of
each operation, the conditions after every step."""
from .repro_stubs import STAND_INS
from .repro_views import VIEWS

_PRELUDE = r'''# Needs only SGLang (the caches run on CPU, no model, no GPU). Exit 1: the bug is present;
# exit 0: fixed (or not this release). Prints every step, each hit, the tree and the pool.
import dataclasses, importlib.abc, importlib.machinery, importlib.util, inspect, os, re, sys, types
from array import array

RECORDED_RELEASE, CLASS, PAGE, WINDOW, CAPACITY = @RELEASE@, @CLASS@, @PAGE@, @WINDOW@, @CAPACITY@
MAX_TOKENS, CHECK, STEPS = @MAX_TOKENS@, @CHECK@, @STEPS@
FAULT = None if "--clean" in sys.argv else @FAULT@


'''

_DRIVER_HEAD = r'''
import importlib.metadata
import sglang.srt.mem_cache.allocator as al
from sglang.srt.mem_cache import base_prefix_cache as bpc
from sglang.srt.mem_cache import radix_cache as rc
mod = importlib.import_module("sglang.srt.mem_cache." + ("radix_cache" if CLASS == "RadixCache" else "swa_radix_cache"))
Cache = getattr(mod, CLASS)
PARAMS_API = hasattr(bpc, "MatchPrefixParams")      # *Params objects (0.5.8+)
SWA = CLASS == "SWARadixCache"


def new_alloc(cls, *args):
    return cls(*args, False) if "need_sort" in inspect.signature(cls.__init__).parameters else cls(*args)


def first(name, *mods):                     # classes moved between releases
    for m in mods:
        try:
            return getattr(importlib.import_module(m), name)
        except (ImportError, AttributeError):
            pass


def kw(fn, **k):                             # the keyword arguments this release's constructor takes
    ps = inspect.signature(fn).parameters
    return {a: v for a, v in k.items() if a in ps}


if SWA:
    SWAKVPool = first("SWAKVPool", "sglang.srt.mem_cache.swa_memory_pool", "sglang.srt.mem_cache.memory_pool")
    SWAAlloc = first("SWATokenToKVPoolAllocator", "sglang.srt.mem_cache.allocator.swa",
                     "sglang.srt.mem_cache.swa_memory_pool", "sglang.srt.mem_cache.allocator")
    SIZE_SWA = max(2 * WINDOW, CAPACITY // 2)
    pool = SWAKVPool(**kw(SWAKVPool.__init__, size=CAPACITY, size_swa=SIZE_SWA, page_size=1, dtype=torch.float16,
                          head_num=1, head_dim=2, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
                          enable_kvcache_transpose=False, device="cpu"))
    alloc = SWAAlloc(**kw(SWAAlloc.__init__, size=CAPACITY, size_swa=SIZE_SWA, page_size=1, dtype=torch.float16,
                          device="cpu", kvcache=pool, need_sort=False))
elif PAGE == 1:
    alloc = new_alloc(al.TokenToKVPoolAllocator, CAPACITY, torch.int64, "cpu", None)
else:
    alloc = new_alloc(al.PagedTokenToKVPoolAllocator, CAPACITY, PAGE, torch.int64, "cpu", None)
if "params" in inspect.signature(Cache.__init__).parameters:       # 0.5.6+: CacheInitParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    if SWA and PARAMS_API:                   # 0.5.8+: the window inside CacheInitParams
        cache = Cache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                      page_size=PAGE, sliding_window_size=WINDOW))
    else:
        p = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PAGE)
        cache = Cache(p, sliding_window_size=WINDOW) if SWA else Cache(p)
else:
    cache = Cache(req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PAGE, disable=False,
                  **({"sliding_window_size": WINDOW} if SWA else {}))
root = cache.root_node
RK = getattr(rc, "RadixKey", None)


def key(tokens):
    return list(tokens) if RK is None else RK(array("q", tokens) if PARAMS_API else list(tokens))


def lock_ref(n):
    return n.full_lock_ref if SWA else n.lock_ref


# ---- the caller's side, as SGLang's scheduler drives the tree -------------------------------
reqs, written, written_swa, twin, bugs, inserts = {}, {}, {}, set(), [], [0]


'''

_DRIVER_TAIL = r'''def free(slots):
    if slots:
        alloc.free(torch.tensor(slots, dtype=torch.int64))


def swa_evict(full, swa):
    if PARAMS_API:
        cache.evict(bpc.EvictParams(num_tokens=full, swa_num_tokens=swa))
    else:
        cache.evict(full, swa)


def evict(n):
    before = prefixes()
    locked = {path + tuple(int(t) for t in nd.key) for nd, path in tree() if lock_ref(nd) > 0}
    if SWA:                                  # explicit eviction asks SWA tokens only (tombstones)
        swa_evict(0, n)
    elif PARAMS_API:
        cache.evict(bpc.EvictParams(num_tokens=n))
    else:
        cache.evict(n)
    gone = before - prefixes()
    twin.difference_update(gone)
    if gone & locked:
        bugs.append(f"evict({n}) removed a node a running request has locked")
    print(f"  evict({n}): {len(gone)} cached prefixes gone")


if FAULT in ("evict_locked", "evict_no_free"):    # ==== PLANTED FAULT: a wrapper around cache.evict
    _evict_real = cache.evict
    def _evict(*a, **kw):
        if FAULT == "evict_no_free":         # deletes nodes without freeing their slots
            real = {k: getattr(alloc, k) for k in ("free", "free_segment", "free_swa") if hasattr(alloc, k)}
            for k in real: setattr(alloc, k, lambda *x, **kw: None)
            try: return _evict_real(*a, **kw)
            finally:
                for k, fn in real.items(): setattr(alloc, k, fn)
        out = _evict_real(*a, **kw)          # evict_locked: also frees and deletes the deepest locked leaf
        lk = [nd for nd, _ in tree() if lock_ref(nd) > 0 and not nd.children]
        if lk:
            alloc.free(lk[0].value); cache._delete_leaf(lk[0])
        return out
    cache.evict = _evict


def avail():
    return (alloc.full_available_size(), alloc.swa_available_size()) if SWA else (alloc.available_size(),)


def allocate(n):
    if n == 0:
        return []
    out = alloc.alloc(n)
    if out is None:
        if SWA:
            cache_evict_need = (max(0, n - alloc.full_available_size()), max(0, n - alloc.swa_available_size()))
            before = prefixes()
            locked = {path + tuple(int(t) for t in nd.key) for nd, path in tree() if lock_ref(nd) > 0}
            swa_evict(*cache_evict_need)
            gone = before - prefixes(); twin.difference_update(gone)
            if gone & locked:
                bugs.append(f"eviction for {n} slots removed a node a running request has locked")
        else:
            evict(n - alloc.available_size())
        out = alloc.alloc(n)
    return None if out is None else [int(x) for x in out.tolist()]


def match(r, limit=None):
    q = reqs[r]
    toks = q["tokens"][:-1]
    W = getattr(cache, "sliding_window_size", None)
    if FAULT == "match_ignores_tombstones":  # ==== PLANTED FAULT: one live SWA token past a tombstone will do
        cache.sliding_window_size = 1
    try:
        m = cache.match_prefix(bpc.MatchPrefixParams(key=key(toks)) if PARAMS_API else key(toks))
    finally:
        if W is not None: cache.sliding_window_size = W
    hit = m.device_prefix_len if hasattr(m, "device_prefix_len") else len(m.device_indices)
    node = m.last_device_node
    if FAULT == "match_overreach" and hit:   # ==== PLANTED FAULT: one page more than the path holds
        hit += PAGE
    path = path_slots(node)
    print(f"  match_prefix: hit {hit} of {len(q['tokens'])} tokens; path slots {path}")
    full_free, swa_free = free_sets()
    if hit % PAGE or hit > len(q["tokens"]) - 1 or len(path) != hit:
        bugs.append(f"{r}: hit {hit}, but its matched path holds {len(path)} slots")
    else:
        for p in range(0, hit):
            if path[p] in full_free or written.get(path[p]) != tuple(q["tokens"][:p + 1]):
                bugs.append(f"{r}: hit {hit} reads position {p} from slot {path[p]}, which does not hold its prefix")
                break
        for p in range(max(0, hit - (WINDOW or 0)), hit) if SWA else ():
            s = swa_of(path[p])
            if s <= 0 or s in swa_free or written_swa.get(s) != tuple(q["tokens"][:p + 1]):
                bugs.append(f"{r}: hit {hit} needs the SWA KV of position {p} (window {WINDOW}); it is not live")
                break
    want = 0
    for end in range(PAGE, len(q["tokens"]), PAGE):
        if tuple(q["tokens"][:end]) not in twin: break
        want = end
    present = len(path) if not SWA else want_present(q["tokens"])
    if want > (present if SWA else hit):
        bugs.append(f"{r}: every prefix inserted and not evicted gives {want} tokens, the tree matched {hit}")
    if bugs:
        return
    rec = cache.inc_lock_ref(node)
    uuid = rec.swa_uuid_for_lock if SWA and PARAMS_API else rec    # SWA: the receipt dec_lock_ref replays
    need = len(q["tokens"]) - hit            # all of the prompt, or (chunked prefill) its first chunk
    if limit is not None:
        need = min(need, -(-limit // PAGE) * PAGE)
    new = allocate(need if SWA else -(-need // PAGE) * PAGE)
    if new is None:
        unlock(node, uuid)
        print("  admission refused (pool short after eviction)")
        return
    q.update(node=node, hit=hit, state="running", receipt=uuid, lockrec=rec, slots=path + new[:need], spare=new[need:])
    for p in range(hit, hit + need):
        write(q, p, q["slots"][p])
    print(f"  admitted: locked the node, slots {q['slots']}")


def unlock(node, receipt):
    if not SWA:
        cache.dec_lock_ref(node)
    elif PARAMS_API:
        cache.dec_lock_ref(node, bpc.DecLockRefParams(swa_uuid_for_lock=receipt))
    else:
        cache.dec_lock_ref(node, receipt)


def want_present(tokens):
    node, p, n = root, 0, 0
    while True:
        nxt = next((c for c in node.children.values() if p < len(tokens) - 1 and [int(t) for t in c.key][:1] == tokens[p:p + 1]), None)
        if nxt is None: return n
        k = [int(t) for t in nxt.key]; m = 0
        while m < len(k) and p + m < len(tokens) - 1 and k[m] == tokens[p + m]: m += 1
        n += m; p += m
        if m < len(k): return n
        node = nxt


def write(q, p, slot):
    written[slot] = tuple(q["tokens"][:p + 1])
    if SWA:
        written_swa[swa_of(slot)] = written[slot]


def decode(r, tok):
    q = reqs[r]
    if len(q["tokens"]) >= MAX_TOKENS:
        return
    if not q["spare"]:
        new = allocate(PAGE)
        if new is None:
            print("  decode refused (pool short)"); return
        q["spare"] = new
    q["tokens"].append(tok)
    s = q["spare"].pop(0); q["slots"].append(s); write(q, len(q["tokens"]) - 1, s)
    if q.get("sched"):                       # the scheduler path: the row and lengths follow
        row_write(q, q["sched"]["computed"], [s]); q["sched"]["computed"] += 1
        if OWN_REQ:
            q["sched"]["req"].output_ids.append(tok)
        set_len(q)


def finish(r):
    q = reqs.pop(r)
    n = len(q["tokens"]) // PAGE * PAGE
    vals = torch.tensor(q["slots"][:n], dtype=torch.int64)
    if FAULT == "insert_shifted_values":     # ==== PLANTED FAULT: values stored shifted by one
        vals = torch.roll(vals, 1)
    declined = False
    if FAULT == "drop_insert":               # ==== PLANTED FAULT: every other insert declined
        inserts[0] += 1; declined = inserts[0] % 2 == 0
    if SWA:
        if declined:
            free(q["slots"][q["hit"]:n]); plen = n
        elif PARAMS_API:                     # SWARadixCache.insert frees its duplicates itself
            plen = cache.insert(bpc.InsertParams(key=key(q["tokens"][:n]), value=vals,
                                                 prev_prefix_len=q["hit"])).prefix_len
        else:
            plen = int(cache.insert(key(q["tokens"][:n]), vals, q["hit"]))
        unlock(q["node"], q["receipt"])
    else:
        if declined:
            plen = n
        elif PARAMS_API:
            plen = cache.insert(bpc.InsertParams(key=key(q["tokens"][:n]), value=vals)).prefix_len
        else:
            plen = int(cache.insert(key(q["tokens"][:n]), vals))
        free(q["slots"][q["hit"]:plen])      # the duplicates of what the tree had
        free(q["slots"][n:] + q["spare"])    # past the key
        cache.dec_lock_ref(q["node"])
    for end in range(PAGE, n + 1, PAGE):
        twin.add(tuple(q["tokens"][:end]))
    print(f"  insert of {n} tokens: the tree had {plen}")


def abort(r):
    q = reqs.pop(r)
    if q["state"] == "running":
        free(q["slots"][q["hit"]:] + q["spare"])
        unlock(q["node"], q["receipt"])


@SCHED@if FAULT == "lock_ref_leak":                 # ==== PLANTED FAULT: a released node keeps one reference
    _dec_real = cache.dec_lock_ref
    def _dec(node, *rest, **kw):
        out = _dec_real(node, *rest, **kw)
        if node is not root:
            if SWA: node.full_lock_ref += 1
            else: node.lock_ref += 1
        return out
    cache.dec_lock_ref = _dec


# ---- the conditions, after every step --------------------------------------------------------
def check_state():
    nodes = tree()
    holders, swa_holders = {}, {}
    for rid, q in reqs.items():
        if q["state"] != "running": continue
        n, swa_on = q["node"], True
        while n is not root:
            if n.parent is None or not any(c is n for c in n.parent.children.values()):
                bugs.append(f"{rid} holds a node that is no longer in the tree"); return
            holders[id(n)] = holders.get(id(n), 0) + 1
            if SWA and swa_on:
                swa_holders[id(n)] = swa_holders.get(id(n), 0) + 1
                swa_on = not (q["receipt"] and n.swa_uuid == q["receipt"])
            n = n.parent
    full_free, swa_free = free_sets()
    for rid, q in reqs.items():              # a running request's prefix stays live under its lock
        for p in range(q["hit"]) if q["state"] == "running" else ():
            if q["slots"][p] in full_free or written.get(q["slots"][p]) != tuple(q["tokens"][:p + 1]):
                bugs.append(f"{rid} holds position {p} (slot {q['slots'][p]}), which was freed or overwritten "
                            "under its lock"); break
    for node, path in nodes:
        got = (lock_ref(node), node.swa_lock_ref) if SWA else (node.lock_ref,)
        want = (holders.get(id(node), 0), swa_holders.get(id(node), 0)) if SWA else (holders.get(id(node), 0),)
        if got != want:
            bugs.append(f"node at depth {len(path)}: lock_ref {got}, running requests holding it {want}")
        for i, s in enumerate(int(v) for v in node.value.tolist()):
            pre = (path + tuple(int(t) for t in node.key))[:len(path) + i + 1]
            if s in full_free or written.get(s) != pre:
                bugs.append(f"tree position {len(path) + i} is in slot {s}, which is free or holds other tokens")
                break
    total = sum(len(n.value) for n, _ in nodes)
    if SWA:
        ev_prot = cache.full_evictable_size() + cache.full_protected_size()
    else:
        ev_prot = cache.evictable_size() + cache.protected_size()
    if ev_prot != total:
        bugs.append(f"evictable + protected = {ev_prot}, the tree holds {total} tokens")
    own = [s for q in reqs.values() if q["state"] == "running" for s in q["slots"][q["hit"]:] + q["spare"]]
    owned = [int(v) for n, _ in nodes for v in n.value.tolist()] + own
    if PAGE > 1:
        owned = sorted({p * PAGE + i for p in {s // PAGE for s in owned} for i in range(PAGE)})
    allslots = set(range(1, CAPACITY + 1)) if PAGE == 1 else set(range(PAGE, (alloc.num_pages + 1) * PAGE))
    seen = owned + sorted(full_free)
    if len(seen) != len(set(seen)) or set(seen) != allslots:
        bugs.append(f"{len(owned)} slots owned + {len(full_free)} free of {len(allslots)}: "
                    f"{len(seen) - len(set(seen))} counted twice, {len(allslots - set(seen))} leaked")
    idle = not any(q["state"] == "running" for q in reqs.values())
    if hasattr(cache, "sanity_check") and (idle or not SWA):
        try:
            cache.sanity_check()
        except Exception as e:
            # before 0.5.5 SWARadixCache's check rebuilds the LRU order from wall-clock stamps (a
            # parent 0.1 ms before its child): it fails whenever steps come faster than that
            wallclock = SWA and not hasattr(mod.TreeNode, "last_access_time_counter_float")
            if not (wallclock and "Incorrect LRU list" in str(e)) or CHECK == "tree_sanity_check":
                bugs.append(f"SGLang's own sanity_check: {e}")


def show():
    for node, path in sorted(tree(), key=lambda x: x[1]):
        tomb = " tombstone" if getattr(node, "swa_tombstone", False) else ""
        locks = f"lock {lock_ref(node)}" + (f"/swa {node.swa_lock_ref}" if SWA else "")
        print(f"    node depth {len(path)}: key {[int(t) for t in node.key]} slots {[int(v) for v in node.value.tolist()]} {locks}{tomb}")
    print(f"    available slots {avail()}")


print(f"SGLang {importlib.metadata.version('sglang')} (finding recorded on {RECORDED_RELEASE}); {CLASS}, page {PAGE}, "
      f"window {WINDOW}, {CAPACITY} slots; fault {FAULT}")
for n, (action, p) in enumerate(STEPS):
    print(f"step {n}: {action} {p}")
    r = p.get("r")
    if action in ("submit", "match", "chunk") and "tokens" in p and r not in reqs:
        reqs[r] = {"tokens": list(p["tokens"]), "state": "waiting", "spare": [], "slots": [], "hit": 0, "receipt": None,
                   "sched": None}
    q = reqs.get(r, {})
    mid = bool(q.get("sched")) and q["sched"]["computed"] < q["sched"]["prompt"]
    if action == "match" and q.get("state") == "waiting":
        match(r)
    elif action == "chunk" and (q.get("state") == "waiting" or mid):
        chunk(r, p["n"])
    elif action == "decode" and q.get("state") == "running" and not mid:
        for t in p.get("toks", [p.get("tok")]):
            decode(r, t)
    elif action == "finish" and q.get("state") == "running" and not mid:
        release_sched(r, True) if q.get("sched") else finish(r)
    elif action == "abort" and r in reqs:
        if q.get("sched"):
            if OWN_REQ or takes(cache.cache_finished_req, "is_insert") or not mid:
                release_sched(r, False)
        else:
            abort(r)
    elif action == "evict":
        evict(p["n"])
    if not bugs:
        check_state()
    if bugs:
        show()
        print("BUG: " + "; ".join(dict.fromkeys(bugs)))
        sys.exit(1)
show()
print("OK: every condition holds on every step (fixed, or not this release)")
sys.exit(0)
'''

TEMPLATE = _PRELUDE + STAND_INS + _DRIVER_HEAD + VIEWS + _DRIVER_TAIL
