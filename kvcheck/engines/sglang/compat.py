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
import re
from array import array
from dataclasses import fields
from typing import Any

from .install import (SglangUnavailable, cache_class, load, sglang_version)


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


def token_seq(tokens: Any, compact: bool) -> Any:
    """Token ids as the adapter keys them: an int64 array on *Params releases, else a list. One
    type everywhere: a paged RadixKey compares slices, and a list slice never equals an array's."""
    return array("q", tokens) if compact else list(tokens)


def new_key(tokens: list[int], compact: bool) -> Any:
    """A RadixKey where the release has one (its token ids `token_seq`), else the token list."""
    rk = load().get("RadixKey")
    if rk is None:
        return list(tokens)
    return rk(token_seq(tokens, compact))


def first(name: str, *mods: str) -> Any:
    """`name` from the first of `mods` that has it (classes moved between releases)."""
    for mod in mods:
        try:
            return getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            continue
    raise SglangUnavailable(f"sglang {load()['version']}: no {name} in {', '.join(mods)}")


def kw(fn: Any, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments `fn` accepts (constructors changed between releases). Where `fn`
    forwards **kwargs to the class a `..._class` parameter defaults to (0.5.2's SWAKVPool builds
    its MHATokenToKVPool so), that class's keywords are accepted too."""
    names = set(_params(fn))
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        params = []
    if any(p.kind is p.VAR_KEYWORD for p in params):
        for p in params:
            if p.name.endswith("_class") and isinstance(p.default, type):
                names |= _params(p.default.__init__) - {"self"}
    return {k: v for k, v in kwargs.items() if k in names}


def has_params(name: str) -> bool:
    """Whether the release's base_prefix_cache has this *Params / *Result class: they came one
    call at a time (0.5.8: MatchPrefixParams; 0.5.9: Insert/EvictParams; 0.5.10: the lock's)."""
    return hasattr(load()["bpc"], name)


def dec_params(rec: Any) -> Any:
    """The release's DecLockRefParams from an inc_lock_ref receipt (0.5.11 has no to_dec_params)."""
    if hasattr(rec, "to_dec_params"):
        return rec.to_dec_params()
    return load()["bpc"].DecLockRefParams(swa_uuid_for_lock=rec.swa_uuid_for_lock)


def swa_pools(cap: int, size_swa: int, pure: bool = False) -> Any:
    """A real SWAKVPool (one full and one SWA layer, head_dim 2, on CPU) under the release's
    SWATokenToKVPoolAllocator (page 1). `pure`: an all-sliding-window model as its server builds
    it (0.5.15+): the SWA layer only, a full pool of 0 slots, `PureSWATokenToKVPoolAllocator`."""
    import torch
    pool_cls = first("SWAKVPool", "sglang.srt.mem_cache.swa_memory_pool", "sglang.srt.mem_cache.memory_pool")
    alloc_cls = first("PureSWATokenToKVPoolAllocator" if pure else "SWATokenToKVPoolAllocator",
                      "sglang.srt.mem_cache.allocator.swa", "sglang.srt.mem_cache.swa_memory_pool",
                      "sglang.srt.mem_cache.allocator")
    pool = pool_cls(**kw(pool_cls.__init__, size=0 if pure else cap, size_swa=size_swa, page_size=1,
                         dtype=torch.float16, head_num=1, head_dim=2, swa_attention_layer_ids=[0],
                         full_attention_layer_ids=[] if pure else [1], enable_kvcache_transpose=False, device="cpu"))
    return alloc_cls(**kw(alloc_cls.__init__, size=cap, size_swa=size_swa, page_size=1, dtype=torch.float16,
                          device="cpu", kvcache=pool, need_sort=False))


# ---- the scheduler's side of a request (sched.py): its row, its record, its release ----
def row_pool(size: int, max_len: int) -> Any:
    """A real ReqToTokenPool on CPU: the rows the scheduler writes a request's slots into (the
    caches' cache_unfinished_req / checkpoint read and rewrite them)."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    return ReqToTokenPool(**kw(ReqToTokenPool.__init__, size=size, max_context_len=max_len, device="cpu",
                               enable_memory_saver=False))


def alloc_row(pool: Any, req: Any) -> int | None:
    """A row for `req`, as the release's pool hands one out: `alloc(1)` (0.4.10-0.5.7),
    `alloc(1, [req])` (0.5.7's HybridReqToTokenPool), `alloc([req])` (0.5.12+, which records it
    on the request itself)."""
    names = _params(pool.alloc)
    if "reqs" in names and "need_size" in names:
        out = pool.alloc(1, [req])
    elif "reqs" in names:
        out = pool.alloc([req])
    else:
        out = pool.alloc(1)
    return None if out is None else int(out[0])


def free_row(pool: Any, req: Any, idx: int) -> None:
    """Give a request's row back (0.5.12+ take the request, older releases the index)."""
    if idx in pool.free_slots:
        return
    if "req" in _params(pool.free):
        pool.free(req)
    else:
        pool.free(idx)


def sglang_req() -> tuple[Any, Any] | None:
    """SGLang's Req and SamplingParams where they import on CPU (0.5.7+), else None."""
    try:
        from sglang.srt.managers.schedule_batch import Req as Req_
        from sglang.srt.sampling.sampling_params import SamplingParams
    except Exception:        # 0.4.10: its import chain needs torch._C._cpu._is_amx_tile_supported
        return None
    return Req_, SamplingParams


@functools.lru_cache(maxsize=None)
def keeps_kv_record(req_cls: type) -> bool:
    """Whether the release's Req keeps (part of) its KV bookkeeping in a record (`self.kv`, 0.5.16+)."""
    try:
        return re.search(r"self\.kv\s*[:=]", inspect.getsource(req_cls.__init__)) is not None
    except (OSError, TypeError):
        return False


def own_req_cls() -> tuple[Any, Any] | None:
    """SGLang's Req and SamplingParams where the scheduler path drives SGLang's own request: its Req
    keeps a KV record (`self.kv`, 0.5.16+), which a flat stand-in cannot follow from release to
    release (the record gains fields each release); None where FlatReq stands in (0.4.10-0.5.15)."""
    own = sglang_req()
    return own if own is not None and keeps_kv_record(own[0]) else None


def kv_record_api() -> bool:
    """Whether this release keeps a request's KV bookkeeping in a record (`req.kv`, `req.lock`)
    and publishes through `checkpoint` + `release_kv_cache` (0.5.23) rather than through the
    cache's `cache_unfinished_req` / `cache_finished_req` on flat request fields."""
    try:
        from sglang.srt.mem_cache import common
    except ImportError:
        return False
    return hasattr(common, "checkpoint_kv_cache") and hasattr(common, "release_kv_cache") and \
        "checkpoint" in _params(common.release_kv_cache)


MAMBA_CHUNK = 64    # the Mamba cache chunk size our server args report (SGLang's FLA default)


def runtime_config() -> None:
    """Releases with a runtime context (0.5.23) read the serving and speculative config from it
    when a request is released; where no server published one, publish SGLang's own test default
    (`override_server_args`, a dummy ServerArgs) once, with the Mamba chunk size seeded as SGLang's
    fixtures seed it: else the first Mamba component built reads it from the dummy model's HF
    config (a download; an OSError offline)."""
    try:
        from sglang.srt import runtime_context as rc
    except ImportError:
        return
    ctx = getattr(rc, "_CONTEXT", None)
    if ctx is not None and hasattr(ctx, "override_server_args") and not ctx.is_config_namespace_published("serving"):
        ctx.override_server_args(_mamba_cache_chunk_size=MAMBA_CHUNK).install()


def method_reads(cache: Any, method: str, *names: str) -> bool:
    """Whether the release's `method` of `cache`'s class reads any of `names` (the names its code
    uses): how a release difference inside one method is told apart (who frees, what it counts)."""
    code = getattr(getattr(type(cache), method, None), "__code__", None)
    return code is not None and any(n in code.co_names for n in names)


def takes(fn: Any, name: str) -> bool:
    """Whether `fn` takes a parameter `name` (e.g. cache_finished_req's `is_insert`, 0.5.1+)."""
    return name in _params(fn)


def component_types() -> Any:
    """The ComponentType enum of the installed release (it moved between releases)."""
    for mod in ("sglang.srt.mem_cache.unified_cache.component_type", "sglang.srt.mem_cache.unified_cache_components"):
        try:
            return importlib.import_module(mod).ComponentType
        except (ImportError, AttributeError):
            continue
    raise SglangUnavailable(f"sglang {load()['version']}: no ComponentType for UnifiedRadixCache")


def has_tree_cores() -> bool:
    """Whether this release's UnifiedRadixCache takes a pluggable tree core (python | rust)."""
    return "tree_core_backend" in {f.name for f in fields(load()["CacheInitParams"])}


def rust_core_gap() -> str | None:
    """Why the Rust tree core cannot run here (None: it loads). One line."""
    S = load()
    if not has_tree_cores():
        return (f"sglang {S['version']}: UnifiedRadixCache has no pluggable tree core "
                "(SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND came later): Python tree only")
    try:
        importlib.import_module("sglang.srt.mem_cache.rust_tree_core.extension")
    except Exception as e:      # not in the wheel, or it does not load over this torch
        return f"sglang {S['version']}: the Rust tree core does not load here: {type(e).__name__}: {str(e)[:160]}"
    return None
