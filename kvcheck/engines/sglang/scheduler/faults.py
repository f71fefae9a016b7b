"""Planted faults on the scheduler drive: SGLang's cache methods wrapped on the instance its
scheduler calls (the same faults, by name, as the cache-level layouts: layouts.SGLANG_FAULTS).
SGLang's code is not edited; its scheduler calls the wrapper where it calls the method."""
from __future__ import annotations

import dataclasses
from typing import Any

from ..plant import frees_disabled

TREE_FAULTS = ("lock_ref_leak", "evict_locked", "evict_no_free", "insert_shifted_values")
DISABLED_FAULTS = ("chunk_finish_leaks", "chunk_reports_hit")      # the radix cache disabled (ChunkCache / a disabled tree)
PLANTABLE = TREE_FAULTS + DISABLED_FAULTS


def plantable(lay: Any) -> tuple[str, ...]:
    """The faults a layout's cache can have: a tree's, or a disabled cache's (which keeps nothing).
    A disabled cache takes them where it is a `ChunkCache` (up to 0.5.21); 0.5.22+ build a disabled
    UnifiedRadixCache, whose match and release calls (`device_prefix_len`, `free_kv_row`) these
    wrappers do not follow: none there (said in one line when asked for)."""
    if lay.cls != "ChunkCache":
        return TREE_FAULTS
    from ..install import load
    return DISABLED_FAULTS if isinstance(load()["classes"].get("ChunkCache"), type) else ()


def evict_entries(cache: Any) -> list[str]:
    """The methods the scheduler's path evicts through: `evict_for_alloc` (allocation pressure,
    0.5.22+) where it does not go through `evict`, and `evict`."""
    fa = getattr(type(cache), "evict_for_alloc", None)
    if fa is not None and "evict" not in getattr(fa, "__code__", type("c", (), {"co_names": ()})).co_names:
        return ["evict_for_alloc", "evict"]
    return ["evict"]


def plant(fault: str, cache: Any, tree: Any) -> None:
    """Wrap one method of `cache` (the instance) so that it has the fault (`tree`: tree.Tree)."""
    if fault == "lock_ref_leak":
        real_dec = cache.dec_lock_ref

        def dec(node: Any, *rest: Any, **kw: Any) -> Any:
            out = real_dec(node, *rest, **kw)
            n = tree.node(getattr(node, "node", node))      # (0.5.22+ pass the request's TreeLock)
            if n is not None and n is not tree.root:
                tree.add_full_lock(n, 1)    # a reference nobody holds
            return out
        cache.dec_lock_ref = dec
    elif fault in ("evict_locked", "evict_no_free"):
        import torch
        alloc = cache.token_to_kv_pool_allocator

        def wrap(real_evict: Any) -> Any:
            def evict(*params: Any, **kw: Any) -> Any:
                if fault == "evict_no_free":
                    with frees_disabled(cache):
                        return real_evict(*params, **kw)
                out = real_evict(*params, **kw)
                leaf = next((v for v in tree.views() if v.full_lock > 0 and not v.node.children and v.full), None)
                if leaf is not None:
                    alloc.free(torch.tensor(leaf.full, dtype=torch.int64))
                    tree.unlink(leaf.node)
                return out
            return evict
        for name in evict_entries(cache):
            setattr(cache, name, wrap(getattr(cache, name)))
    elif fault == "insert_shifted_values":
        import torch
        real_insert = cache.insert

        def insert(params: Any, *rest: Any, **kw: Any) -> Any:
            if dataclasses.is_dataclass(params) and getattr(params, "value", None) is not None:
                params = dataclasses.replace(params, value=torch.roll(params.value, 1))
            elif rest and rest[0] is not None:          # insert(key, value, ...) before InsertParams (0.5.7-0.5.14)
                rest = (torch.roll(rest[0], 1), *rest[1:])
            elif kw.get("value") is not None:
                kw["value"] = torch.roll(kw["value"], 1)
            return real_insert(params, *rest, **kw)
        cache.insert = insert
    elif fault == "chunk_reports_hit":
        import torch
        real_match = cache.match_prefix
        alloc = cache.token_to_kv_pool_allocator

        def match(*a: Any, **kw: Any) -> Any:
            res = real_match(*a, **kw)
            free = {int(x) for t in (getattr(alloc, "free_pages", None), getattr(alloc, "release_pages", None))
                    if t is not None for x in t.tolist()}
            key = a[0] if a else kw.get("params", kw.get("key"))
            n = len(getattr(key, "key", key)) - 1
            used = [x for x in range(1, alloc.size + 1) if x not in free][:max(0, n)]
            if not used or len(res.device_indices):
                return res
            hit = torch.tensor(used, dtype=torch.int64)     # slots other requests wrote, as a hit
            return res._replace(device_indices=hit) if hasattr(res, "_replace") else \
                dataclasses.replace(res, device_indices=hit)
        cache.match_prefix = match
    elif fault == "chunk_finish_leaks":
        real_finished = cache.cache_finished_req
        alloc = cache.token_to_kv_pool_allocator

        def finished(*a: Any, **kw: Any) -> Any:
            had, real_free = vars(alloc).get("free"), alloc.free

            def free(indices: Any) -> Any:      # all but the request's last committed slot go back
                return real_free(indices[:-1]) if len(indices) > 1 else None
            alloc.free = free
            try:
                return real_finished(*a, **kw)
            finally:
                if had is None:
                    del alloc.free
                else:
                    alloc.free = had
        cache.cache_finished_req = finished
    else:
        raise ValueError(f"fault {fault!r} is not planted on the scheduler drive (it plants {', '.join(PLANTABLE)})")
