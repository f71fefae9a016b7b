"""Planted faults on the scheduler drive: SGLang's cache methods wrapped on the instance its
scheduler calls (the same faults, by name, as the cache-level layouts: layouts.SGLANG_FAULTS).
SGLang's code is not edited; its scheduler calls the wrapper where it calls the method."""
from __future__ import annotations

import dataclasses
from typing import Any

PLANTABLE = ("lock_ref_leak", "evict_locked", "evict_no_free", "insert_shifted_values")


def plant(fault: str, cache: Any) -> None:
    """Wrap one method of `cache` (the instance) so that it has the fault."""
    if fault == "lock_ref_leak":
        real_dec = cache.dec_lock_ref

        def dec(node: Any, *rest: Any, **kw: Any) -> Any:
            out = real_dec(node, *rest, **kw)
            if node is not None and node is not cache.root_node:
                node.lock_ref += 1          # a reference nobody holds
            return out
        cache.dec_lock_ref = dec
    elif fault in ("evict_locked", "evict_no_free"):
        real_evict, alloc = cache.evict, cache.token_to_kv_pool_allocator

        def evict(*params: Any, **kw: Any) -> Any:
            if fault == "evict_no_free":
                real = {n: getattr(alloc, n) for n in ("free", "free_segment", "free_swa") if hasattr(alloc, n)}
                for n in real:
                    setattr(alloc, n, lambda *a, **k: None)
                try:
                    return real_evict(*params, **kw)
                finally:
                    for n, fn in real.items():
                        setattr(alloc, n, fn)
            out = real_evict(*params, **kw)
            leaf = _locked_leaf(cache)
            if leaf is not None:
                alloc.free(leaf.value)
                cache._delete_leaf(leaf)
            return out
        cache.evict = evict
    elif fault == "insert_shifted_values":
        import torch
        real_insert = cache.insert

        def insert(params: Any, *rest: Any, **kw: Any) -> Any:
            if dataclasses.is_dataclass(params) and getattr(params, "value", None) is not None:
                params = dataclasses.replace(params, value=torch.roll(params.value, 1))
            return real_insert(params, *rest, **kw)
        cache.insert = insert
    else:
        raise ValueError(f"fault {fault!r} is not planted on the scheduler drive (it plants {', '.join(PLANTABLE)})")


def _locked_leaf(cache: Any) -> Any:
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            if child.lock_ref > 0 and not child.children:
                return child
            stack.append(child)
    return None
