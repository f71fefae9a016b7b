# Standalone reproducer of a kvcheck finding on vLLM 0.33.0
# layout 'full': one full-attention group (Llama-like), block 4
# check read_before_write: no hit returns a block that allocate_slots published in a step whose request was then taken out of that step (preempted before its forward): its KV was never written
# finding: full group 0 (full): the forward of A (tokens from 12) reads block #4 (tokens 8..11), whose bytes do not hold that prefix: it was published at schedule time, and the forward that writes it had not run before this read (or never ran)
# trace: docs/repro/traces/vllm_priority_preempt_unwritten.json (kvcheck replay docs/repro/traces/vllm_priority_preempt_unwritten.json --sut vllm)
# Needs only vLLM (the release above; the KV cache manager runs on CPU). Exit 1: the bug is
# present; exit 0: fixed. Prints every step, each lookup's hit and the request's block tables.
import inspect
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
import torch
import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1 import kv_cache_interface as kci
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.core import single_type_kv_cache_manager as stm
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request, RequestStatus

RECORDED_RELEASE = '0.33.0'
GROUPS = [('full', 4, None)]          # (kind, block_size, window or chunk)
SCHED_BLOCK, RETENTION, NUM_BLOCKS = 4, None, 6
HASH_BLOCK, MAX_MODEL_LEN, MAX_TOKENS, VOCAB = 4, 64, 48, 40
CHECK, PROMISED = 'read_before_write', None
STEPS = [['submit', {'r': 'A', 'tokens': [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]}], ['submit', {'r': 'B', 'tokens': [30, 31, 32, 33]}], ['begin_step', {}], ['lookup', {'r': 'A', 'chunk': 8}], ['lookup', {'r': 'B', 'chunk': 4}], ['forward', {}], ['begin_step', {}], ['prefill', {'r': 'A', 'chunk': 8}], ['decode', {'r': 'B', 'tok': 5}], ['preempt', {'r': 'A'}], ['decode', {'r': 'B', 'tok': 5}], ['forward', {}], ['finish', {'r': 'B'}], ['begin_step', {}], ['lookup', {'r': 'A', 'chunk': 8}], ['forward', {}]]

def plant(mgr):
    pass


def cdiv(a, b):
    return -(-a // b)


def build():
    common = dict(num_kv_heads=1, head_size=8, dtype=torch.float32)
    specs = []
    for kind, bs, p in GROUPS:
        if kind == "full":
            specs.append(kci.FullAttentionSpec(block_size=bs, **common))
        elif kind == "swa":
            specs.append(kci.SlidingWindowSpec(block_size=bs, sliding_window=p, **common))
        elif kind == "chunked_local":
            specs.append(kci.ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=p, **common))
        elif kind == "mla":
            specs.append(kci.MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=16, dtype=torch.float32))
        else:
            specs.append(kci.SlidingWindowMLASpec(block_size=bs, sliding_window=p, num_kv_heads=1, head_size=16,
                                                  dtype=torch.float32))
    extra = ({"prefix_cache_retention_interval": RETENTION}
             if "prefix_cache_retention_interval" in inspect.signature(kci.KVCacheConfig).parameters else {})
    cfg = kci.KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                            kv_cache_groups=[kci.KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
                            **extra)
    kw = {"scheduler_block_size": SCHED_BLOCK} if "scheduler_block_size" in inspect.signature(KVCacheManager).parameters else {}
    return KVCacheManager(cfg, max_model_len=MAX_MODEL_LEN, hash_block_size=HASH_BLOCK, **kw)


ku.init_none_hash(sha256)
mgr = build()
if "--clean" not in sys.argv:
    plant(mgr)
pool, coord = mgr.block_pool, mgr.coordinator
ALIGN = int(getattr(coord, "_cache_hit_alignment_tokens", SCHED_BLOCK))
hasher = ku.get_request_block_hasher(HASH_BLOCK, sha256)
EOS = {"eos_token_id": None} if "eos_token_id" in inspect.signature(Request).parameters else {}
reqs = {}
bugs = []
STEP = None           # a scheduler step: {rid: tokens computed before it}, and the deferred samples
UNWRITTEN = {}        # block id -> why its bytes were never written (published, then unscheduled)


def table(g, rid):
    return coord.single_type_managers[g].req_to_blocks.get(rid, [])


def tables(rid):
    return " | ".join(f"g{g} {GROUPS[g][0]}: " + str(["null" if b.is_null else b.block_id for b in table(g, rid)])
                      for g in range(len(GROUPS)))


def group_hash(o, g, i):
    bs = GROUPS[g][1]
    if (i + 1) * bs // HASH_BLOCK > len(o.block_hashes):
        return None
    return o.block_hashes[i] if bs == HASH_BLOCK else ku.BlockHashListWithBlockSize(o.block_hashes, HASH_BLOCK, bs)[i]


def needed(g, L):
    """Blocks of group g a resume at L reads."""
    kind, bs, p = GROUPS[g]
    if kind in ("full", "mla"):
        return range(0, L // bs)
    if kind == "chunked_local":
        return range((L // p) * p // bs, cdiv(L, bs))
    return range(max(0, L - p + 1) // bs, cdiv(L, bs))


def map_usable(o):
    """Longest aligned hit whose needed blocks are all in the prefix-cache map."""
    cache = pool.cached_block_hash_to_block
    for L in range((o.num_tokens - 1) // ALIGN * ALIGN, 0, -ALIGN):
        if all((h := group_hash(o, g, i)) is not None
               and cache.get_one_block(ku.make_block_hash_with_group_id(h, g)) is not None
               for g in range(len(GROUPS)) for i in needed(g, L)):
            return L
    return 0


def check_state():
    if CHECK == "refcount_equals_holders":
        holders = {}
        for m in coord.single_type_managers:
            for lst in m.req_to_blocks.values():
                for b in lst:
                    if not b.is_null:
                        holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in pool.blocks:
            if not b.is_null and b.ref_cnt != holders.get(b.block_id, 0):
                bugs.append(f"block #{b.block_id}: ref_cnt {b.ref_cnt} but {holders.get(b.block_id, 0)} holder(s)")
    if CHECK == "hash_map_sound":
        by_block = getattr(pool, "cached_block_hashes_by_block", {})
        m = pool.cached_block_hash_to_block
        for key, val in list(m._cache.items()):
            for b in ([m._blocks[x] for x in getattr(m, "_dup_ids", {}).get(key, (val,))] if isinstance(val, int)
                      else [val] if not isinstance(val, dict) else list(val.values())):   # (0.34: block ids)
                if b.block_hash != key and key not in by_block.get(b.block_id, ()):
                    bugs.append(f"prefix-cache map entry points at block #{b.block_id}, which does not carry it")


def maybe_sample(o, tok=None):
    if o.num_computed_tokens == o.num_tokens and o.num_tokens < MAX_TOKENS:
        o.append_output_token_ids(tok if tok is not None else (o.num_tokens * 7) % VOCAB)


def lookup(r, chunk, last, la=0):
    o = reqs[r]
    usable = map_usable(o)
    blocks, hit, *junction = mgr.get_computed_blocks(o)
    if junction:
        o.shared_prefix_boundary = junction[0]      # as vLLM's scheduler does
    print(f"  hit {hit} of {o.num_tokens} tokens; hit blocks: " + " | ".join(
        f"g{g}: " + str(["null" if b.is_null else b.block_id for b in lst]) for g, lst in enumerate(blocks.blocks)))
    if CHECK == "hit_sound_swa_window":
        for g, lst in enumerate(blocks.blocks):
            if GROUPS[g][0] in ("swa", "swa_mla") and hit:
                for i in needed(g, hit):
                    if i < len(lst) and lst[i].is_null:
                        bugs.append(f"{r}: hit {hit}, group {g} block {i} (tokens {i * GROUPS[g][1]}.."
                                    f"{(i + 1) * GROUPS[g][1] - 1}) that the window reads is the null block")
    if CHECK == "read_before_write":
        for g, lst in enumerate(blocks.blocks):
            for b in lst:
                if not b.is_null and b.block_id in UNWRITTEN:
                    bugs.append(f"{r}: hit {hit} returns block #{b.block_id} (group {g}), "
                                f"{UNWRITTEN[b.block_id]}")
    if CHECK == "lost_reuse" and last and hit < usable:
        bugs.append(f"{r}: every block a {usable}-token hit needs is in the prefix-cache map, vLLM hit {hit}")
    if CHECK == "lost_reuse_retention" and last and hit < PROMISED:
        bugs.append(f"{r}: prefix_cache_retention_interval={RETENTION} promises a {PROMISED}-token hit "
                    f"(vllm/config/cache.py: the latest replay boundary and shared-prefix junctions are "
                    f"retained), vLLM hit {hit}")
    chunk = max(1, min(chunk, o.num_tokens - hit))
    new = mgr.allocate_slots(o, chunk, hit, blocks, **({"num_lookahead_tokens": la} if la else {}))
    if new is None:
        print("  admission refused (no free blocks)")
        return
    reallocated(new)
    o.status = RequestStatus.RUNNING
    o.num_computed_tokens = hit + chunk
    scheduled(o, hit, None)
    print(f"  admitted, computed {o.num_computed_tokens}; tables: {tables(r)}")


def step(o, n, tok, la=0):
    new = mgr.allocate_slots(o, n, **({"num_lookahead_tokens": la} if la else {}))
    if new is None:
        print("  allocation refused")
        return
    reallocated(new)
    o.num_computed_tokens += n
    scheduled(o, o.num_computed_tokens - n, tok)


def scheduled(o, lo, tok):
    """In a scheduler step the forward runs (and the token is sampled) at `forward`."""
    if STEP is None:
        maybe_sample(o, tok)
    else:
        STEP["lo"][o.request_id] = lo
        STEP["samples"].append((o, tok))


def reallocated(new):
    for lst in new.blocks:
        for b in lst:
            UNWRITTEN.pop(b.block_id, None)     # a fresh allocation: its old hash is gone


def unscheduled(o):
    """The PRIORITY scheduler preempts a request it already scheduled in this step
    (scheduler.py: `preempted_req in scheduled_running_reqs`): its forward never runs."""
    lo = STEP["lo"].pop(o.request_id)
    STEP["samples"] = [x for x in STEP["samples"] if x[0] is not o]
    for g, (_, bs, _) in enumerate(GROUPS):
        for i, b in enumerate(table(g, o.request_id)):
            if (i + 1) * bs > lo and not b.is_null and b.block_hash is not None:
                UNWRITTEN[b.block_id] = (f"published by {o.request_id}'s allocate_slots, which was then "
                                         "preempted in the same step before its forward: never written")


print(f"vLLM {vllm.__version__} (finding recorded on {RECORDED_RELEASE}); layout {GROUPS}, "
      f"retention {RETENTION}, {NUM_BLOCKS} blocks")
for n, (action, p) in enumerate(STEPS):
    last = n == len(STEPS) - 1
    print(f"step {n}: {action} {p}")
    if action == "submit":
        reqs[p["r"]] = Request(p["r"], list(p["tokens"]), SamplingParams(max_tokens=MAX_TOKENS), None,
                               cache_salt=p.get("salt"), block_hasher=hasher, **EOS)
    elif action == "begin_step":
        STEP = {"lo": {}, "samples": []}
    elif action == "forward":
        for o, tok in STEP["samples"]:
            if o.request_id in reqs:
                maybe_sample(o, tok)
        STEP = None
    elif action == "lookup":
        lookup(p["r"], p["chunk"], last, p.get("la", 0))
    elif action == "prefill":
        o = reqs[p["r"]]
        step(o, max(1, min(p["chunk"], o.num_tokens - o.num_computed_tokens)), None, p.get("la", 0))
    elif action == "decode":
        step(reqs[p["r"]], 1, p["tok"], p.get("la", 0))
    elif action in ("finish", "preempt"):
        o = reqs[p["r"]]
        if STEP is not None and p["r"] in STEP["lo"]:
            unscheduled(o)
        mgr.free(o)
        if action == "finish":
            del reqs[p["r"]]
        else:
            o.status, o.num_computed_tokens = RequestStatus.PREEMPTED, 0
            o.num_preemptions += 1
    elif action == "reset_prefix_cache":
        print(f"  reset: {mgr.reset_prefix_cache()}")
    elif action == "evict_blocks":
        mgr.evict_blocks({i for i in p["block_ids"] if 0 < i < NUM_BLOCKS})
    check_state()
    if bugs:
        print("BUG: " + "; ".join(bugs))
        sys.exit(1)
print("OK: the condition holds on every step (fixed, or not this release)")
sys.exit(0)
