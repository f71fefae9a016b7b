"""What the installed vLLM release can express: detected from its classes and signatures.

vLLM's v1 KV cache manager changed shape across releases (0.14 had no sliding-window MLA, no
compressed/indexer MLA, no retention interval, no scheduler block size; `get_computed_blocks`
gained a third result, `Request` lost its `eos_token_id` argument). The adapter never branches on version numbers: it reads
the features here, and a layout or fault a release cannot express is refused in one line
naming the release and what it lacks.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

# Spec classes every supported release has; the others are needed only by some layouts.
REQUIRED_SPECS = ["FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec", "KVCacheConfig",
                  "KVCacheGroupSpec"]
OPTIONAL_SPECS = ["ChunkedLocalAttentionSpec", "SlidingWindowMLASpec", "CircularBufferSpec",
                  "SparseCacheRole", "MambaSpec"]


def _params(fn: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def release_features(kci: Any, manager_cls: Any, stm: Any, request_cls: Any) -> set[str]:
    """Feature names the adapter asks about (classes, constructor arguments, methods)."""
    f = {n for n in OPTIONAL_SPECS if hasattr(kci, n)}
    if "eos_token_id" in _params(request_cls.__init__):
        f.add("request_eos_arg")
    mla = _params(kci.MLAAttentionSpec)
    if {"tokens_per_state", "model_version"} <= mla and "SparseCacheRole" in f:
        f.add("compressed_mla")
    if "prefix_cache_retention_interval" in _params(kci.KVCacheConfig):
        f.add("retention_interval")
    if "scheduler_block_size" in _params(manager_cls.__init__):
        f.add("scheduler_block_size")
    if "use_eagle" in _params(manager_cls.__init__):
        f.add("use_eagle")
    if "is_eagle_group" in _params(kci.KVCacheGroupSpec):
        f.add("is_eagle_group")      # else every group takes the EAGLE drop
    if "MambaSpec" in f and "mamba_cache_mode" in _params(kci.MambaSpec):
        f.add("MambaSpec.mamba_cache_mode")   # align mode: Mamba state cached at block boundaries
        if "num_speculative_blocks" in _params(kci.MambaSpec):
            f.add("mamba_speculative_blocks")  # a drafter's speculative state blocks (MTP)
        if getattr(stm.MambaManager, "supports_fine_grained_hash_lookup", False) \
                and hasattr(manager_cls, "take_kv_cache_block_copies"):
            f.add("mamba_partial_hits")       # hash block < Mamba block: hits inside it, CoW copies
        if "enable_mamba_shared_prefix_checkpoint" in _params(manager_cls.__init__):
            f.add("mamba_shared_prefix_checkpoint")
    if "drop_eagle_block" in _params(stm.SlidingWindowManager.find_longest_cache_hit):
        f.add("eagle_mixed_block")   # older releases assert block_size == alignment under EAGLE
    if hasattr(stm.SlidingWindowManager, "_contiguous_blocks_for_hit"):
        f.add("swa_contiguous_rule")
    ann = inspect.signature(manager_cls.get_computed_blocks).return_annotation
    if "int, int" in str(ann):
        f.add("hit_junction")
    return f


# layout feature -> the release feature it needs
_KIND_NEEDS = {"chunked_local": "ChunkedLocalAttentionSpec", "swa_mla": "SlidingWindowMLASpec",
               "compressed": "compressed_mla", "indexer": "compressed_mla",
               "tail_ring": "CircularBufferSpec", "mla_indexer": "SparseCacheRole",
               "mamba": "MambaSpec.mamba_cache_mode"}


def layout_gap(version: str, features: set[str], kinds: list[str], retention: bool,
               partial_mamba: bool = False) -> str | None:
    """Why this release cannot run the layout (one line), or None. `partial_mamba`: a Mamba
    block larger than the hash block (fine-grained hits, 0.33's MambaManager)."""
    lacks = sorted({_KIND_NEEDS[k] for k in kinds if k in _KIND_NEEDS} - features)
    if partial_mamba and not lacks and "mamba_partial_hits" not in features:
        lacks.append("MambaManager.supports_fine_grained_hash_lookup")
    if retention and "retention_interval" not in features:
        lacks.append("KVCacheConfig.prefix_cache_retention_interval")
    if not lacks:
        return None
    why = (" (no align-mode prefix caching of Mamba state)" if "MambaSpec.mamba_cache_mode" in lacks
           else " (no Mamba hits inside a Mamba block: its block must be the hash block)"
           if lacks == ["MambaManager.supports_fine_grained_hash_lookup"] else "")
    return f"vLLM {version} cannot express this layout: it lacks {', '.join(lacks)}{why}"


def fault_gap(version: str, features: set[str], site_feature: str | None, site: str) -> str | None:
    """Why this release has nowhere to plant the fault (its site is missing), or None."""
    if site_feature is None or site_feature in features:
        return None
    return f"vLLM {version} has no {site.removeprefix('vllm:')} to plant this fault in"
