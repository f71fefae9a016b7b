"""Standalone reproducer (vLLM public classes only, no kvcheck): with EAGLE on a hybrid layout,
vLLM 0.23-0.28's HybridKVCacheCoordinator bounds the EAGLE look-ahead by `max_cache_hit_length`
(the prompt minus its last token) instead of the hashed tokens, so a prompt of whole blocks sent
again never sees its last block as the EAGLE peek block and loses one block of reuse.

Layout (Gemma 3 scaled down): full attention block 16 + five sliding-window groups (W=40, block
16), use_eagle=True. Request a (176 tokens = 11 blocks) is computed; request b with the same 176
tokens looks up while a runs. Every block is cached; with the EAGLE block dropped the usable hit
is 160 (blocks 0-9, block 10 the peek block). 0.28.0 returns 144. Exit 1 while the hit is short,
0 when fixed.
Tested: vLLM 0.23.0 and 0.28.0 hit 144 (exit 1); 0.33.0 hit 160 (exit 0); 0.14.1 (hit 0) and 0.18.1
(hit 128) fail too, with #32802's re-drop on top (docs/repro/vllm_eagle_redrop_32802.py).
"""
import inspect
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core import kv_cache_utils as ku  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,  # noqa: E402
                                        SlidingWindowSpec)
from vllm.v1.request import Request  # noqa: E402

try:
    from vllm.utils.hashing import sha256  # noqa: E402
except ImportError:                         # older releases
    from vllm.utils import sha256  # noqa: E402

ku.init_none_hash(sha256)
common = dict(num_kv_heads=1, head_size=8, dtype=torch.float32)
groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=16, **common))]
groups += [KVCacheGroupSpec([f"swa{i}"], SlidingWindowSpec(block_size=16, sliding_window=40, **common))
           for i in range(5)]
cfg = KVCacheConfig(num_blocks=96, kv_cache_tensors=[], kv_cache_groups=groups)
want = dict(max_model_len=256, hash_block_size=16, scheduler_block_size=16, use_eagle=True)
params = inspect.signature(KVCacheManager.__init__).parameters
mgr = KVCacheManager(cfg, **{k: v for k, v in want.items() if k in params})
hasher = ku.get_request_block_hasher(16, sha256)


def request(rid, tokens):
    extra = {"eos_token_id": None} if "eos_token_id" in Request.__init__.__code__.co_varnames else {}
    return Request(rid, tokens, SamplingParams(max_tokens=8), None, block_hasher=hasher, **extra)


prompt = [(7 * i + 3) % 97 + 1 for i in range(176)]  # 176 tokens: 11 whole blocks
a = request("a", prompt)
blocks, hit, *_ = mgr.get_computed_blocks(a)
mgr.allocate_slots(a, 176, hit, blocks)              # caches all 11 blocks; a keeps running

b = request("b", list(prompt))                     # the same prompt, sent again
blocks, hit, *_ = mgr.get_computed_blocks(b)
print(f"vLLM {getattr(sys.modules.get('vllm'), '__version__', '?')}: hit {hit} tokens (expected 160)")
for g, lst in enumerate(blocks.blocks):
    print(f"  group {g}: block table {[blk.block_id for blk in lst]}")
sys.exit(0 if hit == 160 else 1)
