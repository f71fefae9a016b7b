"""Planted faults on the scheduler drive: SGLang's cache methods wrapped on the instance its
scheduler calls (the same faults, by name, as the cache-level layouts: layouts.SGLANG_FAULTS).
SGLang's code is not edited; its scheduler calls the wrapper where it calls the method."""
from __future__ import annotations

import dataclasses
from typing import Any

from ..plant import frees_disabled

PLANTABLE = ("lock_ref_leak", "evict_locked", "evict_no_free", "insert_shifted_values")


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
    else:
        raise ValueError(f"fault {fault!r} is not planted on the scheduler drive (it plants {', '.join(PLANTABLE)})")
