"""The UnifiedRadixCache FULL+MAMBA part of an SGLang reproducer script (repro_classes.py
puts it after the shared prelude of repro_template.py and fills in the @NAME@ fields). It
plays the trace as unified_mamba.py plays SGLang's scheduler, with SGLang's classes only,
on the Python tree core, the Rust one, or both in lockstep (then their results must agree)."""

BODY = r'''
import dataclasses, importlib, importlib.metadata, inspect, re
from array import array
os.environ.setdefault("SGLANG_MAMBA_SSM_DTYPE", "float32")
import sglang.srt.mem_cache.allocator as al
from sglang.srt.mem_cache import base_prefix_cache as bpc
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt import server_args as sa

CORES = @CORES@          # ["python"], ["rust"] or both (a lockstep: every result must agree)
for _m in ("sglang.srt.mem_cache.unified_cache.component_type", "sglang.srt.mem_cache.unified_cache_components"):
    try:
        CT = importlib.import_module(_m).ComponentType; break
    except (ImportError, AttributeError):
        pass
BOTH = ("drop_insert", "insert_shifted_values", "match_overreach", "evict_no_free")


def kw(fn, **k):
    names = inspect.signature(fn).parameters
    return {a: b for a, b in k.items() if a in names}


try:                                          # no server here: a stand-in for the global server args
    from sglang.srt import runtime_context as rctx
    rctx.get_server_args()
except ValueError:                            # 0.5.23: an unresolved ServerArgs, chunk size pre-seeded
    _args = sa.ServerArgs(model_path="cpu-stand-in", device="cpu"); _args._mamba_cache_chunk_size = 64
    rctx.get_context().set_server_args(_args)
except ImportError:
    class _SA: page_size, mamba_cache_chunk_size = 1, 64
    if getattr(sa, "_global_server_args", None) is None:
        sa.set_global_server_args_for_scheduler(_SA())


def fp(prefix):               # what the script writes as "the Mamba state after this prefix"
    return float(hash(prefix) % 16_777_213 + 1)


class ReqStandIn:             # the scheduler's Req as match_prefix(cow_mamba=True) reads it
    def __init__(self):
        self.mamba_pool_idx = self.mamba_cow_src_index = self.lock = self.session = None
        self.mamba_needs_clear = False
    kv = property(lambda self: self)
    holds_mamba = property(lambda self: self.mamba_pool_idx is not None)


class World:
    """One cache on one tree core with its pools, a shadow of every slot and the scheduler's requests."""

    def __init__(self, core, fault):
        self.core, self.fault, self.bugs, self.reqs, self.written, self.mwritten = core, fault, [], {}, {}, {}
        self.twin, self.inserts, self.publishing = set(), 0, False
        self.msize = max(12, CAPACITY // 6)       # as kvcheck's pools: a chunk's checkpoint forks a state
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=2, n_groups=1, num_heads=1, head_dim=1,
                                        state_size=1, conv_kernel=2)
        cp = Mamba2CacheParams(shape=shape, layers=[0], dtype=Mamba2StateDType(conv=torch.float32, temporal=torch.float32))
        self.rtp = HybridReqToTokenPool(**kw(HybridReqToTokenPool.__init__, size=min(8, self.msize), mamba_size=self.msize,
                                             mamba_spec_state_size=self.msize, max_context_len=64, device="cpu",
                                             enable_memory_saver=False, cache_params=cp, mamba_layer_ids=[0],
                                             enable_mamba_extra_buffer=False))
        self.mpool = self.rtp.mamba_pool
        self.mslots = getattr(self.rtp, "mamba_allocator", None) or self.mpool
        self.m_all = {int(x) for x in self.mslots.free_slots.tolist()}
        kv = HybridLinearKVPool(**kw(HybridLinearKVPool.__init__, size=CAPACITY, dtype=torch.float16, page_size=1,
                                     head_num=1, head_dim=2, full_attention_layer_ids=[1], enable_kvcache_transpose=False,
                                     device="cpu", mamba_pool=self.mpool))
        self.alloc = al.TokenToKVPoolAllocator(CAPACITY, torch.float16, "cpu", kv, False)
        names = {f.name for f in dataclasses.fields(CacheInitParams)}
        p = dict(disable=False, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc, page_size=1,
                 tree_components=(CT.FULL, CT.MAMBA), tree_core_backend=core, enable_mamba_extra_buffer=False)
        self.cache = UnifiedRadixCache(CacheInitParams(**{k: v for k, v in p.items() if k in names}))
        self.tree_cores = hasattr(self.cache, "tree_core")     # node handles are ids (0.5.17+)
        self.skips = "skip_lock_node_ids" in {f.name for f in dataclasses.fields(bpc.IncLockRefResult)}
        self.plant()

    # ---- the tree (Python core: nodes; Rust core: what its interface gives) --------------------
    def node(self, h):
        return None if self.core == "rust" else (self.cache.tree_core.node_by_id(h) if self.tree_cores else h)

    def handle(self, n):
        return n.id if self.tree_cores else n

    def tree(self):
        out, stack = [], [(self.cache.root_node, ())]
        while stack:
            n, path = stack.pop()
            for ch in n.children.values():
                k = tuple(int(t) for t in ch.key.token_ids)
                out.append((ch, path, k)); stack.append((ch, path + k))
        return out

    def val(self, n, ct):
        v = n.component_data[ct].value
        return None if v is None else [int(x) for x in v.reshape(-1).tolist()]

    def state_at(self, h):
        if self.core == "rust":
            v = self.cache.tree_core.get_component_device_value(h, CT.MAMBA)
            return None if v is None else int(v.reshape(-1)[0])
        n = self.node(h)
        return None if n is self.cache.root_node or self.val(n, CT.MAMBA) is None else self.val(n, CT.MAMBA)[0]

    def path_slots(self, h):
        if self.core == "rust":
            t = self.cache.tree_core.collect_full_device_indices(h, self.cache.root_node_handle())
            return [int(x) for x in t.tolist()]
        out, n = [], self.node(h)
        while n is not self.cache.root_node:
            out = self.val(n, CT.FULL) + out; n = n.parent
        return out

    def prefixes(self):       # (full-KV prefixes, prefixes ending at a Mamba state); Python core only
        if self.core == "rust":
            return set(), set()
        full, st = set(), set()
        for n, path, k in self.tree():
            if self.val(n, CT.FULL) is not None:
                full |= {(path + k)[:e] for e in range(len(path) + 1, len(path) + len(k) + 1)}
            if self.val(n, CT.MAMBA) is not None:
                st.add(path + k)
        return full, st

    def free_kv(self):
        return {int(x) for t in (self.alloc.free_pages, getattr(self.alloc, "release_pages", None)) if t is not None for x in t.tolist()}

    def free_m(self):
        return {int(x) for x in self.mslots.free_slots.tolist()}

    def holds(self, slot, prefix):
        t = self.mpool.mamba_cache.temporal
        return all(float(t[i].flatten(1)[slot, 0]) == fp(prefix) for i in range(t.shape[0])) and self.mwritten.get(slot) == prefix

    # ---- planted faults (kvcheck negative controls, not SGLang's code) -------------------------
    def plant(self):
        c, f = self.cache, self.fault
        if f == "lock_ref_leak":              # ==== PLANTED FAULT: a released node keeps one full reference
            real = c.dec_lock_ref
            def dec(h, *a, **k):
                out = real(h, *a, **k); n = self.node(h)
                if n is not None and n is not c.root_node: n.component_data[CT.FULL].lock_ref += 1
                return out
            c.dec_lock_ref = dec
        if f == "mamba_lock_leak":            # ==== PLANTED FAULT: a released hit node keeps one mamba reference
            real_m = c.dec_lock_ref
            def dec_m(h, *a, **k):
                out = real_m(h, *a, **k); n = self.node(h)
                if n is not None and n is not c.root_node: n.component_data[CT.MAMBA].lock_ref += 1
                return out
            c.dec_lock_ref = dec_m
        if f == "mamba_evict_locked_state":   # ==== PLANTED FAULT: evict also tombstones a mamba-locked state
            real_ms = c.evict
            def ev_m(*a):
                out = real_ms(*a)
                lk = [n for n, _, _ in self.tree() if n.component_data[CT.MAMBA].lock_ref > 0
                      and n.component_data[CT.MAMBA].value is not None]
                if lk:
                    cd = lk[-1].component_data[CT.MAMBA]; self.mslots.free(cd.value.reshape(-1)); cd.value = None
                return out
            c.evict = ev_m
        if f in ("evict_locked", "evict_no_free"):   # ==== PLANTED FAULT around evict
            real_ev = c.evict
            def ev(*a):
                if f == "evict_no_free":      # deletes nodes without freeing their KV slots: every free path,
                    saved = []                # the allocator's and the bound frees components keep (0.5.12)
                    for o in [self.alloc] + list(c.components.values()):
                        for nm in {"free"} | {k for k in vars(o) if k.startswith("_free")}:
                            if callable(getattr(o, nm, None)):
                                saved.append((o, nm, nm in vars(o), vars(o).get(nm))); setattr(o, nm, lambda *x, **k: None)
                    try: return real_ev(*a)
                    finally:
                        for o, nm, had, fn in reversed(saved):
                            setattr(o, nm, fn) if had else delattr(o, nm)
                out = real_ev(*a)              # evict_locked: also frees and unlinks the deepest locked leaf
                lk = [n for n, _, _ in self.tree() if n.component_data[CT.FULL].lock_ref > 0 and not n.children]
                if lk:
                    self.alloc.free(lk[0].component_data[CT.FULL].value)
                    lk[0].parent.children = {k: ch for k, ch in lk[0].parent.children.items() if ch is not lk[0]}
                return out
            c.evict = ev
        if f == "mamba_state_dropped_on_insert":     # ==== PLANTED FAULT: a tombstone keeps no state on insert
            comp = c.components[CT.MAMBA]; real_c = comp.commit_insert_component_data; sig = inspect.signature(real_c)
            def commit(*a, **k):
                b = sig.bind(*a, **k).arguments
                if self.publishing:           # a chunk's forked state, not a finished request's
                    return real_c(*a, **k)
                if not b["is_new_leaf"] and b["node"].component_data[CT.MAMBA].value is None:
                    b["result"].mamba_exist = True; return None
                return real_c(*a, **k)
            comp.commit_insert_component_data = commit

    # ---- the scheduler's side ---------------------------------------------------------------
    def evict(self, n, m):
        snap = self.snap()
        r = self.cache.evict(bpc.EvictParams(num_tokens=n, mamba_num=m))
        self.forget(*snap)
        return (r.num_tokens_evicted, r.mamba_num_evicted)

    def locked(self):
        return set() if self.core == "rust" else \
            {path + k for n, path, k in self.tree() if n.component_data[CT.FULL].lock_ref > 0}

    def snap(self):           # what forget() compares against: prefixes, locked ones, nodes with a state
        had = set() if self.core == "rust" else {id(n) for n, _, _ in self.tree() if self.val(n, CT.MAMBA) is not None}
        return self.prefixes() + (self.locked(), had)

    def forget(self, full0, st0, locked, had):
        full1, st1 = self.prefixes()
        self.twin -= (full0 - full1) | (st0 - st1)
        if (full0 - full1) & locked:
            self.bugs.append("an eviction removed a node a running request has locked")
        for rid, q in self.reqs.items():       # a state that was there may not go (a locked tombstone may stay one)
            if q.get("mnode") is not None and id(q["mnode"]) in had and self.val(q["mnode"], CT.MAMBA) is None:
                self.bugs.append(f"{rid}'s mamba-locked node lost its state")

    def allocate(self, n):
        out = self.alloc.alloc(n)
        if out is None:
            self.evict(n - self.alloc.available_size(), 0); out = self.alloc.alloc(n)
        return None if out is None else [int(x) for x in out.tolist()]

    def mamba_slot(self):
        out = self.mslots.alloc(1)
        if out is None:
            self.evict(0, 1); out = self.mslots.alloc(1)
        return None if out is None else int(out[0])

    def state_write(self, slot, prefix):
        self.mpool.mamba_cache.temporal[:, slot] = fp(prefix); self.mwritten[slot] = prefix

    def deepest(self, toks):
        n, p = self.cache.root_node, 0
        while True:
            nxt = next((c for c in n.children.values() if [int(t) for t in c.key.token_ids] == toks[p:p + len(c.key)]), None)
            if nxt is None: return self.handle(n), p
            n, p = nxt, p + len(nxt.key)

    def match(self, r, limit=None):          # limit: a chunk's admission computes that many tokens
        q, sr = self.reqs[r], ReqStandIn()
        toks = q["tokens"]
        snap = self.snap()
        m = self.cache.match_prefix(bpc.MatchPrefixParams(key=RadixKey(array("q", toks[:-1])), cow_mamba=True, req=sr))
        self.forget(*snap)
        hit = m.device_prefix_len if hasattr(m, "device_prefix_len") else len(m.device_indices)
        h = m.last_device_node
        if self.fault == "mamba_hit_without_state":   # ==== PLANTED FAULT: the deepest matched node, state or not
            h, hit = self.deepest(toks[:-1])
        if self.fault in ("match_overreach",) and hit:   # ==== PLANTED FAULT: one token more than the path
            hit += 1
        ms, src = (None if sr.mamba_pool_idx is None else int(sr.mamba_pool_idx)), self.state_at(h)
        if ms is not None and src is not None and sr.mamba_cow_src_index is None:
            self.mwritten[ms] = self.mwritten.get(src, ())   # 0.5.11-0.5.12 copy inside match_prefix
        path = self.path_slots(h)
        print(f"  [{self.core}] match_prefix: hit {hit} of {len(toks)}; path slots {path}; state slot {src}")
        free = self.free_kv()
        if hit > len(toks) - 1 or len(path) != hit:
            self.bugs.append(f"{r}: hit {hit}, its matched path holds {len(path)} slots"); return {}
        for p in range(hit):
            if path[p] in free or self.written.get(path[p]) != tuple(toks[:p + 1]):
                self.bugs.append(f"{r}: hit {hit} reads full KV of position {p} from slot {path[p]}, not its prefix"); return {}
        if hit and (src is None or src in self.free_m() or not self.holds(src, tuple(toks[:hit]))):
            self.bugs.append(f"{r}: hit {hit} resumes from the Mamba state at its node ({src}), which is missing or "
                             f"not the state after exactly {hit} tokens"); return {}
        want = max((len(k) for k in self.twin if len(k) < len(toks) and tuple(toks[:len(k)]) == k), default=0)
        if self.core != "rust" and want > hit:
            self.bugs.append(f"{r}: an inserted, never evicted key gives a {want}-token hit; the tree matched {hit}"); return {}
        node = self.node(h)
        mnode = node if node is not None and node is not self.cache.root_node and \
            (not self.skips or self.val(node, CT.MAMBA) is not None) else None
        rec = self.cache.inc_lock_ref(h)
        q["mnode"] = mnode                    # held from here: the allocations below may evict
        ms = self.mamba_slot() if ms is None else ms
        need = len(toks) - hit if limit is None else min(len(toks) - hit, limit)
        new = None if ms is None else self.allocate(need)
        if new is None:
            q["mnode"] = None
            if ms is not None: self.mslots.free(torch.tensor([ms], dtype=torch.int64))
            self.cache.dec_lock_ref(h, rec.to_dec_params() if hasattr(rec, "to_dec_params") else
                                    bpc.DecLockRefParams(swa_uuid_for_lock=getattr(rec, "swa_uuid_for_lock", None)))
            print(f"  [{self.core}] admission refused"); return {"hit": hit, "admitted": False}
        if sr.mamba_cow_src_index is not None:   # 0.5.23: the forward's deferred copy-on-write
            s = int(sr.mamba_cow_src_index.reshape(-1)[0])
            self.mpool.copy_from(sr.mamba_cow_src_index.reshape(-1), torch.tensor([ms], dtype=torch.int64))
            self.mwritten[ms] = self.mwritten.get(s, ())
        if hit and not self.holds(ms, tuple(toks[:hit])):
            self.bugs.append(f"{r}: the state copied into its slot {ms} is not the state after its {hit}-token prefix")
            return {}
        self.state_write(ms, tuple(toks[:hit + need]))    # prefill runs the rest (or a chunk)
        q.update(state="running", h=h, hit=hit, rec=rec, ms=ms, mnode=mnode, slots=path + new)
        for p in range(hit, hit + need):
            self.written[q["slots"][p]] = tuple(toks[:p + 1])
        return {"hit": hit, "admitted": True}

    def decode(self, r, tok):
        q = self.reqs[r]
        if len(q["tokens"]) >= MAX_TOKENS: return {}
        new = self.allocate(1)
        if new is None: return {"allocated": False}
        q["tokens"].append(tok); q["slots"] += new
        self.written[new[0]] = tuple(q["tokens"]); self.state_write(q["ms"], tuple(q["tokens"]))
        return {"allocated": True}

    def unlock(self, q):
        rec = q["rec"]
        self.cache.dec_lock_ref(q["h"], rec.to_dec_params() if hasattr(rec, "to_dec_params") else
                                bpc.DecLockRefParams(swa_uuid_for_lock=getattr(rec, "swa_uuid_for_lock", None)))

    def finish(self, r):
        q = self.reqs.pop(r)
        toks, ms, n = q["tokens"], q["ms"], len(q["tokens"])
        vals, mv = torch.tensor(q["slots"][:n], dtype=torch.int64), torch.tensor([ms], dtype=torch.int64)
        if self.fault == "insert_shifted_values":   # ==== PLANTED FAULT: values stored shifted by one
            vals = torch.roll(vals, 1)
        self.inserts += 1
        if (self.fault == "drop_insert" and self.inserts % 2 == 0) or \
                (self.fault == "core_drops_insert" and self.inserts % 3 == 0):   # ==== PLANTED FAULT: insert declined
            self.alloc.free(torch.tensor(q["slots"][q["hit"]:n], dtype=torch.int64)); plen, exist = n, True
        else:
            res = self.cache.insert(bpc.InsertParams(key=RadixKey(array("q", toks)), value=vals, mamba_value=mv,
                                                     prev_prefix_len=q["hit"]))
            plen, exist = res.prefix_len, res.mamba_exist
        if self.fault == "mamba_state_freed_on_insert" and not exist:   # ==== PLANTED FAULT: the caller frees
            exist = True                                               # the state slot the tree took
        if exist:
            self.mslots.free(mv)
        self.unlock(q)
        self.twin.add(tuple(toks))
        print(f"  [{self.core}] insert of {n} tokens: the tree had {plen}; state already there: {bool(exist)}")
        return {"prefix_len": plen, "mamba_exist": bool(exist)}

    def abort(self, r):
        q = self.reqs.pop(r)
        if q["state"] == "running":
            if self.fault != "mamba_state_leaked_on_abort":   # ==== PLANTED FAULT: the state slot never freed
                self.mslots.free(torch.tensor([q["ms"]], dtype=torch.int64))
            self.alloc.free(torch.tensor(q["slots"][q["hit"]:], dtype=torch.int64))
            self.unlock(q)
        return {}
'''
