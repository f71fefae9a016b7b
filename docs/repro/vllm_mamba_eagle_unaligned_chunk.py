# Standalone reproducer of a kvcheck finding on vLLM 0.18.1 and 0.23.0 (fixed in 0.28.0 and 0.33.0)
# layout: full attention + a Mamba group (MambaSpec, mamba_cache_mode="align"), block 4, with an
# EAGLE/MTP drafter (KVCacheManager(use_eagle=True)), as kvcheck's `qwen3-next+mtp` at toy scale.
# check hash_map_sound (then hit_sound_recurrent_state): a published Mamba state block must hold the
# state after exactly its key's tokens.
# finding: with EAGLE, Scheduler._mamba_block_aligned_split backs last_cache_position off by one
# block and accepts any chunk past it. A chunk that ends mid-block (a token budget shared with other
# requests) leaves the running state (the state after 9 tokens) in block 2 of the request's Mamba
# table; the next chunk crosses token 12, and MambaManager.cache_blocks publishes block 2 as the
# state after 12 tokens. A later request that shares 16 tokens hits 12 tokens and resumes from that
# block: the recurrent state of 9 tokens stands for 12 (silent corruption). Upstream: vLLM issue
# #43559, fixed by PR #51113 ("Keep mamba align prefill chunks block-aligned past
# last_cache_position": a chunk starting mid-block stops at the next block boundary).
# Needs only vLLM (the KV cache manager and the scheduler's split run on CPU). The chunks are the
# release's own Scheduler._mamba_block_aligned_split for the token budget of each step; the worker's
# rule (gpu_model_runner / mamba_utils.preprocess_mamba) puts the state after n computed tokens in
# block cdiv(n, 4) - 1. Exit 1: the bug is present; exit 0: fixed. Prints every step, the hit and
# the Mamba block table.
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

BS = 4                       # the block size of both groups = the hash block = the Mamba block
PROMPT = list(range(1, 15))  # 14 tokens
BUDGETS = [10, 1, 100]       # the token budget left for A in each step (other requests use the rest)


def cdiv(a, b):
    return -(-a // b)


ku.init_none_hash(sha256)
specs = [kci.FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32),
         kci.MambaSpec(block_size=BS, shapes=((2, 4),), dtypes=(torch.float32,), mamba_cache_mode="align")]
flag = "is_eagle_group" in inspect.signature(kci.KVCacheGroupSpec).parameters
groups = [kci.KVCacheGroupSpec([f"layer{i}"], s, **({"is_eagle_group": i == 0} if flag else {}))
          for i, s in enumerate(specs)]
cfg = kci.KVCacheConfig(num_blocks=40, kv_cache_tensors=[], kv_cache_groups=groups)
kw = {"scheduler_block_size": BS} if "scheduler_block_size" in inspect.signature(KVCacheManager).parameters else {}
mgr = KVCacheManager(cfg, max_model_len=64, hash_block_size=BS, use_eagle=True, **kw)
mamba = mgr.coordinator.single_type_managers[1]
hasher = ku.get_request_block_hasher(BS, sha256)
EOS = {"eos_token_id": None} if "eos_token_id" in inspect.signature(Request).parameters else {}
# the scheduler's settings its split reads (an EAGLE/MTP drafter, a 2048-token step budget)
sched = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS), block_size=BS, hash_block_size=BS,
                        use_eagle=True, use_eagle_block_drop=True, num_hash_lookahead_tokens=0,
                        mamba_partial_cache_hit=False, mamba_has_prefill_checkpoint_blocks=False,
                        mamba_prefill_checkpoint_alignment=None, mamba_shared_prefix_checkpoint=False,
                        max_num_scheduled_tokens=2048,
                        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0))
state_after = {}             # Mamba block id -> the tokens its state was last computed over (worker)
stale = []                   # (block id, tokens its key says, tokens its state is over), as published


def request(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=32), None, block_hasher=hasher, **EOS)


def step(req, n, new_computed=0, blocks=None):
    if req.num_computed_tokens + new_computed + n < req.num_tokens:   # only a prefill is split
        n = Scheduler._mamba_block_aligned_split(sched, req, n, new_computed)
    if n == 0:
        print(f"  {req.request_id}: the split schedules no tokens this step")
        return
    args = (new_computed, blocks) if blocks is not None else ()
    assert mgr.allocate_slots(req, n, *args) is not None
    req.num_computed_tokens += new_computed + n
    table = mamba.req_to_blocks[req.request_id]
    state_after[table[cdiv(req.num_computed_tokens, BS) - 1].block_id] = req.num_computed_tokens
    if req.num_computed_tokens == req.num_tokens:
        req.append_output_token_ids(90 + req.num_tokens)            # the sampled token
    print(f"  {req.request_id}: {n} tokens -> {req.num_computed_tokens} computed; Mamba table "
          + str([None if b.is_null else (b.block_id, "cached" if b.block_hash is not None else "-") for b in table]))
    for i, b in enumerate(table):
        if not b.is_null and b.block_hash is not None and state_after.get(b.block_id) != (i + 1) * BS \
                and b.block_id not in [x[0] for x in stale]:
            stale.append((b.block_id, (i + 1) * BS, state_after.get(b.block_id)))
            print(f"  PUBLISHED STALE: Mamba block #{b.block_id} is cached as the state after {(i + 1) * BS} "
                  f"tokens, but its state is the one after {state_after.get(b.block_id)} tokens")


print(f"vLLM {vllm.__version__}")
a = request("A", PROMPT)
a.status = RequestStatus.RUNNING
for i, budget in enumerate(BUDGETS):
    print(f"step {i + 1}: budget {budget}")
    step(a, min(budget, a.num_tokens - a.num_computed_tokens))
while a.num_computed_tokens < 16:                                     # A decodes past token 16
    step(a, 1)
b = request("B", list(a.all_token_ids[:16]) + [70, 71, 72])         # a conversation's next turn
blocks, hit, *_ = mgr.get_computed_blocks(b)
resume = blocks.blocks[1][-1] if hit else None
print(f"B shares 16 tokens with A: hit {hit} tokens; Mamba hit blocks "
      f"{[None if x.is_null else x.block_id for x in blocks.blocks[1]]}; the state it resumes from was "
      f"computed over {state_after.get(resume.block_id) if resume else None} tokens")
bad = bool(stale) or (hit and state_after.get(resume.block_id) != hit)
print("BUG PRESENT" if bad else "clean: every published state is the state at its block's end")
sys.exit(1 if bad else 0)
