"""How each SGLang release builds its caches, allocators and keys (the API moved under them).

0.5.6+: `Cache(CacheInitParams(...))`; before, keyword arguments (`req_to_token_pool`,
`token_to_kv_pool_allocator`, `page_size`, `disable`, SWA: `sliding_window_size`). 0.5.3+:
keys are `RadixKey`s; before, plain token lists. Allocators took `need_sort` from 0.5.1 on.
Everything is detected from the installed release (signatures and names), never from the
version string, so a user's patched SGLang is read as it is.
Also the small shims the SWA and Unified adapters share: where a class lives, which
constructor arguments it takes, lock receipts.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from array import array
from typing import Any

from .sglang_install import SglangUnavailable, cache_class, load, sglang_version


@functools.lru_cache(maxsize=None)          # (read once per constructor: every episode builds)
def _params(fn: Any) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def new_allocator(cls: Any, *args: Any) -> Any:
    """cls(*args, kvcache..., need_sort=False) where the release's allocator takes need_sort."""
    if "need_sort" in _params(cls.__init__):
        return cls(*args, False)
    return cls(*args)


def new_cache(cls_name: str, alloc: Any, page_size: int, window: int | None = None) -> Any:
    """The cache on this release's constructor; SglangUnavailable (one line) if it takes
    neither CacheInitParams nor the keyword arguments the adapter knows."""
    S, cls = load(), cache_class(cls_name)
    init = _params(cls.__init__)
    if S.get("CacheInitParams") is not None and "params" in init:
        p = S["CacheInitParams"](disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                 page_size=page_size,
                                 **({"sliding_window_size": window} if window and cls_name != "SWARadixCache" else {}))
        return cls(p, sliding_window_size=window) if cls_name == "SWARadixCache" else cls(p)
    need = {"req_to_token_pool", "token_to_kv_pool_allocator", "page_size"}
    if not need <= init or (window and "sliding_window_size" not in init):
        raise SglangUnavailable(f"sglang {sglang_version()}: {cls_name}.__init__ takes "
                                f"({', '.join(sorted(init - {'self'}))}); the adapter knows CacheInitParams "
                                "or req_to_token_pool/token_to_kv_pool_allocator/page_size[/sliding_window_size]")
    kw: dict[str, Any] = dict(req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page_size,
                              disable=False)
    if window:
        kw["sliding_window_size"] = window
    return cls(**kw)


def new_key(tokens: list[int], compact: bool) -> Any:
    """A RadixKey where the release has one (its token ids an int64 array on *Params releases),
    else the token list itself."""
    rk = load().get("RadixKey")
    if rk is None:
        return list(tokens)
    return rk(array("q", tokens) if compact else list(tokens))


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
    names = _params(fn)
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
