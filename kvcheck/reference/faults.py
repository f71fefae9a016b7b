"""Engine faults: planted bugs in the reference engine, each reproducing one real bug class.

Owns the reference engine's fault declarations (provider "reference"; `kvcheck faults` lists
them through fuzz/faults.py). The engine's patch sites ask `planted(FAULT)` with these
constants. `expected` is the check that must catch the fault in `kvcheck diff` and `kvcheck
fuzz --sut reference`: a spec invariant evaluated on the engine's own abstract state (exit 10),
the differential oracle `reuse_equals_recompute` (exit 11), or a conformance check against the
spec (`decision_matches_spec` / `abstract_state_matches_spec`, exit 13).
"""
from __future__ import annotations

from kvcheck.spec.faults import Fault, Planted, UnknownFault


def _engine(name: str, site: str, bug_class: str, mirrors: str, expected: str, doc: str,
            needs: tuple = ()) -> Fault:
    return Fault(name, "reference", site, bug_class, mirrors, expected, doc, ("reference",), needs)


def _small(*keys: tuple, blocks: int = 3) -> tuple:
    """A configurable semantic on a small config where its symptom shows quickly: one
    full-attention group (a plain transformer's hash-chain block manager), device tier only."""
    from kvcheck.spec.config import LayerSpec
    return (*keys, ("tiers", ("device",)), ("layers", (LayerSpec("full"),)), ("blocks", blocks))


TAIL_CHECK_SKIPPED = _engine(
    "engine_tail_check_skipped", "funnel:layer3", "tail dropped / wrong tail",
    "class of bug: DeepSeek-V4-style compressed layers resumed inside a compression block "
    "without the uncompressed tail (hybrid-cache designs in vLLM/SGLang only track whole entries)",
    "hit_sound_tail", "Funnel layer 3 does not check the tail snapshot at the hit point.")

SWA_WINDOW_OFF_BY_ONE = _engine(
    "engine_swa_window_off_by_one", "funnel:layer3", "window not covering needed positions",
    "vLLM sliding-window prefix caching: null-block / window-edge accounting "
    "(SlidingWindowManager.find_longest_cache_hit) off by one page",
    "hit_sound_swa_window", "Layer 3 skips the first page of each finite SWA window.")

INDEXER_VERSION_IGNORED = _engine(
    "engine_indexer_version_ignored", "funnel:layer2", "indexer stale after restore",
    "DeepSeek-V3.2 sparse-attention indexer cache restored under another indexer version "
    "(class of bug)", "hit_sound_indexer",
    "Layer 2 does not compare the indexer keys' version with the current indexer.")

INDEXER_LAG_NOT_CHECKED = _engine(
    "engine_indexer_lag_not_checked", "funnel:layer3", "indexer lagging the KV",
    "DeepSeek-V3.2 indexer keys written asynchronously after the KV (class of bug)",
    "hit_sound_indexer", "Layer 3 accepts indexer keys that are still being written.")

OFFLOAD_READY_BEFORE_WRITE = _engine(
    "engine_offload_ready_before_write", "tiers:offload_start", "offload marked ready before the copy completes",
    "LMCache / SGLang HiCache: a write-back registered as stored before the write is acknowledged",
    "abstract_state_matches_spec",
    "offload_start acknowledges the copy as durable at submission, not at write completion.")

LOAD_BEFORE_CHECKSUM = _engine(
    "engine_load_before_checksum", "tiers:verify", "placeholder or corrupt data served as a hit",
    "LMCache local-disk backend: loaded chunks used before integrity/metadata checks (class of bug)",
    "abstract_state_matches_spec",
    "Loaded copies are placed without checking the checksum or the header.")

DISK_COPY_KEY_UNCHECKED = _engine(
    "engine_disk_copy_key_unchecked", "tiers:load", "copy of another block served as a hit",
    "disk/remote KV stores that check a copy's checksum and model header but not that it "
    "was written for the requested key (file naming collisions, shared cache directories; "
    "class of bug)", "abstract_state_matches_spec",
    "The load path does not compare the copy's binding (key, block, objects) with the "
    "requested block: a valid copy of another block at this block's path passes verification.")

NO_REVALIDATION_AT_USE = _engine(
    "engine_no_revalidation_at_use", "manager:use", "TOCTOU: lease not re-validated at use",
    "vLLM state_data_ptrs / version re-check skipped before the kernel reads (class of bug)",
    "toctou_bound_stable", "`use` runs a bound request without re-validating its lease.")

PINNED_OBJECT_EVICTED = _engine(
    "engine_pinned_object_evicted", "manager:evict", "hit evicted between lookup and pin",
    "vLLM/SGLang prefix hit freed by the evictor while a request still references it",
    "toctou_bound_stable", "Eviction ignores reference counts and graph pins.")

GRAPH_PAGES_MIGRATED = _engine(
    "engine_graph_pages_migrated", "manager:migrate", "CUDA-graph replay of stale tables",
    "vLLM/SGLang CUDA graphs capturing block-table addresses that compaction later moves",
    "graph_topology", "Compaction moves pages a captured graph references.")

SHARED_FREE_LIST = _engine(
    "engine_shared_free_list", "manager:append", "groups aliasing memory",
    "vLLM hybrid KV cache groups sharing one block pool with mismatched page sizes (class of bug)",
    "five_state_routing", "SWA pages are allocated from the tail pool.")

ADMISSION_CAP_IGNORED = _engine(
    "engine_admission_cap_ignored", "manager:append", "admission cap ignored",
    "cache growth crowding out new requests / OOM (SGLang radix cache without a reserve)",
    "admission_cap", "`append` allocates past the pool's admission cap.")

ABI_VERSION_IGNORED = _engine(
    "engine_abi_version_ignored", "funnel:layer2", "layout or version change not invalidating a cache",
    "persisted KV reused after a kernel/page-layout change (LMCache format versions; class of bug)",
    "hit_sound_layout", "Layer 2 does not compare the objects' ABI/layout version.")

MISALIGNED_ADDRESS_ACCEPTED = _engine(
    "engine_misaligned_address_accepted", "funnel:layer4", "misaligned physical address",
    "bounce-buffer restores placed off the kernel's required alignment (class of bug)",
    "hit_sound_layout", "Layer 4 does not check the physical addresses' alignment.")

REFCOUNT_DOUBLE_DECREMENT = _engine(
    "engine_refcount_double_decrement", "manager:finish", "refcount imbalance",
    "vLLM block pool ref_cnt going negative on a double free", "refcount_equals_holders",
    "Releasing a running request drops its tail pin twice.")

CACHE_SALT_MISSING = _engine(
    "engine_cache_salt_missing", "hashing:block_hashes", "cache salt / adapter missing from the hash",
    "vLLM cache_salt (multi-tenant prefix-cache isolation, RFC #16016); LoRA id in block hashes",
    "decision_matches_spec", "Block hashes omit the cache salt: tenants share prefix hits.")

HASHES_PUBLISHED_EARLY = _engine(
    "engine_hashes_published_early", "manager:bind", "hash published before the KV is written",
    "block hashes registered when blocks are allocated rather than when filled (class of bug)",
    "abstract_state_matches_spec", "`bind` publishes the request's block hashes before they are computed.")

ENTRIES_KEPT_ACROSS_WEIGHT_UPDATE = _engine(
    "engine_entries_kept_across_weight_update", "manager:append", "layout or version change not invalidating a cache",
    "compressed KV / indexer keys kept after a weight update because their own (compressor) "
    "version did not change — they still depend on the layer input (class of bug)",
    "reuse_equals_recompute",
    "After bump_model, recomputing a block does not refresh its compressed entries and indexer "
    "keys (their version stamp is the compressor's, which did not change): bits only, the "
    "abstract state is unchanged, so only the differential oracle can see it.")

# Faults only a configurable semantic can express (each plants nothing without its `needs`).
HASH_IGNORES_PARENT = _engine(
    "engine_hash_ignores_parent", "hashing:block_hashes", "hash collision / chain hash without its parent",
    "a block hash computed as if it were a first block (prefix-cache chain hashing; class of bug)",
    "hit_content_sound",
    "With prompts > 1, block hashes cover the block's position and own tokens, not the parent's "
    "hash: a block computed under another prefix is reused.", _small(("prompts", 2)))

STALE_HASH_AFTER_REUSE = _engine(
    "engine_stale_hash_after_reuse", "slots:publish", "stale hash after free",
    "a freed block reused for other content while its old hash entry is still served "
    "(a block whose hash is already set is not re-hashed; class of bug)", "hit_content_sound",
    "With prompts > 1, a block rewritten with other content keeps its old hash in the table (and "
    "the new one is not entered): a later request of the old prompt reuses the other content. "
    "(The lockstep fuzzer sees the table diverge first: abstract_state_matches_spec.)",
    _small(("prompts", 2)))

STALE_HASH_AFTER_EVICT = _engine(
    "engine_stale_hash_after_evict", "manager:evict", "stale hash after free",
    "a hash-table entry left behind when its block is evicted (class of bug)",
    "published_hash_resident",
    "With eviction = drop_hash, eviction frees the block but leaves its hash in the table.",
    _small(("eviction", "drop_hash")))

DECODE_PUBLISHES_PARTIAL = _engine(
    "engine_decode_publishes_partial", "decode:decode", "hash published before the block is full",
    "a decode-time block hashed from its scheduled token ids and cached at its first token "
    "(class of bug)", "hit_full_blocks",
    "With decode = true, the block a request decodes into is written (from the partial state) "
    "and its hash published at its first token.", _small(("decode", True), ("block_size", 2)))

ALLOC_EVICTS_REFERENCED = _engine(
    "engine_alloc_evicts_referenced", "slots:victim_room", "hit evicted between lookup and pin",
    "a block manager whose allocation evicts the LRU block without checking its reference count",
    "toctou_bound_stable",
    "With alloc = evict, the allocation into a full pool evicts a block a request still holds.",
    _small(("alloc", "evict"), ("capacity", {"swa_window": 1}), blocks=2))

ENGINE_FAULTS: tuple[Fault, ...] = (
    TAIL_CHECK_SKIPPED,
    SWA_WINDOW_OFF_BY_ONE,
    INDEXER_VERSION_IGNORED,
    INDEXER_LAG_NOT_CHECKED,
    OFFLOAD_READY_BEFORE_WRITE,
    LOAD_BEFORE_CHECKSUM,
    DISK_COPY_KEY_UNCHECKED,
    NO_REVALIDATION_AT_USE,
    PINNED_OBJECT_EVICTED,
    GRAPH_PAGES_MIGRATED,
    SHARED_FREE_LIST,
    ADMISSION_CAP_IGNORED,
    ABI_VERSION_IGNORED,
    MISALIGNED_ADDRESS_ACCEPTED,
    REFCOUNT_DOUBLE_DECREMENT,
    CACHE_SALT_MISSING,
    HASHES_PUBLISHED_EARLY,
    ENTRIES_KEPT_ACROSS_WEIGHT_UPDATE,
    HASH_IGNORES_PARENT,
    STALE_HASH_AFTER_REUSE,
    STALE_HASH_AFTER_EVICT,
    DECODE_PUBLISHES_PARTIAL,
    ALLOC_EVICTS_REFERENCED,
)
BY_NAME = {f.name: f for f in ENGINE_FAULTS}


def planted(name: str | None) -> Planted:
    """The engine's probe for a fault name (UnknownFault, naming the SUT, if it is not one of
    the reference engine's)."""
    if name is None:
        return Planted(None)
    f = BY_NAME.get(name)
    if f is None:
        raise UnknownFault(name, f"fault {name!r} is not a reference-engine fault; "
                           "`kvcheck faults` lists each fault with the --sut that plants it")
    return Planted(f)
