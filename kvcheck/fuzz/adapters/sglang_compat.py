"""How each SGLang release builds its caches, allocators and keys (the API moved under them).

0.5.6+: `Cache(CacheInitParams(...))`; before, keyword arguments (`req_to_token_pool`,
`token_to_kv_pool_allocator`, `page_size`, `disable`, SWA: `sliding_window_size`). 0.5.3+:
keys are `RadixKey`s; before, plain token lists. Allocators took `need_sort` from 0.5.1 on.
Everything is detected from the installed release (signatures and names), never from the
version string, so a user's patched SGLang is read as it is.
"""
from __future__ import annotations

import inspect
from array import array
from typing import Any

from .sglang_install import SglangUnavailable, cache_class, load, sglang_version


def _params(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


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
