"""Standalone reproducer (vLLM public classes only, no kvcheck): with EAGLE/MTP, a single-group
model (UnitaryKVCacheCoordinator) reuses one block less than the same lookup in the hybrid
coordinator when the request's length is a multiple of the block size.

The hybrid coordinator lets an EAGLE group match one block past the candidate hit (the
"eagle margin", up to the hashed tokens) and then drops it; the unitary coordinator passes
max_length = num_tokens - 1 with drop_eagle_block=True and no margin, so it drops a block it
never matched past. Here: block 4, a 24-token prompt computed and freed, then resent: every
block is cached, the hybrid rule gives 20 (blocks 0-4, the peek block 5 proven), unitary 16.
Exit 1 while the hit is short, 0 when fixed. Exit 1 on vLLM 0.14.1, 0.18.1, 0.23.0, 0.28.0, 0.33.0.
"""
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_utils as ku  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

ku.init_none_hash(sha256)
spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
import inspect  # noqa: E402
sched = {"scheduler_block_size": 4} if "scheduler_block_size" in inspect.signature(KVCacheManager).parameters else {}
mgr = KVCacheManager(cfg, max_model_len=64, hash_block_size=4, use_eagle=True, **sched)   # (the block is the scheduler block)
hasher = ku.get_request_block_hasher(4, sha256)


def request(rid, tokens):
    extra = {"eos_token_id": None} if "eos_token_id" in Request.__init__.__code__.co_varnames else {}
    return Request(rid, tokens, SamplingParams(max_tokens=8), None, block_hasher=hasher, **extra)


prompt = list(range(1, 25))                        # 24 tokens: a multiple of the block
a = request("a", prompt)
blocks, hit, *_ = mgr.get_computed_blocks(a)
mgr.allocate_slots(a, 24, hit, blocks)
a.num_computed_tokens = 24
a.append_output_token_ids(99)
mgr.allocate_slots(a, 1)
mgr.free(a)

b = request("b", prompt)                           # the same prompt resent
blocks, hit, *_ = mgr.get_computed_blocks(b)
print(f"vLLM hit: {hit} tokens (expected 20, as the hybrid coordinator's eagle margin gives)")
print(f"  block table {[blk.block_id for blk in blocks.blocks[0]]}")
sys.exit(0 if hit == 20 else 1)
