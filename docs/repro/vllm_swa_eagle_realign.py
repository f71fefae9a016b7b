"""Standalone reproducer (vLLM public classes only, no kvcheck): EAGLE + sliding window with a
block smaller than the hit alignment loses a whole alignment unit of reuse when the hit lies
inside the first window.

Layout: full attention block 8 + sliding window W=20 block 4 (scheduler block 8, hash block 4),
use_eagle=True. A 24-token prompt is computed and freed; a request with the same 24 tokens plus
one more looks up. Every block a hit of 16 tokens needs is cached (full: blocks 0-1 and the
EAGLE peek block 2; SWA: blocks 0-3 of the window and the peek block 4), so the expected hit is
16. SlidingWindowManager.find_longest_cache_hit, on its "no full window run" path, first rounds
the 5-block run (20 tokens) down to the alignment (16), then pops the EAGLE block (12) and
rounds again (8): hit 8. Popping first (20 -> 16, aligned) keeps 16.
Exit 1 while the hit is short, 0 when fixed (exit 1 on vLLM 0.23.0, 0.28.0, 0.33.0); exit 2 on a
release without scheduler_block_size (0.14.1, 0.18.1: the layout cannot be expressed there).
"""
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_utils as ku  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,  # noqa: E402
                                        SlidingWindowSpec)
from vllm.v1.request import Request  # noqa: E402

ku.init_none_hash(sha256)
common = dict(num_kv_heads=1, head_size=8, dtype=torch.float32)
cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
    KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=8, **common)),
    KVCacheGroupSpec(["swa"], SlidingWindowSpec(block_size=4, sliding_window=20, **common))])
import inspect  # noqa: E402
if "scheduler_block_size" not in inspect.signature(KVCacheManager).parameters:
    print("CANNOT PLAY: this vLLM's KVCacheManager has no scheduler_block_size (a block smaller than the hit "
          "alignment with EAGLE is not expressible here)")
    sys.exit(2)
mgr = KVCacheManager(cfg, max_model_len=64, hash_block_size=4, scheduler_block_size=8, use_eagle=True)
hasher = ku.get_request_block_hasher(4, sha256)


def request(rid, tokens):
    extra = {"eos_token_id": None} if "eos_token_id" in Request.__init__.__code__.co_varnames else {}
    return Request(rid, tokens, SamplingParams(max_tokens=8), None, block_hasher=hasher, **extra)


prompt = list(range(1, 25))                        # 24 tokens
a = request("a", prompt)
blocks, hit, *_ = mgr.get_computed_blocks(a)
mgr.allocate_slots(a, 24, hit, blocks)
a.num_computed_tokens = 24
a.append_output_token_ids(99)                      # the forward's sampled token
mgr.allocate_slots(a, 1)                           # caches the 24 prompt tokens' blocks
mgr.free(a)

b = request("b", prompt + [7])                     # same prompt, one more token
blocks, hit, *_ = mgr.get_computed_blocks(b)
print(f"vLLM hit: {hit} tokens (expected 16)")
for g, lst in enumerate(blocks.blocks):
    print(f"  group {g}: block table {[blk.block_id for blk in lst]}")
sys.exit(0 if hit == 16 else 1)
