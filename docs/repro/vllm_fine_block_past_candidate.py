# Standalone reproducer of a kvcheck finding (gen:1000991) on vLLM 0.33.0: lost reuse that depends
# on the order of the KV cache groups.
# layout (kvcheck's generated layout gen:1000991): 3 Mamba groups (MambaSpec, mamba_cache_mode="align",
# block 32), an MLA group (block 8) holding the EAGLE/MTP draft layers, 2 MLA indexer groups
# (MLAAttentionSpec cache_role=INDEXER, block 32; plain MLA block 32 on releases without the role),
# hash block (prefix_match_unit) 8: fine-grained hits inside a 32-token block.
# check lost_reuse: the hit must reach the longest prefix every group can serve.
# finding: one 40-token request computes 32 tokens and is preempted, comes back (hit 0), computes 24
# (the shared-prefix checkpoint) and is preempted again. The cache then holds everything a 24-token
# hit needs: the Mamba state after 24 tokens, the MLA group's blocks for tokens 0..31 (a 24-token hit
# plus the one hash unit EAGLE proves and drops), and the indexer groups' block 0, keyed at 32 tokens
# (tokens 0..31 of this very prompt; KV is append-only, so its first 24 positions are the prefix's).
# HybridKVCacheCoordinator.find_longest_cache_hit looks up the MLA EAGLE group first (full-attention
# groups are sorted first, then kept in group order): it cuts the candidate from 39 to 24. The indexer
# groups are then asked with max_length=24: FullAttentionManager's phase 1 probes 24 // 32 = 0 whole
# blocks and phase 2 probes only the interior keys at 24, 16, 8 (none: only a prompt's final hash
# boundary gets a partial entry), so they answer 0 and the whole hit collapses to 0. Asked at the
# full candidate they answer 32, and the coordinator's own rule for full attention ("downward-closed:
# ... just trim to the (reduced) current hit length") keeps their block 0 for a 24-token hit, which
# allocate_slots serves with a private copy (copy-on-write). The same cache state, with the groups in
# the other order (a model listing its indexer groups before the MLA group), gives 24.
# Needs only vLLM (the KV cache manager and the scheduler's chunk split run on CPU). Exit 1: the
# lookup returns less than the same state gives with the groups reordered (the bug); exit 0: the two
# orders agree (fixed, or a release without fine-grained Mamba hits: nothing to check). Prints every
# step's hit and block tables and each group's own answer.
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

HB, MB = 8, 32
PROMPT = [8, 16, 5, 16, 14, 31, 14, 37, 8, 20, 1, 9, 22, 18, 12, 33, 36, 30, 6, 37,
          36, 9, 11, 27, 27, 36, 28, 31, 22, 6, 12, 37, 19, 8, 13, 6, 23, 29, 1, 3]
BUDGETS = (86, 76, 86)        # the token budget of each admission (the trace's)
print(f"vLLM {vllm.__version__}")
if not hasattr(KVCacheManager, "take_kv_cache_block_copies"):
    print("this release has no fine-grained Mamba hits: nothing to check")
    sys.exit(0)
ku.init_none_hash(sha256)
role = getattr(getattr(kci, "SparseCacheRole", None), "INDEXER", None)
KINDS = ["mamba", "mamba", "mla", "indexer", "mamba", "indexer"]


def spec(kind):
    if kind == "mamba":      # an MTP drafter: the Mamba state keeps 2 speculative blocks
        return kci.MambaSpec(block_size=MB, shapes=((2, 4),), dtypes=(torch.float32,),
                             mamba_cache_mode="align", num_speculative_blocks=2)
    if kind == "mla":
        return kci.MLAAttentionSpec(block_size=8, num_kv_heads=1, head_size=16, dtype=torch.float32)
    return kci.MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=8, dtype=torch.float32,
                                **({"cache_role": role} if role is not None else {}))


groups = [kci.KVCacheGroupSpec([f"layer{i}"], spec(k), is_eagle_group=(k == "mla")) for i, k in enumerate(KINDS)]
cfg = kci.KVCacheConfig(num_blocks=96, kv_cache_tensors=[], kv_cache_groups=groups)
extra = ({"enable_mamba_shared_prefix_checkpoint": True}   # (releases that have shared-prefix checkpoints)
         if "enable_mamba_shared_prefix_checkpoint" in inspect.signature(KVCacheManager).parameters else {})
mgr = KVCacheManager(cfg, max_model_len=128, scheduler_block_size=MB, hash_block_size=HB, use_eagle=True, **extra)
coord = mgr.coordinator
assert coord.enable_partial_hash_hits
sched = SimpleNamespace(cache_config=SimpleNamespace(block_size=MB), block_size=MB, hash_block_size=HB,
                        use_eagle=True, use_eagle_block_drop=True, num_hash_lookahead_tokens=0,
                        mamba_partial_cache_hit=True, mamba_has_prefill_checkpoint_blocks=False,
                        mamba_prefill_checkpoint_alignment=None,
                        mamba_shared_prefix_checkpoint=getattr(mgr, "mamba_shared_prefix_checkpoint", False),
                        max_num_scheduled_tokens=0, scheduler_config=SimpleNamespace(long_prefill_token_threshold=0))
req = Request("r1", PROMPT, SamplingParams(max_tokens=16), None,
              block_hasher=ku.get_request_block_hasher(HB, sha256))
print("lookup order:", [(type(g.spec).__name__, g.group_ids, "EAGLE" if g.use_eagle else "")
                        for g in coord.attention_groups])
for n_adm, budget in enumerate(BUDGETS[:2]):
    blocks, hit, *junction = mgr.get_computed_blocks(req)
    if junction:
        req.shared_prefix_boundary = junction[0]
    sched.max_num_scheduled_tokens = chunk = min(budget, req.num_tokens - hit)
    n = Scheduler._mamba_block_aligned_split(sched, req, chunk, hit)
    assert mgr.allocate_slots(req, n, hit, blocks) is not None
    copies, retained = mgr.take_kv_cache_block_copies()
    mgr.block_pool.free_blocks(retained)
    req.status, req.num_computed_tokens = RequestStatus.RUNNING, hit + n
    print(f"admission {n_adm + 1}: hit {hit}, computes {n}; tables "
          f"{[[b.block_id for b in t] for t in mgr.get_blocks('r1').blocks]}; preempted")
    mgr.free(req)
    req.status, req.num_computed_tokens = RequestStatus.PREEMPTED, 0

# the state before the third admission: what each group holds and answers
hashes, M = req.block_hashes, req.num_tokens - 1
pool = mgr.block_pool
mamba_ids = [i for i, k in enumerate(KINDS) if k == "mamba"]
idx_ids = [i for i, k in enumerate(KINDS) if k == "indexer"]
state24 = bool(pool.get_cached_block(hashes[2], mamba_ids))
print(f"Mamba groups: a state keyed at 24 tokens: {state24}")
if not state24:      # (0.28.0: no shared-prefix checkpoint, so the second admission computes 32)
    print("this release does not reach the state (no Mamba state at 24 tokens): nothing to check")
    sys.exit(0)
print(f"MLA group (EAGLE): cached blocks keyed at 8..32 tokens: "
      f"{[bool(pool.get_cached_block(hashes[i], [2])) for i in range(4)]}, at 40: "
      f"{bool(pool.get_cached_block(hashes[4], [2]))}")
Full = type(coord.single_type_managers[idx_ids[0]])
for m in (M, 24):
    got, h = Full.find_longest_cache_hit(block_hashes=hashes, max_length=m, kv_cache_group_ids=idx_ids,
                                         block_pool=pool, kv_cache_spec=groups[idx_ids[0]].kv_cache_spec,
                                         drop_eagle_block=False, alignment_tokens=HB)
    print(f"indexer groups ({Full.__name__}) asked with max_length={m}: hit {h}, blocks "
          f"{[[b.block_id for b in t] for t in got]}")

blocks, hit, *_ = coord.find_longest_cache_hit(hashes, M)
print(f"lookup (groups in the model's order): hit {hit}, tables {[[b.block_id for b in t] for t in blocks]}")
saved = coord.attention_groups
coord.attention_groups = sorted(saved, key=lambda g: (not isinstance(g.spec, kci.FullAttentionSpec), g.use_eagle))
try:
    blocks2, hit2, *_ = coord.find_longest_cache_hit(hashes, M)
finally:
    coord.attention_groups = saved
print(f"same state, indexer groups looked up before the MLA group: hit {hit2}, tables "
      f"{[[b.block_id for b in t] for t in blocks2]}")
blocks3, hit3, *_ = mgr.get_computed_blocks(req)
print(f"admission 3 (get_computed_blocks): hit {hit3}")
if hit3 < hit2:
    print(f"BUG: the lookup returns {hit3} tokens; the cache holds a {hit2}-token hit for every group")
    sys.exit(1)
print("clean: both group orders give the same hit")
sys.exit(0)
