"""The fixed part of a standalone vLLM reproducer (reproducer.py writes the data above it).

It is the adapter's content model in miniature, in plain code on vLLM's public classes: what
every block will hold once the forward that writes it runs (HOLDS), what its bytes hold now
(READY: written by a forward that ran), what each prefix-cache key fingerprints (KEYS), and the
finding's one condition (CHECK) evaluated in the open, with the hit lengths and block tables
printed. No kvcheck import: a maintainer runs it with vLLM alone.
"""

BODY = r'''
def cdiv(a, b):
    return -(-a // b)


def build():
    groups = []
    for i, ((mod, cls, kw), gkw) in enumerate(zip(SPECS, GROUP_KW)):
        try:
            spec_cls = C(mod, cls)
        except (ImportError, AttributeError):
            print(f"CANNOT PLAY: this vLLM has no {mod}.{cls} (group {i})")
            sys.exit(2)
        spec = spec_cls(**fit(spec_cls, kw))
        groups.append(kci.KVCacheGroupSpec(**fit(kci.KVCacheGroupSpec, {"layer_names": [f"layer{i}"],
                                                                          "kv_cache_spec": spec, **gkw})))
    cfg = kci.KVCacheConfig(**fit(kci.KVCacheConfig, {"num_blocks": NUM_BLOCKS, "kv_cache_tensors": [],
                                                      "kv_cache_groups": groups, **CONFIG_KW}))
    return KVCacheManager(cfg, **fit(KVCacheManager, MANAGER_KW))


ku.init_none_hash(sha256)
mgr = build()
if "--clean" not in sys.argv:
    plant(mgr)
pool, coord = mgr.block_pool, mgr.coordinator
ALIGN = int(getattr(coord, "_cache_hit_alignment_tokens", 0) or SCHED_BLOCK)
hasher = ku.get_request_block_hasher(HASH_BLOCK, sha256)
EOS = {"eos_token_id": None} if "eos_token_id" in inspect.signature(Request).parameters else {}
reqs, OWNED, RESUMED = {}, {}, {}   # rid -> Request; its own blocks per group; the hit it resumed from
HOLDS, READY, KEYS = {}, {}, {}     # block -> content it will hold / its bytes hold; key -> content
STEP = None                         # an open scheduler step: what it schedules, its copies
RETAINED = []                       # the queued copies' endpoints, freed when scheduling ends
STAMP = []                          # (request, tokens before) scheduled by the current action
bugs = []


def content(o, n):
    return (o.cache_salt, tuple(o.all_token_ids[:n]))


def holds(w, want, exact):
    """A state block holds exactly `want`; a KV block a prefix that extends it."""
    if exact or w is None:
        return w == want
    return w[0] == want[0] and len(w[1]) >= len(want[1]) and w[1][:len(want[1])] == want[1]


def table(g, rid):
    return coord.single_type_managers[g].req_to_blocks.get(rid, [])


def ids(lst):
    return ["null" if b.is_null else b.block_id for b in lst]


def tables(rid):
    return " | ".join(f"g{g} {GROUPS[g][0]}: {ids(table(g, rid))}" for g in range(len(GROUPS)))


def group_hash(o, g, i):
    bs = GROUPS[g][1]
    if (i + 1) * bs // HASH_BLOCK > len(o.block_hashes):
        return None
    return o.block_hashes[i] if bs == HASH_BLOCK else ku.BlockHashListWithBlockSize(o.block_hashes, HASH_BLOCK, bs)[i]


def note_keys(o):
    """What each of the request's prefix-cache keys fingerprints (its tokens)."""
    hs = o.block_hashes
    for j, h in enumerate(hs):
        KEYS.setdefault(bytes(h), content(o, (j + 1) * HASH_BLOCK))
    for g, (_, bs, _) in enumerate(GROUPS):
        if bs != HASH_BLOCK:
            for i in range(len(hs) * HASH_BLOCK // bs):
                KEYS.setdefault(bytes(group_hash(o, g, i)), content(o, (i + 1) * bs))


def cached(g, key):
    return pool.cached_block_hash_to_block.get_one_block(ku.make_block_hash_with_group_id(key, g))


def stamp(o, lo, n):
    """allocate_slots scheduled tokens [lo, n): the blocks the request allocated will hold them
    once the forward runs (a Mamba group: the state after n tokens, in block cdiv(n, b) - 1)."""
    rid = o.request_id
    for g, (kind, bs, _) in enumerate(GROUPS):
        t = table(g, rid)
        for i in ([cdiv(n, bs) - 1] if kind == "mamba" else [] if kind == "tail_ring" else range(lo // bs, cdiv(n, bs))):
            if 0 <= i < len(t) and not t[i].is_null and t[i].block_id in OWNED[rid][g]:
                HOLDS[t[i].block_id] = content(o, n if kind == "mamba" else min((i + 1) * bs, n))


def own(rid, new):
    for g, lst in enumerate(new.blocks):
        OWNED[rid][g].update(b.block_id for b in lst if not b.is_null)
        for b in lst:
            READY.pop(b.block_id, None)       # a fresh allocation: nothing of it is written yet


def maybe_sample(o, tok=None):
    if o.num_computed_tokens == o.num_tokens and o.num_tokens < MAX_TOKENS:
        o.append_output_token_ids(tok if tok is not None else (o.num_tokens * 7) % VOCAB)


def scheduled(o, lo, tok, stamp_from=None):
    """In the open step; what it will hold is stamped once the step's queued copies are taken
    (a copy's destination first receives the copy, then the forward's writes)."""
    STEP["sched"][o.request_id] = (lo, o.num_computed_tokens, tok)
    STAMP.append((o, lo if stamp_from is None else stamp_from))


def claim(src, dst):
    """What a copy's destination must hold: the state / prefix its holder resumes from, or what
    the key of a moved cache entry fingerprints."""
    for rid, o in reqs.items():
        for g, (kind, _, _) in enumerate(GROUPS):
            if rid in RESUMED and any(b.block_id == dst for b in table(g, rid)):
                return content(o, RESUMED[rid]), kind == "mamba"
    key = pool.blocks[dst].block_hash
    if key is not None:
        return KEYS.get(bytes(ku.get_block_hash(key))), GROUPS[ku.get_group_id(key)][0] == "mamba"
    return HOLDS.get(src), False


def take_copies():
    """The copies allocate_slots queued (copy-on-write of a hit inside a block, a moved entry):
    they run when the step runs, before its forward."""
    take = getattr(mgr, "take_kv_cache_block_copies", None)
    if take is None:
        return
    copies, retained = take()
    RETAINED.extend(retained)
    for c in copies:
        want, exact = claim(c.src_block_id, c.dst_block_id)
        print(f"  queued copy #{c.src_block_id} -> #{c.dst_block_id}")
        if CHECK == "state_copy_sound" and (want is None or not holds(HOLDS.get(c.src_block_id), want, exact)):
            bugs.append(f"copy #{c.src_block_id} -> #{c.dst_block_id}: the source will not hold what the "
                        "destination needs")
        HOLDS[c.dst_block_id] = want
        STEP["copies"].append((c.src_block_id, c.dst_block_id, want, exact))


def forward():
    """The step's forward: its copies first, then the Mamba state copies (the worker's
    preprocess_mamba), its writes, then every scheduled request's reads."""
    global STEP
    step, STEP = STEP, None
    for src, dst, want, exact in step["copies"]:
        if CHECK == "state_copy_sound" and not holds(READY.get(src), want, exact):
            bugs.append(f"the step copies #{src} -> #{dst} before its forward, but #{src}'s bytes are "
                        + ("not written yet" if src not in READY else "not what the copy claims"))
        READY[dst] = want
    writes = []
    for rid, (lo, hi, _) in step["sched"].items():
        o = reqs.get(rid)
        if o is None:
            continue
        for g, (kind, bs, _) in enumerate(GROUPS):
            t = table(g, rid)
            if kind == "mamba":
                src, dst = cdiv(lo, bs) - 1, cdiv(hi, bs) - 1
                if lo > 0:
                    b = t[src] if src < len(t) else None
                    if CHECK == "state_copy_sound" and (b is None or b.is_null or READY.get(b.block_id) != content(o, lo)):
                        bugs.append(f"{rid} resumes the Mamba state at {lo} tokens (group {g}, table index {src}) "
                                    "from a block whose bytes are not that state")
                    if src != dst and dst < len(t):
                        writes.append((t[dst].block_id, content(o, lo)))
                if 0 <= dst < len(t) and not t[dst].is_null and t[dst].block_id in OWNED[rid][g]:
                    writes.append((t[dst].block_id, content(o, hi)))
            elif kind != "tail_ring":
                for i in range(lo // bs, min(len(t), cdiv(hi, bs))):
                    if not t[i].is_null and t[i].block_id in OWNED[rid][g]:
                        writes.append((t[i].block_id, content(o, min((i + 1) * bs, hi))))
    for bid, w in writes:
        READY[bid] = w
    for rid, (lo, hi, tok) in step["sched"].items():
        o = reqs.get(rid)
        if o is None:
            continue
        for g, (kind, bs, _) in enumerate(GROUPS):
            if kind in ("mamba", "tail_ring") or CHECK != "read_before_write":
                continue
            for i, b in enumerate(table(g, rid)[:cdiv(lo, bs)]):
                if not b.is_null and not holds(READY.get(b.block_id), content(o, min((i + 1) * bs, lo)), False):
                    bugs.append(f"{rid}'s forward reads block #{b.block_id} (group {g}, tokens {i * bs}.."
                                f"{min((i + 1) * bs, lo) - 1}), whose bytes were never written by a forward")
        maybe_sample(o, tok)
    if RETAINED:                       # the step's scheduling is over
        pool.free_blocks(list(RETAINED))
        RETAINED.clear()


def tokens(o, p, hit, k):
    """The tokens the step schedules: with a Mamba group, what this release's own
    Scheduler._mamba_block_aligned_split gives for the budget (a fixed split then shows as
    fixed); else the recorded count. None: the finding is at this step's hit."""
    if "n" not in p:
        return None
    if not SPLIT:
        return p["n"]
    from types import SimpleNamespace as NS
    from vllm.v1.core.sched.scheduler import Scheduler
    if not hasattr(Scheduler, "_mamba_block_aligned_split"):
        print("CANNOT PLAY: this vLLM's Scheduler has no _mamba_block_aligned_split (no align-mode Mamba)")
        sys.exit(2)
    me = NS(**{k_: (NS(**v) if isinstance(v, dict) else v) for k_, v in SPLIT.items()})
    me.max_num_scheduled_tokens = p.get("mp") or k
    got = Scheduler._mamba_block_aligned_split(me, o, k, hit)
    if got != p["n"]:
        print(f"  the scheduler's split gives {got} tokens (it gave {p['n']} on {RECORDED_RELEASE})")
    return got


def check_hit(r, o, blocks, hit):
    """The finding's condition at its lookup (the last step)."""
    if CHECK == "hit_aligned" and hit % ALIGN:
        bugs.append(f"{r}: hit {hit} is not a multiple of the alignment {ALIGN}")
    if CHECK == "hit_leaves_last_token" and hit > o.num_tokens - 1:
        bugs.append(f"{r}: hit {hit} leaves no token of its {o.num_tokens} to compute")
    if CHECK == "hit_length_equal":
        for g, lst in enumerate(blocks.blocks):
            want = 0 if GROUPS[g][0] == "tail_ring" else cdiv(hit, GROUPS[g][1])
            if len(lst) != want:
                bugs.append(f"{r}: hit {hit}, but group {g} ({GROUPS[g][0]}, block {GROUPS[g][1]}) returned "
                            f"{len(lst)} blocks ({want} cover the hit)")
    if CHECK.startswith("hit_sound_"):
        for g, lst in enumerate(blocks.blocks):
            kind, bs, _ = GROUPS[g]
            for i in (EXPECT.get("needed", {}).get(str(g), []) if hit == EXPECT.get("hit") else []):
                if i < len(lst) and lst[i].is_null:
                    bugs.append(f"{r}: hit {hit}, group {g} ({kind}) block {i} (tokens {i * bs}..{(i + 1) * bs - 1}) "
                                "that the resume reads is the null block")
            for i, b in enumerate(lst):
                if b.is_null:
                    continue
                last = i == cdiv(hit, bs) - 1
                end, exact = ((hit if last else (i + 1) * bs), True) if kind == "mamba" else \
                    (min((i + 1) * bs, hit), (i + 1) * bs <= hit)
                if not holds(HOLDS.get(b.block_id), content(o, end), exact):
                    bugs.append(f"{r}: hit {hit}, group {g} ({kind}) returns block #{b.block_id} at index {i}, "
                                f"which does not hold the request's {'state after' if kind == 'mamba' else 'first'} "
                                f"{end} tokens")
    if CHECK == "lost_reuse":
        got = []
        for what, g, x in EXPECT["witness"]:
            key = group_hash(o, g, x) if what == "block" else o.block_hashes[x // HASH_BLOCK - 1]
            b = cached(g, key) if key is not None else None
            span = f"block {x} (tokens {x * GROUPS[g][1]}..{(x + 1) * GROUPS[g][1] - 1})" if what == "block" \
                else f"the entry keyed at {x} tokens"
            got.append(b is not None)
            print(f"    g{g} ({GROUPS[g][0]}, block {GROUPS[g][1]}) {span}: "
                  + (f"cached as #{b.block_id}" if b is not None else "NOT in the prefix-cache map"))
        if all(got) and hit < EXPECT["usable"]:
            bugs.append(f"{r}: every block a {EXPECT['usable']}-token resume reads is in the prefix-cache map "
                        f"(listed above), vLLM hit {hit}")
    if CHECK == "lost_reuse_retention" and hit < EXPECT["promised"]:
        bugs.append(f"{r}: prefix_cache_retention_interval={CONFIG_KW.get('prefix_cache_retention_interval')} "
                    f"promises a {EXPECT['promised']}-token hit (vllm/config/cache.py: the latest replay boundary "
                    f"and shared-prefix junctions are retained), vLLM hit {hit}")


def check_state():
    if CHECK == "refcount_equals_holders":
        held = {}
        for m in coord.single_type_managers:
            for lst in m.req_to_blocks.values():
                for b in lst:
                    if not b.is_null:
                        held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in RETAINED:
            held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in pool.blocks:
            if not b.is_null and b.ref_cnt != held.get(b.block_id, 0):
                bugs.append(f"block #{b.block_id}: ref_cnt {b.ref_cnt} but {held.get(b.block_id, 0)} holder(s)")
    if CHECK == "hash_map_sound":
        by_block = getattr(pool, "cached_block_hashes_by_block", {})
        m = pool.cached_block_hash_to_block
        for key, val in list(m._cache.items()):
            for b in ([m._blocks[x] for x in getattr(m, "_dup_ids", {}).get(key, (val,))] if isinstance(val, int)
                      else [val] if not isinstance(val, dict) else list(val.values())):   # (0.34: block ids)
                if b.is_null or (b.block_hash != key and key not in by_block.get(b.block_id, ())):
                    bugs.append(f"prefix-cache map entry points at block #{b.block_id}, which does not carry it")
                    continue
                want, w = KEYS.get(bytes(ku.get_block_hash(key))), HOLDS.get(b.block_id)
                kind, bs, _ = GROUPS[ku.get_group_id(key)]
                if want is not None and (w is None or (w != want if kind == "mamba" else not (
                        holds(w, want, False) and len(want[1]) > (len(w[1]) - 1) // bs * bs))):
                    bugs.append(f"the prefix-cache key of the first {len(want[1])} tokens (group "
                                f"{ku.get_group_id(key)}, {kind}) maps to block #{b.block_id}, which holds "
                                + ("nothing written" if w is None else f"the {'state after' if kind == 'mamba' else 'first'} "
                                   f"{len(w[1])} tokens"))


print(f"vLLM {vllm.__version__} (finding recorded on {RECORDED_RELEASE}); groups {GROUPS}, hash block "
      f"{HASH_BLOCK}, {NUM_BLOCKS} blocks")
for n, (action, p) in enumerate(STEPS):
    last = n == len(STEPS) - 1
    print(f"step {n}: {action} {p}")
    if MAMBA and STEP is None and hasattr(mgr, "new_step_starts"):
        mgr.new_step_starts()
    single = STEP is None and action in ("lookup", "prefill", "decode")
    if single:
        STEP = {"sched": {}, "copies": []}
    try:
        if action == "submit":
            reqs[p["r"]] = Request(p["r"], list(p["tokens"]), SamplingParams(max_tokens=MAX_TOKENS), None,
                                   cache_salt=p.get("salt"), block_hasher=hasher, **EOS)
            OWNED[p["r"]] = [set() for _ in GROUPS]
        elif action == "begin_step":
            STEP = {"sched": {}, "copies": []}
        elif action == "forward":
            forward()
        elif action == "lookup":
            o = reqs[p["r"]]
            blocks, hit, *junction = mgr.get_computed_blocks(o)
            if junction:
                o.shared_prefix_boundary = junction[0]     # as vLLM's scheduler does
            print(f"  hit {hit} of {o.num_tokens} tokens; hit blocks: "
                  + " | ".join(f"g{g}: {ids(lst)}" for g, lst in enumerate(blocks.blocks)))
            if last:
                check_hit(p["r"], o, blocks, hit)
            n = tokens(o, p, hit, max(1, min(p["chunk"], o.num_tokens - hit)))
            if n is None:
                print("  (the finding is at this hit: the adapter stopped before admitting it)")
            elif n == 0:
                print("  the scheduler's chunk split gives it no tokens this step")
            else:
                new = mgr.allocate_slots(o, n, hit, blocks, **({"num_lookahead_tokens": p["la"]} if p.get("la") else {}))
                if new is None:
                    print("  admission refused (no free blocks)")
                else:
                    own(p["r"], new)
                    RESUMED[p["r"]] = hit
                    o.status, o.num_computed_tokens = RequestStatus.RUNNING, hit + n
                    scheduled(o, hit, None, 0)
                    print(f"  admitted, computes {n} -> {o.num_computed_tokens}; tables: {tables(p['r'])}")
        elif action in ("prefill", "decode"):
            o = reqs[p["r"]]
            k = tokens(o, p, 0, 1 if action == "decode" else max(1, min(p["chunk"], o.num_tokens - o.num_computed_tokens)))
            new = mgr.allocate_slots(o, k, **({"num_lookahead_tokens": p["la"]} if p.get("la") else {})) if k else None
            if new is None:
                print("  allocation refused" if k else "  the scheduler's chunk split gives it no tokens")
            else:
                own(p["r"], new)
                o.num_computed_tokens += k
                scheduled(o, o.num_computed_tokens - k, p.get("tok"))
                print(f"  computes {k} -> {o.num_computed_tokens}; tables: {tables(p['r'])}")
        elif action in ("finish", "preempt"):
            o = reqs[p["r"]]
            if STEP is not None and STEP["sched"].pop(p["r"], None):
                print("  (taken out of the open step after its allocation: its forward never runs)")
            mgr.free(o)
            if action == "finish":
                del reqs[p["r"]]
            else:
                o.status, o.num_computed_tokens = RequestStatus.PREEMPTED, 0
                o.num_preemptions += 1
                OWNED[p["r"]] = [set() for _ in GROUPS]
        elif action == "reset_prefix_cache":
            print(f"  reset: {mgr.reset_prefix_cache()}")
        elif action == "evict_blocks":
            mgr.evict_blocks({i for i in p["block_ids"] if 0 < i < NUM_BLOCKS})
        if STEP is not None:
            take_copies()
        for o, lo in STAMP:
            stamp(o, lo, o.num_computed_tokens)
        STAMP.clear()
        if single:
            forward()
    except (AssertionError, ValueError, KeyError, IndexError, TypeError) as e:
        if CHECK != "vllm_internal_error":
            print(f"CANNOT PLAY: vLLM raised {type(e).__name__}: {e} (not the finding's check)")
            sys.exit(2)
        bugs.append(f"vLLM raised {type(e).__name__}: {e}")
    for o in reqs.values():
        note_keys(o)
    check_state()
    if bugs:
        print("BUG: " + "; ".join(bugs))
        sys.exit(1)
print("OK: the condition holds on every step (fixed, or not this release)")
sys.exit(0)
'''
