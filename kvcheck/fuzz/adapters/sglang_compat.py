"""Small shims over what moved or changed shape between SGLang releases (class locations,
constructor arguments, lock receipts), shared by the SWA and Unified adapters."""
from __future__ import annotations

import importlib
import inspect
from typing import Any

from .sglang_install import SglangUnavailable, load


def first(name: str, *mods: str) -> Any:
    """`name` from the first of `mods` that has it (classes moved between releases)."""
    for mod in mods:
        try:
            return getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            continue
    raise SglangUnavailable(f"sglang {load()['version']}: no {name} in {', '.join(mods)}")


def kw(fn: Any, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments `fn` accepts (constructors changed between releases)."""
    names = set(inspect.signature(fn).parameters)
    return {k: v for k, v in kwargs.items() if k in names}


def dec_params(rec: Any) -> Any:
    """The release's DecLockRefParams from an inc_lock_ref receipt (0.5.11 has no to_dec_params)."""
    if hasattr(rec, "to_dec_params"):
        return rec.to_dec_params()
    return load()["bpc"].DecLockRefParams(swa_uuid_for_lock=rec.swa_uuid_for_lock)


def swa_pools(cap: int, size_swa: int) -> Any:
    """A real SWAKVPool (one full and one SWA layer, head_dim 2, on CPU) under the release's
    SWATokenToKVPoolAllocator (page 1)."""
    import torch
    pool_cls = first("SWAKVPool", "sglang.srt.mem_cache.swa_memory_pool", "sglang.srt.mem_cache.memory_pool")
    alloc_cls = first("SWATokenToKVPoolAllocator", "sglang.srt.mem_cache.allocator.swa",
                      "sglang.srt.mem_cache.swa_memory_pool", "sglang.srt.mem_cache.allocator")
    pool = pool_cls(**kw(pool_cls.__init__, size=cap, size_swa=size_swa, page_size=1, dtype=torch.float16,
                         head_num=1, head_dim=2, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
                         enable_kvcache_transpose=False, device="cpu"))
    return alloc_cls(**kw(alloc_cls.__init__, size=cap, size_swa=size_swa, page_size=1, dtype=torch.float16,
                          device="cpu", kvcache=pool, need_sort=False))
