"""Engine faults: planted bugs in the reference engine, each reproducing one real bug class.

Importing this module registers them in kvcheck.spec.faults (layer "engine"). `expected` is the
check that must catch the fault in `kvcheck diff` (run_reference_diff): a spec invariant
evaluated on the engine's own abstract state (exit 10), the differential oracle
`reuse_equals_recompute` (exit 11), or a conformance check against the spec
(`decision_matches_spec` / `abstract_state_matches_spec`, exit 13).
"""
from __future__ import annotations

from kvcheck.spec.faults import FAULTS, Fault, register

ENGINE_FAULTS: tuple[Fault, ...] = (
    Fault("engine_tail_check_skipped", "engine", "tail dropped / wrong tail",
          "class of bug: DeepSeek-V4-style compressed layers resumed inside a compression block "
          "without the uncompressed tail (hybrid-cache designs in vLLM/SGLang only track whole entries)",
          "hit_sound_tail", "Funnel layer 3 does not check the tail snapshot at the hit point."),
    Fault("engine_swa_window_off_by_one", "engine", "window not covering needed positions",
          "vLLM sliding-window prefix caching: null-block / window-edge accounting "
          "(SlidingWindowManager.find_longest_cache_hit) off by one page",
          "hit_sound_swa_window", "Layer 3 skips the first page of each finite SWA window."),
    Fault("engine_indexer_version_ignored", "engine", "indexer stale after restore",
          "DeepSeek-V3.2 sparse-attention indexer cache restored under another indexer version "
          "(class of bug)", "hit_sound_indexer",
          "Layer 2 does not compare the indexer keys' version with the current indexer."),
    Fault("engine_indexer_lag_not_checked", "engine", "indexer lagging the KV",
          "DeepSeek-V3.2 indexer keys written asynchronously after the KV (class of bug)",
          "hit_sound_indexer", "Layer 3 accepts indexer keys that are still being written."),
    Fault("engine_offload_ready_before_write", "engine", "offload marked ready before the copy completes",
          "LMCache / SGLang HiCache: a write-back registered as stored before the write is acknowledged",
          "abstract_state_matches_spec",
          "offload_start acknowledges the copy as durable at submission, not at write completion."),
    Fault("engine_load_before_checksum", "engine", "placeholder or corrupt data served as a hit",
          "LMCache local-disk backend: loaded chunks used before integrity/metadata checks (class of bug)",
          "abstract_state_matches_spec",
          "Loaded copies are placed without checking the checksum or the header."),
    Fault("engine_disk_copy_key_unchecked", "engine", "copy of another block served as a hit",
          "disk/remote KV stores that check a copy's checksum and model header but not that it "
          "was written for the requested key (file naming collisions, shared cache directories; "
          "class of bug)", "sut_rejected_enabled_action",
          "The load path does not compare the copy's binding (key, block, objects) with the "
          "requested block: a valid copy of another block at this block's path passes."),
    Fault("engine_no_revalidation_at_use", "engine", "TOCTOU: lease not re-validated at use",
          "vLLM state_data_ptrs / version re-check skipped before the kernel reads (class of bug)",
          "toctou_bound_stable", "`use` runs a bound request without re-validating its lease."),
    Fault("engine_pinned_object_evicted", "engine", "hit evicted between lookup and pin",
          "vLLM/SGLang prefix hit freed by the evictor while a request still references it",
          "toctou_bound_stable", "Eviction ignores reference counts and graph pins."),
    Fault("engine_graph_pages_migrated", "engine", "CUDA-graph replay of stale tables",
          "vLLM/SGLang CUDA graphs capturing block-table addresses that compaction later moves",
          "graph_topology", "Compaction moves pages a captured graph references."),
    Fault("engine_shared_free_list", "engine", "groups aliasing memory",
          "vLLM hybrid KV cache groups sharing one block pool with mismatched page sizes (class of bug)",
          "five_state_routing", "SWA pages are allocated from the tail pool."),
    Fault("engine_admission_cap_ignored", "engine", "admission cap ignored",
          "cache growth crowding out new requests / OOM (SGLang radix cache without a reserve)",
          "admission_cap", "`append` allocates past the pool's admission cap."),
    Fault("engine_abi_version_ignored", "engine", "layout or version change not invalidating a cache",
          "persisted KV reused after a kernel/page-layout change (LMCache format versions; class of bug)",
          "hit_sound_layout", "Layer 2 does not compare the objects' ABI/layout version."),
    Fault("engine_misaligned_address_accepted", "engine", "misaligned physical address",
          "bounce-buffer restores placed off the kernel's required alignment (class of bug)",
          "hit_sound_layout", "Layer 4 does not check the physical addresses' alignment."),
    Fault("engine_refcount_double_decrement", "engine", "refcount imbalance",
          "vLLM block pool ref_cnt going negative on a double free", "refcount_equals_holders",
          "Releasing a running request drops its tail pin twice."),
    Fault("engine_cache_salt_missing", "engine", "cache salt / adapter missing from the hash",
          "vLLM cache_salt (multi-tenant prefix-cache isolation, RFC #16016); LoRA id in block hashes",
          "decision_matches_spec", "Block hashes omit the cache salt: tenants share prefix hits."),
    Fault("engine_hashes_published_early", "engine", "hash published before the KV is written",
          "block hashes registered when blocks are allocated rather than when filled (class of bug)",
          "abstract_state_matches_spec", "`bind` publishes the request's block hashes before they are computed."),
    Fault("engine_entries_kept_across_weight_update", "engine", "layout or version change not invalidating a cache",
          "compressed KV / indexer keys kept after a weight update because their own (compressor) "
          "version did not change — they still depend on the layer input (class of bug)",
          "reuse_equals_recompute",
          "After bump_model, recomputing a block does not refresh its compressed entries and indexer "
          "keys (their version stamp is the compressor's, which did not change): bits only, the "
          "abstract state is unchanged, so only the differential oracle can see it."),
)



def internal(name: str | None) -> str | None:
    """The engine's internal switch for a fault name (engine_X -> X)."""
    if name is None:
        return None
    name = name[len("engine_"):] if name.startswith("engine_") else name
    return {"misaligned_address_accepted": "misaligned_accepted"}.get(name, name)

for _f in ENGINE_FAULTS:
    if _f.name not in FAULTS:
        register(_f)
