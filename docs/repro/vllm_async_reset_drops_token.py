# Standalone reproducer of a kvcheck finding on vLLM 0.14.1, driven by
# vLLM's own v1 Scheduler (schedule -> forward -> update_from_output), built on CPU
# layout 'full': groups (kind, block size, window/chunk) [('full', 4, None)], hash block 4
# scheduler knobs: {'policy': 'fcfs', 'max_num_batched_tokens': 32, 'max_num_seqs': 8, 'long_prefill_token_threshold': 4, 'num_blocks': 41, 'spec_tokens': 1, 'eagle_drop': False, 'connector': False, 'sync_fail': False, 'async_sched': True}
# check toctou_bound_stable: under async scheduling, every output vLLM drops is stale: its frame was scheduled before the request's forced preemption (reset_prefix_cache(reset_running_requests=True)); a token of a later frame is real, and the next forward already computed its KV
# finding: vLLM dropped r19's token at position 12, sampled by a forward scheduled after its forced preemption (the discard of a stale output outlived the frames in flight): the KV the next forward computed from it is of a token the request no longer has
# trace: docs/repro/traces/vllm_async_reset_drops_token.trace.json (kvcheck replay docs/repro/traces/vllm_async_reset_drops_token.trace.json --sut vllm)
# Needs only vLLM (and transformers, to write a tiny model's config.json: nothing is
# downloaded). Exit 1: the bug is present; exit 0: fixed (or not this release); 2: a step
# this vLLM cannot play.
import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import inspect
import os
import sys


def cannot_play(kind, value, tb):
    """Anything unexpected (a class or method this vLLM lacks, a broken install) is exit 2, never
    exit 1: exit 1 says the bug is present."""
    import traceback
    traceback.print_exception(kind, value, tb)
    print(f"CANNOT PLAY: {kind.__name__}: {value}", flush=True)
    os._exit(2)


sys.excepthook = cannot_play

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


def C(module, name):
    """A vLLM class or enum by its module (the spec classes' own modules)."""
    import importlib
    return getattr(importlib.import_module(module), name)


# Fields that make the layout what it is: a release without one cannot play the finding.
ESSENTIAL = {"sliding_window", "attention_chunk_size", "mamba_cache_mode", "tokens_per_state", "cache_role",
             "model_version", "prefix_cache_retention_interval", "use_eagle", "hash_block_size"}


def fit(fn, kw):
    """The arguments this release's `fn` takes: a field the recorded release had and this one
    lacks is left out and said (the adapter also passes scheduler_block_size, is_eagle_group,
    ... only where a release has them); one that defines the layout is exit 2."""
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kw
    left = sorted(k for k in kw if k not in params)
    if set(left) & ESSENTIAL:
        print(f"CANNOT PLAY: this vLLM's {getattr(fn, '__name__', fn)} has no {', '.join(sorted(set(left) & ESSENTIAL))}")
        sys.exit(2)
    if left:
        print(f"  (this vLLM's {getattr(fn, '__name__', fn)} has no {', '.join(left)}: left out)")
    return {k: v for k, v in kw.items() if k in params}

RECORDED_RELEASE = '0.14.1'
GROUPS = [('full', 4, None)]          # (kind, block_size, window or chunk)
SPECS = [
    ('vllm.v1.kv_cache_interface', 'FullAttentionSpec', {'block_size': 4, 'num_kv_heads': 1, 'head_size': 8, 'dtype': torch.float32, 'head_size_v': 8}),
]          # (module, class, fields that differ from the defaults), one per group
GROUP_KW = [{}]
CONFIG_KW = {}
KNOBS = {'policy': 'fcfs', 'max_num_batched_tokens': 32, 'max_num_seqs': 8, 'long_prefill_token_threshold': 4, 'num_blocks': 41, 'spec_tokens': 1, 'eagle_drop': False, 'connector': False, 'sync_fail': False, 'async_sched': True}   # the episode's scheduler configuration
NUM_BLOCKS, HASH_BLOCK, SCHED_BLOCK = 41, 4, 4
MAX_MODEL_LEN, MAX_TOKENS, VOCAB = 64, 48, 40
DRAFTER = False   # an EAGLE drafter (SpeculativeConfig; no draft is proposed)
ASYNC = True   # async scheduling: AsyncScheduler under the engine core's two-deep batch queue
MODEL = {'hidden_size': 64, 'intermediate_size': 128, 'num_hidden_layers': 2, 'num_attention_heads': 2, 'num_key_value_heads': 1, 'vocab_size': 64, 'max_position_embeddings': 65536, 'architectures': ['LlamaForCausalLM']}   # a tiny Llama: the scheduler reads only lengths and flags
CHECK = 'toctou_bound_stable'
EXPECT = {'promised': None}   # the spec's numbers at the finding's lookup (checked in vLLM's state)
STEPS = [['submit', {'r': 'r19', 'tokens': [35, 7, 7, 19, 14, 0, 1, 12, 33, 33, 13, 19], 'salt': 's1', 'prio': -19, 'max_tokens': 2}], ['step', {}], ['reset_prefix_cache', {'running': True}], ['step', {}], ['step', {}], ['step', {}], ['step', {}]]


import zlib


def next_token(tokens: list[int]) -> int:
    """The fake model's greedy token after `tokens` (a stable hash of the recent context)."""
    return zlib.crc32(bytes(t & 0xFF for t in tokens[-8:]) + len(tokens).to_bytes(4, "little")) % VOCAB


def draft_tokens(ctx: list[int], k: int) -> list[int]:
    """The EAGLE drafter's k tokens after `ctx`: each the greedy token with probability ~0.7 (a
    stable function of the context, so a replay proposes the same)."""
    ctx, d = list(ctx), []
    for _ in range(k):
        t = next_token(ctx)
        d.append(t if next_token(ctx + [VOCAB]) % 10 < 7 else (t + 1) % VOCAB)
        ctx.append(d[-1])
    return d


def discarding(o: object) -> bool:
    """Will vLLM drop this request's next output frame? (0.14-0.21: a flag; 0.22-0.3x: a count;
    0.34: a count of stale tokens it drops or delivers, `drop_stale_output`.)"""
    return bool(getattr(o, "discard_latest_async_tokens", False) or getattr(o, "async_tokens_to_discard", 0)
                or (getattr(o, "drop_stale_output", False) and getattr(o, "num_stale_output_tokens", 0)))


SPLIT_FORWARD = STALE_OUTPUT = False
def plant(mgr):
    pass


def cdiv(a, b):
    return -(-a // b)

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
            READY.pop(b.block_id, None)

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

import atexit
import contextlib
import io
import shutil
import tempfile

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

TORN = ("<torn>", ())      # bytes mixing two prefixes: hold no prefix


def vllm_config():
    """The engine's VllmConfig for a tiny Llama whose config.json is written here (no weights)."""
    from transformers import LlamaConfig
    d = tempfile.mkdtemp(prefix="kvcheck-model-")
    atexit.register(shutil.rmtree, d, True)
    LlamaConfig(**MODEL).save_pretrained(d)
    # (older releases print "Error retrieving safetensors" for a directory without weights)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        mc = ModelConfig(model=d, skip_tokenizer_init=True, max_model_len=MODEL["max_position_embeddings"],
                         dtype="float32")
    mc.max_model_len = MAX_MODEL_LEN
    sc = SchedulerConfig(**fit(SchedulerConfig, dict(
        max_num_batched_tokens=KNOBS["max_num_batched_tokens"], max_num_seqs=KNOBS["max_num_seqs"],
        max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True, policy=KNOBS["policy"],
        long_prefill_token_threshold=KNOBS["long_prefill_token_threshold"], is_encoder_decoder=False)))
    if "async_scheduling" in inspect.signature(SchedulerConfig).parameters:
        sc.async_scheduling = ASYNC      # (as --[no-]async-scheduling; kept from the CPU platform's override below)
    attn = [bs for _, bs, _ in GROUPS]
    multi = len(GROUPS) > 1
    cc = CacheConfig(block_size=min(attn) if multi else attn[0], enable_prefix_caching=True,
                     **({"prefix_match_unit": HASH_BLOCK}
                        if multi and "prefix_match_unit" in inspect.signature(CacheConfig).parameters else {}))
    cc.num_gpu_blocks = NUM_BLOCKS
    spec = {}
    if DRAFTER:       # (built for one draft token, then the two fields the scheduler reads are set)
        import copy
        from vllm.config import SpeculativeConfig
        sp = copy.copy(SpeculativeConfig(method="eagle", model=d, num_speculative_tokens=1, target_model_config=mc,
                                         target_parallel_config=ParallelConfig()))
        sp.num_speculative_tokens = max(1, KNOBS["spec_tokens"])
        if hasattr(sp, "disable_lookahead_block_hashes"):
            sp.disable_lookahead_block_hashes = KNOBS.get("eagle_drop", False)
        spec["speculative_config"] = sp
    import vllm.triton_utils as tu     # (0.34's CPU platform wants triton-cpu for its kernels: none run here)
    from vllm import platforms
    cp = platforms.current_platform
    orig = cp.check_and_update_config

    def keep(vc):                      # (the CPU platform turns async scheduling off; a GPU engine keeps it)
        before = vc.scheduler_config.async_scheduling
        orig(vc)
        vc.scheduler_config.async_scheduling = before
    had, tu.HAS_TRITON, cp.check_and_update_config = getattr(tu, "HAS_TRITON", True), True, keep
    try:
        return VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, device_config=DeviceConfig(device="cpu"),
                          **spec)
    finally:
        tu.HAS_TRITON = had
        del cp.check_and_update_config


def kv_cache_config():
    groups = []
    for i, ((mod, cls, kw), gkw) in enumerate(zip(SPECS, GROUP_KW)):
        try:
            spec_cls = C(mod, cls)
        except (ImportError, AttributeError):
            print(f"CANNOT PLAY: this vLLM has no {mod}.{cls} (group {i})")
            sys.exit(2)
        groups.append(kci.KVCacheGroupSpec(**fit(kci.KVCacheGroupSpec, {
            "layer_names": [f"layer{i}"], "kv_cache_spec": spec_cls(**fit(spec_cls, kw)), **gkw})))
    return kci.KVCacheConfig(**fit(kci.KVCacheConfig, {"num_blocks": NUM_BLOCKS, "kv_cache_tensors": [],
                                                       "kv_cache_groups": groups, **CONFIG_KW}))


def build():
    """vLLM's Scheduler, as EngineCore builds it: its block sizes from the release's own rule."""
    vc, kcfg = vllm_config(), kv_cache_config()
    resolve = getattr(ku, "resolve_kv_cache_block_sizes", None)
    sbs, hbs = resolve(kcfg, vc) if resolve is not None else (vc.cache_config.block_size,) * 2
    if (sbs, hbs) != (SCHED_BLOCK, HASH_BLOCK):
        print(f"CANNOT PLAY: this vLLM derives scheduler block {sbs} and hash block {hbs} for these groups "
              f"(the finding needs {SCHED_BLOCK} and {HASH_BLOCK})")
        sys.exit(2)
    hbs_arg = {"hash_block_size": hbs} if "hash_block_size" in inspect.signature(Scheduler).parameters else {}
    cls = Scheduler
    if ASYNC:                  # (async scheduling: the engine core's batch queue steps it, below)
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as cls
    sched = cls(**fit(cls, dict(vllm_config=vc, kv_cache_config=kcfg, block_size=sbs, log_stats=True,
                                            structured_output_manager=StructuredOutputManager(vc), **hbs_arg)))
    la = getattr(vc, "num_hash_lookahead_tokens", 0) or 0
    hasher = (ku.get_request_block_hasher(hbs, sha256, la)
              if len(inspect.signature(ku.get_request_block_hasher).parameters) > 2
              else ku.get_request_block_hasher(hbs, sha256))
    return sched, hasher


ku.init_none_hash(sha256)
sched, hasher = build()
mgr = sched.kv_cache_manager
if "--clean" not in sys.argv:
    plant(mgr)
pool, coord = mgr.block_pool, mgr.coordinator
ALIGN = int(getattr(coord, "_cache_hit_alignment_tokens", 0) or SCHED_BLOCK)
REQ_ARGS = set(inspect.signature(Request).parameters)
reqs, ALL, OWNED, RESUMED = {}, {}, {}, {}   # live requests; every one; its own blocks; its last hit
HOLDS, READY, KEYS = {}, {}, {}     # block -> content it will hold / its bytes hold; key -> content
STEP = None                         # the open step: what its forward runs, its queued copies
RETAINED = []                       # blocks the scheduler holds for copies not yet run
ACCEPTED = {}                       # rid -> draft positions [lo, hi) of the step the sampler accepted
WT = {}                             # rid -> the worker's block table, one list of block ids per group
LAST = False                        # in the trace's last step (the finding's)
INFLIGHT = None                     # async: (SchedulerOutput, its model output, frame number) on its way
FRAMES, RESET_AT = [0], {}          # async: frames scheduled; rid -> frames scheduled before its forced reset
bugs = []


# ---- watching the scheduler's calls into its KV cache manager ------------------------------
def hook(name, around):
    inner = getattr(mgr, name)
    setattr(mgr, name, lambda *a, **k: around(inner, *a, **k))


def on_lookup(inner, o, *a, **k):
    out = inner(o, *a, **k)
    blocks, hit, rid = out[0], out[1], o.request_id
    RESUMED[rid] = hit
    print(f"    lookup {rid}: hit {hit} of {o.num_tokens} tokens; hit blocks: "
          + " | ".join(f"g{g}: {ids(lst)}" for g, lst in enumerate(blocks.blocks)))
    if not CHECK.startswith("lost_reuse") or (LAST and rid == EXPECT.get("r")):
        check_hit(rid, o, blocks, hit)
    return out


ALLOC = inspect.signature(type(mgr).allocate_slots)


def on_alloc(inner, o, *a, **k):
    """The blocks a request allocates will hold its tokens up to what this step computes."""
    args = ALLOC.bind(mgr, o, *a, **k).arguments
    lo = o.num_computed_tokens
    new = inner(o, *a, **k)
    end = lo + int(args.get("num_new_computed_tokens", 0) or 0) + int(args["num_new_tokens"])
    print(f"    allocate_slots {o.request_id} for tokens up to {end}: "
          + ("refused" if new is None else "new blocks " + " | ".join(f"g{g}: {ids(lst)}"
                                                                       for g, lst in enumerate(new.blocks))))
    if new is not None and o.request_id in OWNED:
        own(o.request_id, new)
        stamp(o, lo, min(end, o.num_tokens))          # (draft positions: once accepted)
    return new


def on_free(inner, o, *a, **k):
    accept(o.request_id)                 # (a request finishing in update_from_output: its drafts first)
    print(f"    free {o.request_id}: {tables(o.request_id)}")
    out = inner(o, *a, **k)
    OWNED[o.request_id] = [set() for _ in GROUPS]
    return out


def on_copies(inner, *a, **k):
    """The copies the step queued run before its forward."""
    out = inner(*a, **k)
    for c in out[0]:
        want, exact = claim(c.src_block_id, c.dst_block_id)
        print(f"    queued copy #{c.src_block_id} -> #{c.dst_block_id}")
        if CHECK == "state_copy_sound" and (want is None or not holds(HOLDS.get(c.src_block_id), want, exact)):
            bugs.append(f"copy #{c.src_block_id} -> #{c.dst_block_id}: the source will not hold what the "
                        "destination needs")
        HOLDS[c.dst_block_id] = want
        STEP["copies"].append((c.src_block_id, c.dst_block_id, want, exact))
    return out


hook("get_computed_blocks", on_lookup)
hook("allocate_slots", on_alloc)
hook("free", on_free)
if hasattr(mgr, "take_kv_cache_block_copies"):
    hook("take_kv_cache_block_copies", on_copies)


# ---- the fake worker ---------------------------------------------------------------------
def reads(g, n):
    """Table indices of group g the next token of a request at n computed tokens attends to."""
    kind, bs, p = GROUPS[g]
    if kind in ("tail_ring", "mamba"):
        return range(0)
    if kind in ("compressed", "indexer"):      # entries of complete compression blocks
        return range(0, (n // p) * p // bs)
    lo = (n // p) * p if kind == "chunked_local" else max(0, n - p + 1) if kind in ("swa", "swa_mla") else 0
    return range(lo // bs, cdiv(n, bs))


def write(o, lo, hi):
    """The forward writes tokens [lo, hi) into the request's own blocks; what a block holds before
    lo must be the request's own prefix (else its bytes are torn)."""
    for g, (kind, bs, _) in enumerate(GROUPS):
        if kind in ("tail_ring", "mamba"):
            continue
        t = table(g, o.request_id)
        for i in range(lo // bs, min(len(t), cdiv(hi, bs))):
            b = t[i]
            if not b.is_null and b.block_id in OWNED[o.request_id][g]:
                ok = i * bs >= lo or holds(READY.get(b.block_id), content(o, lo), False)
                READY[b.block_id] = content(o, min((i + 1) * bs, hi)) if ok else TORN


def check_reads(o, lo):
    for g, (kind, bs, _) in enumerate(GROUPS):
        t = table(g, o.request_id)
        for i in reads(g, lo):
            b = t[i] if i < len(t) else None
            if b is None or b.is_null:
                continue
            end = min((i + 1) * bs, lo)
            if CHECK == "read_before_write" and not holds(READY.get(b.block_id), content(o, end), False):
                bugs.append(f"{o.request_id}'s forward (tokens from {lo}) reads block #{b.block_id} (group {g} "
                            f"{kind}, tokens {i * bs}..{end - 1}), whose bytes were never written with that prefix "
                            "by a forward that ran (vLLM published it at schedule time)")


def worker(so):
    """The model runner's block tables, from the SchedulerOutput alone (GPUModelRunner._update_states;
    a resumed request's new_block_ids replace its table); then worker_table_sound, before the forward."""
    c, check = so.scheduled_cached_reqs, CHECK == "worker_table_sound"
    for rid in so.finished_req_ids:
        WT.pop(rid, None)
    WT.update({x.req_id: [list(b) for b in x.block_ids] for x in so.scheduled_new_reqs})
    for rid, new in zip(c.req_ids, c.new_block_ids):
        if rid in (getattr(c, "resumed_req_ids", None) or ()):
            if new is None and check:
                bugs.append(f"{rid} resumes from preemption without its block table (new_block_ids is None)")
            WT[rid] = [list(b) for b in new or ()]
        elif new is not None:
            for t, b in zip(WT.setdefault(rid, [[] for _ in new]), new):
                t.extend(b)
    for rid in so.num_scheduled_tokens if check else ():
        have = WT.get(rid, [])
        for g in range(len(GROUPS)):
            want, got = table(g, rid), have[g] if g < len(have) else []
            if len(got) > len(want) or any(not b.is_null and (i >= len(got) or got[i] != b.block_id)
                                           for i, b in enumerate(want)):
                bugs.append(f"{rid}'s block table in the worker (group {g}), built from the scheduler's outputs, is "
                            f"{got} where the manager's is {ids(want)}: its forward misses or misplaces blocks")


def forward():
    """The step runs: its queued copies, then its forward (every layer writes the whole batch's
    new KV, then attends); SPLIT_FORWARD (a planted fault): the admitted requests first."""
    global STEP
    step, STEP = STEP, None
    for src, dst, want, exact in step["copies"]:
        if CHECK == "state_copy_sound" and (want is None or not holds(READY.get(src), want, exact)):
            bugs.append(f"the step copies #{src} -> #{dst} before its forward, but #{src}'s bytes are "
                        + ("not written yet" if src not in READY else "not what the copy claims"))
        READY[dst] = want
    items = list(step["sched"].items())
    for phase in ([[x for x in items if x[1][2]], [x for x in items if not x[1][2]]] if SPLIT_FORWARD else [items]):
        # (async: a request finished by the previous frame's output still runs here; vLLM drops it)
        phase = [x for x in phase if x[0] in sched.requests]
        for rid, (lo, hi, _) in phase:
            write(ALL[rid], lo, hi)
        for rid, (lo, hi, _) in phase:
            check_reads(ALL[rid], lo)


def sampled(o, drafts):
    """The greedy model's tokens for a scheduled request: none mid-prompt; else the token after its
    context, and after each of its scheduled drafts while they match (the rejection sampler)."""
    if o.num_computed_tokens - len(drafts) < o.num_tokens:
        return []
    ctx, out = list(o.all_token_ids), []
    while True:
        out.append(next_token(ctx))
        if len(out) > len(drafts) or drafts[len(out) - 1] != out[-1]:
            return out
        ctx.append(out[-1])


def accept(rid):
    """Accepted draft positions: the forward wrote their KV, which is right."""
    span = ACCEPTED.pop(rid, None)
    if span is not None and rid in ALL:
        o = ALL[rid]
        write(o, *span)
        stamp(o, span[0], min(o.num_computed_tokens, o.num_tokens))


def propose():
    """EAGLE: drafts for every decoding request, each right with probability ~0.7 (a stable function
    of its context), fed to the scheduler as the engine feeds the drafter's."""
    k = KNOBS["spec_tokens"] if DRAFTER else 0
    rids, drafts = [], []
    for rid, o in reqs.items():
        if k <= 0 or o.status != RequestStatus.RUNNING or o.num_tokens - o.num_computed_tokens != 1:
            continue
        rids.append(rid)
        drafts.append(draft_tokens(o.all_token_ids, k))
    if rids:
        from vllm.v1.outputs import DraftTokenIds
        print(f"    drafts proposed: {dict(zip(rids, drafts))}")
        sched.update_draft_token_ids(DraftTokenIds(rids, drafts))


def model_output(so, spec, real):
    """update_from_output's input: each scheduled request's sampled tokens."""
    ids_ = list(so.num_scheduled_tokens)
    toks = [sampled(sched.requests[r], list(spec.get(r, ()))) if r in sched.requests else [1] for r in ids_]
    ACCEPTED.update({r: (real[r], real[r] + len(t) - 1) for r, t in zip(ids_, toks) if len(t) > 1})
    extra = {}
    for k, p in inspect.signature(ModelRunnerOutput).parameters.items():   # the release's other fields
        if p.default is inspect.Parameter.empty and k not in ("req_ids", "req_id_to_index", "sampled_token_ids"):
            extra[k] = [] if "list" in str(p.annotation) else {} if "dict" in str(p.annotation) else None
    if "req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters:      # (gone in 0.34)
        extra["req_id_to_index"] = {r: i for i, r in enumerate(ids_)}
    return ModelRunnerOutput(req_ids=ids_, sampled_token_ids=toks, **extra)


def sync():
    for rid in [r for r in reqs if r not in sched.requests]:
        del reqs[rid]
        print(f"    {rid} finished")


def step():
    global STEP, INFLIGHT
    STEP = {"sched": {}, "copies": []}
    so = sched.schedule()
    if STALE_OUTPUT:                      # (a planted fault: the output the worker gets is changed)
        stale_output(so)
    worker(so)
    new = {x.req_id for x in so.scheduled_new_reqs}
    new |= set(getattr(so.scheduled_cached_reqs, "resumed_req_ids", ()) or ())
    spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
    real = {}                             # rid -> end of the known tokens it computes (drafts: once accepted)
    for rid, n in so.num_scheduled_tokens.items():
        hi = sched.requests[rid].num_computed_tokens
        real[rid] = hi - len(spec.get(rid, ()))
        STEP["sched"][rid] = (hi - n, real[rid], rid in new)
    gone = sorted(getattr(so, "preempted_req_ids", ()) or ())
    if ASYNC:
        RESET_AT.update({r: FRAMES[0] for r in gone})
    print("    scheduled " + ", ".join(f"{r} [{lo}, {hi}){' (admitted)' if a else ''}"
                                      for r, (lo, hi, a) in STEP["sched"].items())
          + (f"; preempted {gone}" if gone else ""))
    for r in STEP["sched"]:
        print(f"      {r}: {tables(r)}" + (f"; the worker's: {WT.get(r)}" if CHECK == "worker_table_sound" else ""))
    sync()
    if ASYNC:                             # the batch queue: frame N's output arrives after N+1 was scheduled
        FRAMES[0] += 1
        take_inflight()
        forward()
        INFLIGHT = (so, model_output(so, spec, real), FRAMES[0])
        return
    forward()
    sched.update_from_output(so, model_output(so, spec, real))
    for rid in list(ACCEPTED):
        accept(rid)
    sync()
    propose()


def take_inflight():
    """The output of the frame in flight through update_from_output. A token vLLM drops is stale only
    if its frame was scheduled before the request's forced reset; a later frame's is a real token lost."""
    global INFLIGHT
    if INFLIGHT is None:
        return
    (so, out, frame), INFLIGHT = INFLIGHT, None
    before = {r: (discarding(sched.requests[r]), len(sched.requests[r].output_token_ids))
              for r in out.req_ids if r in sched.requests}
    sched.update_from_output(so, out)
    for r, toks in zip(out.req_ids, out.sampled_token_ids):
        o, (flag, n) = sched.requests.get(r), before.get(r, (False, 0))
        if flag and len(toks) and o is not None and len(o.output_token_ids) == n:
            late = frame > RESET_AT.get(r, frame)      # (the frames before its latest preemption are stale)
            print(f"    vLLM dropped {r}'s output of frame {frame} (the frames before its reset: "
                  f"{RESET_AT.get(r)}){': a real token' if late else ''}")
            if late and CHECK == "toctou_bound_stable":
                bugs.append(f"vLLM dropped {r}'s token at position {o.num_tokens}, sampled by a forward scheduled "
                            "after its forced preemption: the KV the next forward computed from it is of a token "
                            "the request no longer has")
    sync()


def state():
    RETAINED[:] = [b for _, bl in getattr(sched, "deferred_frees", ()) for b in bl]
    for o in ALL.values():
        note_keys(o)
    check_state()


print(f"vLLM {vllm.__version__} (finding recorded on {RECORDED_RELEASE}); groups {GROUPS}, hash block "
      f"{HASH_BLOCK}, {NUM_BLOCKS} blocks; scheduler {KNOBS}")
arrivals = 0
for n, (action, p) in enumerate(STEPS):
    LAST = n == len(STEPS) - 1
    print(f"step {n}: {action} {p}")
    try:
        if action == "submit":
            rid = p["r"]
            if rid in reqs or not 1 <= len(p["tokens"]) < MAX_TOKENS:
                print(f"    (refused: {rid} is live, or its length is out of range)")
                continue
            arrivals += 1
            mt = max(1, min(int(p.get("max_tokens", 8)), MAX_TOKENS - len(p["tokens"])))
            kw = {k: v for k, v in dict(cache_salt=p.get("salt"), block_hasher=hasher, eos_token_id=None,
                                        priority=int(p.get("prio", 0)), arrival_time=float(arrivals)).items()
                  if k in REQ_ARGS}
            o = Request(rid, list(p["tokens"]), SamplingParams(max_tokens=mt), None, **kw)
            reqs[rid] = ALL[rid] = o
            OWNED[rid] = [set() for _ in GROUPS]
            sched.add_request(o)
        elif action == "step":
            step()
        elif action == "abort":
            if p["r"] not in reqs:
                print(f"    ({p['r']} is not live on this release: nothing to abort)")
                continue
            sched.finish_requests([p["r"]], RequestStatus.FINISHED_ABORTED)
            sync()
        elif action == "reset_prefix_cache":    # running: the scheduler first preempts every running request
            kw = {"reset_running_requests": True} if p.get("running") else {}
            if kw and "reset_running_requests" not in inspect.signature(sched.reset_prefix_cache).parameters:
                print("CANNOT PLAY: this vLLM's Scheduler.reset_prefix_cache has no reset_running_requests")
                sys.exit(2)
            if ASYNC and kw:              # (its in-flight outputs are stale for the requests it preempts)
                RESET_AT.update({o.request_id: FRAMES[0] for o in sched.running})
            print(f"    reset: {sched.reset_prefix_cache(**kw)}")
        elif action == "evict_blocks":
            mgr.evict_blocks({i for i in p["block_ids"] if 0 < i < NUM_BLOCKS})
        else:
            print(f"CANNOT PLAY: unknown action {action!r}")
            sys.exit(2)
    except (AssertionError, ValueError, KeyError, IndexError, TypeError, AttributeError, RuntimeError) as e:
        if CHECK != "vllm_internal_error":
            print(f"CANNOT PLAY: vLLM raised {type(e).__name__}: {e} (not the finding's check)")
            sys.exit(2)
        bugs.append(f"vLLM raised {type(e).__name__}: {e}")
    state()
    if bugs:
        print("BUG: " + "; ".join(dict.fromkeys(bugs)))
        sys.exit(1)
print("OK: the condition holds on every step (fixed, or not this release)")
sys.exit(0)
