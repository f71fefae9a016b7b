"""Standalone reproducer (vLLM public classes only, no kvcheck): when the hybrid hit is cut back
by a later group, vLLM 0.18-0.28's HybridKVCacheCoordinator truncates only the *first*
full-attention group to the reconciled hit; a second full-attention-type group (here MLA) keeps
the blocks of its own longer hit, so the block tables disagree with the hit length.

Layout (a generated one, seed 2000016): full attention block 16, MLA block 16, sliding-window
MLA (W=48) block 16. A 26-token prompt is computed and freed (block 0 of each group cached), then
the sliding-window MLA group's cached block is evicted. The same prompt looks up: full attention
and MLA hit 16 tokens, the sliding-window MLA group none, so the reconciled hit is 0 — and every
group must return 0 blocks. Exit 1 while a group returns blocks beyond the hit, 0 when fixed.
Tested: exit 1 on vLLM 0.18.1 (plain SWA as the window group), 0.23.0 and 0.28.0 (MLA returns block [3]
for a 0-token hit); exit 0 on 0.33.0 (every full-attention group truncated) and on 0.14.1.
"""
import inspect
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core import kv_cache_utils as ku  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1 import kv_cache_interface as kci  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,  # noqa: E402
                                        MLAAttentionSpec, SlidingWindowSpec)
from vllm.v1.request import Request  # noqa: E402

try:
    from vllm.utils.hashing import sha256  # noqa: E402
except ImportError:                         # older releases
    from vllm.utils import sha256  # noqa: E402

ku.init_none_hash(sha256)
specs = [FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32),
         MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32),
         # the window group: sliding-window MLA where the release has it (0.23+), else plain SWA
         (kci.SlidingWindowMLASpec(block_size=16, sliding_window=48, num_kv_heads=1, head_size=16, dtype=torch.float32)
          if hasattr(kci, "SlidingWindowMLASpec")
          else SlidingWindowSpec(block_size=16, sliding_window=48, num_kv_heads=1, head_size=8, dtype=torch.float32))]
cfg = KVCacheConfig(num_blocks=30, kv_cache_tensors=[],
                    kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])
want = dict(max_model_len=256, hash_block_size=16, scheduler_block_size=16)
params = inspect.signature(KVCacheManager.__init__).parameters
mgr = KVCacheManager(cfg, **{k: v for k, v in want.items() if k in params})
hasher = ku.get_request_block_hasher(16, sha256)


def request(rid, tokens):
    extra = {"eos_token_id": None} if "eos_token_id" in Request.__init__.__code__.co_varnames else {}
    return Request(rid, tokens, SamplingParams(max_tokens=8), None, block_hasher=hasher, **extra)


prompt = [30, 7, 34, 14, 25, 3, 35, 0, 18, 29, 22, 2, 35, 1, 25, 11, 23, 35, 8, 33, 13, 4, 20, 39, 0, 27]
a = request("a", prompt)
blocks, hit, *_ = mgr.get_computed_blocks(a)
mgr.allocate_slots(a, len(prompt), hit, blocks)     # caches block 0 (tokens 0..15) of every group
table = mgr.get_block_ids("a")
mgr.free(a)
mgr.evict_blocks({table[2][0]})                    # the sliding-window MLA group's block 0 goes

b = request("b", list(prompt))
blocks, hit, *_ = mgr.get_computed_blocks(b)
print(f"vLLM {getattr(sys.modules.get('vllm'), '__version__', '?')}: hit {hit} tokens")
bad = []
for g, lst in enumerate(blocks.blocks):
    ids = [blk.block_id for blk in lst]
    want_n = -(-hit // specs[g].block_size)
    print(f"  group {g} ({type(specs[g]).__name__}): block table {ids} (a {hit}-token hit needs {want_n})")
    if len([i for i in ids if i]) > want_n:
        bad.append(g)
if bad:
    print(f"BUG: group(s) {bad} return blocks beyond the {hit}-token hit")
sys.exit(1 if bad else 0)
