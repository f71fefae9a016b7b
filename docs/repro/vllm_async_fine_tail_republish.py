# Standalone reproducer of a kvcheck finding on vLLM 0.26.0 (fine-grained Mamba prefix hits under
# async scheduling, vLLM's default): layout full+mamba-fine, a full-attention group + a Mamba group
# (mamba_cache_mode="align"), block 8, prefix_match_unit (hash block) 4: a prompt that ends inside a
# Mamba block gets a *partial* prefix-cache entry on the block holding the request's running state
# (MambaManager._cache_partial_tail_block). The next allocate_slots moves that entry to a private
# copy (copy-on-write, queued before the step's forward), because the running request keeps writing
# its state into the block.
# finding (check hash_map_sound): under AsyncScheduler the decode of frame N+1 is scheduled before
# frame N's sampled token is known, so allocate_slots caches min(computed + new, request.num_tokens)
# = the prompt again and _cache_partial_tail_block re-registers the entry on the running block it just
# moved away from; frame N+1's forward then advances the state in that block in place: a prefix-cache
# key for the prompt's tokens maps to a block whose state is of a longer sequence (and the next step's
# copy-on-write copies that advanced state under the same key). With the synchronous Scheduler the
# sampled token is appended first (num_tokens = prompt + 1): no re-registration.
# Drives vLLM's own Scheduler / AsyncScheduler (schedule -> copies -> forward -> update_from_output,
# async: the engine core's two-deep batch queue); the fake worker writes a request's Mamba state into
# the last block of its Mamba table at the end of each forward, copies first.
# Needs only vLLM (+ transformers, to write a tiny model's config.json; nothing is downloaded).
# Usage: python vllm_async_fine_tail_republish.py [--sync] [--prompt N]
# Exit 1: a prefix-cache key maps to a Mamba block holding another sequence's state (the bug);
# 0: none; 2: this release has no fine-grained Mamba hits (nothing to check).
import atexit
import contextlib
import inspect
import io
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
import torch
import vllm
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1 import kv_cache_interface as kci
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BS, HB, MAMBA = 8, 4, 1          # block, hash block, the Mamba group's index
SYNC = "--sync" in sys.argv
PROMPT = int(sys.argv[sys.argv.index("--prompt") + 1]) if "--prompt" in sys.argv else 4
print(f"vLLM {vllm.__version__}; {'Scheduler (synchronous)' if SYNC else 'AsyncScheduler (batch queue)'}; "
      f"a prompt of {PROMPT} tokens")
if "prefix_match_unit" not in inspect.signature(CacheConfig).parameters:
    print("this release has no prefix_match_unit (no fine-grained hits): nothing to check")
    sys.exit(2)


def fit(fn, kw):
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kw.items() if k in params}


def build():
    from transformers import LlamaConfig
    d = tempfile.mkdtemp(prefix="kvcheck-model-")
    atexit.register(shutil.rmtree, d, True)
    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=128).save_pretrained(d)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        mc = ModelConfig(model=d, skip_tokenizer_init=True, max_model_len=128, dtype="float32")
    sc = SchedulerConfig(**fit(SchedulerConfig, dict(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128,
                                                     enable_chunked_prefill=True, is_encoder_decoder=False)))
    sc.async_scheduling = not SYNC
    cc = CacheConfig(block_size=BS, enable_prefix_caching=True, prefix_match_unit=HB, mamba_cache_mode="align")
    cc.num_gpu_blocks = 40
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
        vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, device_config=DeviceConfig(device="cpu"))
    finally:
        tu.HAS_TRITON = had
        del cp.check_and_update_config
    assert vc.scheduler_config.async_scheduling == (not SYNC)
    specs = [kci.FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32),
             kci.MambaSpec(block_size=BS, shapes=((2, 4),), dtypes=(torch.float32,), mamba_cache_mode="align")]
    kcfg = kci.KVCacheConfig(num_blocks=40, kv_cache_tensors=[],
                             kv_cache_groups=[kci.KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)])
    cls = Scheduler if SYNC else AsyncScheduler
    return cls(**fit(Scheduler, dict(vllm_config=vc, kv_cache_config=kcfg, block_size=BS, hash_block_size=HB,
                               log_stats=False, structured_output_manager=StructuredOutputManager(vc))))


ku.init_none_hash(sha256)
sched = build()
mgr = sched.kv_cache_manager
pool = mgr.block_pool
if not getattr(mgr.coordinator, "enable_partial_hash_hits", False):
    print("this release's coordinator has no partial (fine-grained) hash hits: nothing to check")
    sys.exit(2)
hasher = ku.get_request_block_hasher(HB, sha256)
STATE = {}                      # Mamba block id -> the tokens whose state its bytes hold
reqs, bugs, SEEN = {}, [], set()


def mamba_table(rid):
    return mgr.coordinator.single_type_managers[MAMBA].req_to_blocks.get(rid, [])


def forward(so):
    """The worker: the step's queued block copies, then its forward (each request's state at the end
    of its scheduled tokens, written into the last block of its Mamba table)."""
    for c in getattr(so, "kv_cache_block_copies", None) or ():
        STATE[c.dst_block_id] = STATE.get(c.src_block_id)
        print(f"      copy #{c.src_block_id} -> #{c.dst_block_id}")
    for rid, n in so.num_scheduled_tokens.items():
        end = ENDS[id(so)][rid]
        t = [b for b in mamba_table(rid) if not b.is_null]
        STATE[t[-1].block_id] = tuple(TOKENS[rid][:end])
        print(f"      {rid}'s forward: state of {end} tokens into #{t[-1].block_id}")


def blocks_of(key):
    """The blocks a prefix-cache key maps to (the map holds one block, or a dict of them; 0.34: block ids)."""
    got = pool.cached_block_hash_to_block._cache.get(key)
    got = list(got.values()) if isinstance(got, dict) else [] if got is None else [got]
    return [pool.blocks[b] if isinstance(b, int) else b for b in got]


def check():
    """hash_map_sound for the Mamba group: every key of a request's prefix of L tokens that maps to a
    Mamba block maps to one whose bytes hold that prefix's state."""
    for rid, o in reqs.items():
        for i, h in enumerate(o.block_hashes):
            blocks = blocks_of(ku.make_block_hash_with_group_id(h, MAMBA))
            want = tuple(TOKENS[rid][:(i + 1) * HB])
            for b in blocks:
                if STATE.get(b.block_id, want) != want and (rid, b.block_id, STATE[b.block_id]) not in SEEN:
                    SEEN.add((rid, b.block_id, STATE[b.block_id]))
                    bugs.append(f"the prefix-cache key of {rid}'s first {len(want)} tokens maps to Mamba block "
                                f"#{b.block_id}, whose state is of {len(STATE[b.block_id])} tokens")
                    print("    BUG: " + bugs[-1])


TOKENS = {"A": list(range(1, PROMPT + 1))}
o = Request(**fit(Request, dict(request_id="A", prompt_token_ids=list(TOKENS["A"]),
                                sampling_params=SamplingParams(max_tokens=6, ignore_eos=True), pooling_params=None,
                                eos_token_id=None, block_hasher=hasher)))
reqs["A"] = o
sched.add_request(o)
INFLIGHT = []                   # the batch queue: scheduled frames whose output has not come back
ENDS = {}                       # id(SchedulerOutput) -> rid -> the end of its scheduled tokens


def output(so):
    ids = list(so.num_scheduled_tokens)
    extra = fit(ModelRunnerOutput, {"req_id_to_index": {r: i for i, r in enumerate(ids)}})
    for k, p in inspect.signature(ModelRunnerOutput).parameters.items():
        if p.default is inspect.Parameter.empty and k not in ("req_ids", "sampled_token_ids") and k not in extra:
            extra[k] = [] if "list" in str(p.annotation) else {} if "dict" in str(p.annotation) else None
    toks = []
    for r in ids:                   # a token only for a request whose prompt is done after this frame
        toks.append([40 + len(TOKENS[r])] if ENDS[id(so)][r] >= reqs[r].num_prompt_tokens else [])
    for r, t in zip(ids, toks):
        TOKENS[r] += t
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks, **extra)


def run():
    """A runs to its end: synchronously, schedule -> forward -> output; async, the engine core's batch
    queue (frame N+1 is scheduled before frame N's output comes back, and runs after it)."""
    frame = 0
    while sched.requests or INFLIGHT:
        so = sched.schedule()
        if so.num_scheduled_tokens:
            frame += 1
            print(f"  frame {frame}: scheduled {dict(so.num_scheduled_tokens)}; A's Mamba table "
                  f"{[b.block_id for b in mamba_table('A')]}")
            INFLIGHT.append(so)
            ENDS[id(so)] = {r: reqs[r].num_computed_tokens for r in so.num_scheduled_tokens}
        elif not INFLIGHT:
            break
        if SYNC or len(INFLIGHT) == 2 or not so.num_scheduled_tokens:
            prev = INFLIGHT.pop(0)
            if prev is not so:
                sched.update_from_output(prev, output(prev))
        if so.num_scheduled_tokens:
            forward(so)
            if SYNC:
                sched.update_from_output(so, output(so))
                INFLIGHT.clear()
        check()


def consequence():
    """What a later request reads: blocks are taken from the free queue (LRU: the pool's own eviction)
    until no good copy of the prefix's state is left cached; then B, A's prompt plus 4 tokens, looks up."""
    key = ku.make_block_hash_with_group_id(reqs["A"].block_hashes[PROMPT // HB - 1], MAMBA)
    want, taken = tuple(TOKENS["A"][:PROMPT // HB * HB]), []
    while any(STATE.get(b.block_id) == want for b in blocks_of(key)) and pool.get_num_free_blocks() > 0:
        taken += pool.get_new_blocks(1)
    print(f"    other requests take {len(taken)} free blocks (the pool evicts in LRU order); the key of A's prompt "
          f"maps to {sorted(b.block_id for b in blocks_of(key))}")
    b = Request(**fit(Request, dict(request_id="B", prompt_token_ids=TOKENS["A"][:PROMPT] + [60, 61, 62, 63],
                                    sampling_params=SamplingParams(max_tokens=2), pooling_params=None,
                                    eos_token_id=None, block_hasher=hasher)))
    hit, n = mgr.get_computed_blocks(b)[:2]
    blk = hit.blocks[MAMBA][-1] if n else None
    got = STATE.get(blk.block_id) if blk is not None else None
    print(f"    B's lookup: a hit of {n} tokens" + (f", Mamba state from #{blk.block_id}: the state of {len(got)} "
                                                     f"tokens {'(right)' if got == want else '(WRONG: B would resume from it)'}"
                                                     if blk is not None and got else ""))
    pool.free_blocks(taken)


run()
KEY = ku.make_block_hash_with_group_id(reqs["A"].block_hashes[PROMPT // HB - 1], MAMBA)
print(f"  after A: the key of A's first {PROMPT // HB * HB} tokens maps to Mamba blocks "
      f"{[(b.block_id, len(STATE.get(b.block_id, ()))) for b in blocks_of(KEY)]} (block, tokens of its state)")
if bugs:
    consequence()


print("BUG: " + bugs[0] if bugs else "no stale prefix-cache entry on a Mamba block")
sys.exit(1 if bugs else 0)
