# Standalone reproducer of a kvcheck finding on vLLM 0.26.0-0.33.0 (exit 1 on 0.26.0, 0.27.1, 0.28.0,
# 0.33.0; 0 on 0.25.x, without fine-grained Mamba hits): layout qwen3-next-fine+mtp
# at toy scale: a full-attention group + a Mamba group (mamba_cache_mode="align"), block 8, hash block
# (prefix_match_unit) 4 (fine-grained hits inside a block), an EAGLE/MTP drafter on the full group.
# check state_copy_sound: a copy the step runs before its forward (kv_cache_block_copies, applied in
# gpu_model_runner._update_states) must read bytes an earlier forward wrote.
# finding: within one scheduler step, request C is admitted first and publishes its full-attention
# block 0 (tokens 0..7) at schedule time; request D, admitted in the same step, matches that block
# (EAGLE matches one hash unit past the candidate), but the reconciled hit ends at token 4 inside it
# because the Mamba state there comes from an older request (B, an earlier step, whose prefill stopped
# at its prompt's checkpoint: 0.28 and 0.33 place that checkpoint differently, so B's prompt length is
# tried from 5 to 9 tokens, each on a fresh manager; not refused by the
# Mamba same-step rule, which guards only Mamba blocks). D resumes inside the block, so allocate_slots
# gives D a private copy of C's block 0 (copy-on-write) and queues the copy; the copy runs before the
# step's forward, which is what writes C's block 0. D's copy holds no KV for tokens 0..3.
# Needs only vLLM (the KV cache manager and the scheduler's split run on CPU). Exit 1: a copy reads a
# block published in the same step (the bug); exit 0: no such copy (fixed, or a release without
# fine-grained Mamba hits: nothing to check). Prints each step, the hits and the copies.
import inspect
import os
import sys
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
import torch
import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1 import kv_cache_interface as kci
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

BS, HB = 8, 4
X = list(range(1, 25))
print(f"vLLM {vllm.__version__}")
if not hasattr(KVCacheManager, "take_kv_cache_block_copies"):
    print("this release has no fine-grained Mamba hits (no copy-on-write): nothing to check")
    sys.exit(0)
ku.init_none_hash(sha256)
specs = [kci.FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32),
         kci.MambaSpec(block_size=BS, shapes=((2, 4),), dtypes=(torch.float32,), mamba_cache_mode="align")]
groups = [kci.KVCacheGroupSpec([f"layer{i}"], s, is_eagle_group=(i == 0)) for i, s in enumerate(specs)]
hasher = ku.get_request_block_hasher(HB, sha256)
published = set()            # blocks that got a prefix-cache key in the current scheduler step
mgr = sched = None


def build():
    global mgr, sched
    cfg = kci.KVCacheConfig(num_blocks=40, kv_cache_tensors=[], kv_cache_groups=groups)
    mgr = KVCacheManager(cfg, max_model_len=64, scheduler_block_size=BS, hash_block_size=HB, use_eagle=True)
    assert mgr.coordinator.enable_partial_hash_hits
    sched = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS), block_size=BS, hash_block_size=HB,
                            use_eagle=True, use_eagle_block_drop=True, num_hash_lookahead_tokens=0,
                            mamba_partial_cache_hit=True, mamba_has_prefill_checkpoint_blocks=False,
                            mamba_prefill_checkpoint_alignment=None,
                            mamba_shared_prefix_checkpoint=getattr(mgr, "mamba_shared_prefix_checkpoint", False),
                            max_num_scheduled_tokens=2048,
                            scheduler_config=SimpleNamespace(long_prefill_token_threshold=0))


def admit(rid, tokens, budget):
    """The scheduler's waiting loop for one request: lookup, chunk split, allocate_slots."""
    req = Request(rid, tokens, SamplingParams(max_tokens=16), None, block_hasher=hasher)
    blocks, hit, *junction = mgr.get_computed_blocks(req)
    if junction:
        req.shared_prefix_boundary = junction[0]
    n = Scheduler._mamba_block_aligned_split(sched, req, min(budget, req.num_tokens - hit), hit)
    before = {b.block_id for b in mgr.block_pool.blocks if b.block_hash is not None}
    assert mgr.allocate_slots(req, n, hit, blocks) is not None
    published.update(b.block_id for b in mgr.block_pool.blocks if b.block_hash is not None
                     and b.block_id not in before)
    req.status, req.num_computed_tokens = RequestStatus.RUNNING, hit + n
    print(f"  {rid}: hit {hit} (full blocks {[b.block_id for b in blocks.blocks[0]]}, Mamba blocks "
          f"{[None if b.is_null else b.block_id for b in blocks.blocks[1]]}), computes {n} -> "
          f"{req.num_computed_tokens}; tables {[[b.block_id for b in t] for t in mgr.get_blocks(rid).blocks]}")
    return req


def step(*admissions):
    mgr.new_step_starts()
    published.clear()
    for a in admissions:
        admit(*a)
    copies, retained = mgr.take_kv_cache_block_copies()
    mgr.block_pool.free_blocks(retained)      # the step's scheduling is over (sync scheduling)
    bad = [c for c in copies if c.src_block_id in published]
    for c in copies:
        print(f"  copy #{c.src_block_id} -> #{c.dst_block_id} (before the forward)"
              + ("  <-- its source was published in this step: the forward that writes it has not run"
                 if c in bad else ""))
    return bad


bad = []
for nb in range(5, 10):
    build()
    print(f"B has {nb} tokens. step 1: B's prefill stops at its prompt's checkpoint")
    step(("B", X[:nb], 100))
    print("step 2: C is admitted (publishes its block 0), then D, which shares 12 tokens")
    bad += step(("C", X[:24], 8), ("D", X[:12] + [90, 91, 92, 93], 100))
    if bad:
        break
print("BUG PRESENT" if bad else "clean: no copy reads a block published in the same step")
sys.exit(1 if bad else 0)
