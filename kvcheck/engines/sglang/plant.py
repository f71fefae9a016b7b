"""What planted faults share across SGLang's drives: `frees_disabled`, every free path of a
cache's pools turned off for the duration (the `evict_no_free` fault: an eviction that deletes
nodes without returning their slots)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

FREES = ("free", "free_swa", "free_swa_segment", "free_full", "free_segment", "free_full_segment",
         "free_segments", "free_full_segments", "free_page_ids")


@contextlib.contextmanager
def frees_disabled(cache: Any) -> Iterator[None]:
    """Every free path: the allocator's, its halves' (FULL+SWA), and the bound frees a tree's
    components keep (0.5.12: `_free_full`); restored on exit."""
    a = cache.token_to_kv_pool_allocator
    owners = [a] + [getattr(a, h) for h in ("full_attn_allocator", "swa_attn_allocator") if hasattr(a, h)] \
        + list(getattr(cache, "components", {}).values())
    saved = []
    for o in owners:
        for n in set(FREES) | {k for k in vars(o) if k.startswith("_free")}:
            if callable(getattr(o, n, None)):
                saved.append((o, n, n in vars(o), vars(o).get(n)))
                setattr(o, n, lambda *x, **k: None)
    try:
        yield
    finally:
        for o, n, had, fn in reversed(saved):
            setattr(o, n, fn) if had else delattr(o, n)
