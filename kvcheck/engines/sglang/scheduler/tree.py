"""One view of the tree SGLang's scheduler built, whichever class it picked: `RadixCache` nodes
(`value`, `lock_ref`), `SWARadixCache` nodes (the full `value`, `swa_tombstone`, `full_lock_ref`,
`swa_lock_ref`; a live node's SWA slots are those its full slots map to), or `UnifiedRadixCache`
nodes on its Python tree core (per component: `component_data[FULL | SWA]`, an SWA value of None
being a tombstone; a request's `last_node` is a NodeId into the core). The scheduler drive's
checks and faults read the tree through it."""
from __future__ import annotations

from typing import Any, NamedTuple

from ..checks import slots_of


class View(NamedTuple):
    node: Any
    path: list[int]              # the tokens before the node
    key: list[int]
    full: list[int] | None       # full KV slots (None: evicted)
    swa: list[int] | None        # SWA KV slots (None: a tombstone, or no SWA component)
    full_lock: int
    swa_lock: int


def key_tokens(key: Any) -> list[int]:
    ids = getattr(key, "token_ids", None)
    if ids is None:
        return [int(t) for t in key]
    return [int(t) for t in ids[:len(key)]]


class Tree:
    def __init__(self, cache: Any) -> None:
        self.cache = cache
        root = getattr(cache, "root_node", None)        # None: a ChunkCache (the radix cache disabled)
        self.unified = hasattr(root, "component_data")
        self.swa_tree = hasattr(root, "swa_tombstone")      # SWARadixCache (0.5.7-0.5.15)
        if self.unified:
            from ..compat import component_types
            ct = component_types()
            self.FULL = ct.FULL
            self.SWA = getattr(ct, "SWA", None)
        self.core = getattr(cache, "tree_core", None)

    @property
    def root(self) -> Any:
        return getattr(self.cache, "root_node", None)

    def node(self, handle: Any) -> Any:
        """The node object behind a request's `last_node` / a lock's node (a NodeId on a tree core)."""
        if isinstance(handle, int) and self.core is not None:
            return self.core.node_by_id(handle)
        return handle

    def _parts(self, node: Any) -> tuple[list[int] | None, list[int] | None, int, int]:
        if self.swa_tree:
            full = None if node.value is None else slots_of(node.value)
            m = self._mapping
            swa = None if node.swa_tombstone or full is None else [m[x] for x in full]
            return full, swa, node.full_lock_ref, node.swa_lock_ref
        if not self.unified:
            return (None if node.value is None else slots_of(node.value)), None, node.lock_ref, 0
        cd = node.component_data
        f = cd[self.FULL]
        s = None
        if self.SWA is not None:        # a dict by component (0.5.19+) or a list indexed by it (0.5.18)
            s = cd.get(self.SWA) if hasattr(cd, "get") else (cd[self.SWA] if int(self.SWA) < len(cd) else None)
        return ((None if f.value is None else slots_of(f.value)),
                (None if s is None or s.value is None else slots_of(s.value)),
                f.lock_ref, 0 if s is None else s.lock_ref)

    def views(self) -> list[View]:
        if self.swa_tree:            # (read once per view: a node's SWA slots are its full slots' mapping)
            self._mapping = self.cache.token_to_kv_pool_allocator.full_to_swa_index_mapping.tolist()
        out, stack = [], [(self.root, [])] if self.root is not None else []
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                key = key_tokens(child.key)
                out.append(View(child, path, key, *self._parts(child)))
                stack.append((child, path + key))
        return out

    def add_full_lock(self, node: Any, n: int) -> None:
        if self.swa_tree:
            node.full_lock_ref += n
        elif self.unified:
            node.component_data[self.FULL].lock_ref += n
        else:
            node.lock_ref += n

    def unlink(self, node: Any) -> None:
        """Take a leaf out of the tree (a planted fault's eviction)."""
        if not self.unified and hasattr(self.cache, "_delete_leaf"):
            self.cache._delete_leaf(node)
        else:
            node.parent.children = {k: ch for k, ch in node.parent.children.items() if ch is not node}
