"""A small paged prefix cache with chained block hashes, written for kvcheck's example.

The shape of a vLLM-style block manager: fixed-size physical blocks, a hash table from chained
block hashes (parent hash, the block's tokens, extra keys such as a cache salt) to cached
blocks, reference counts, and a free list in LRU order. Allocation reuses prefix hits, takes a
never-used block first, evicts the least recently used unreferenced cached block when there is
none (LRU eviction inside allocation) and fails when every block is referenced (capacity).
Decode appends tokens to a request's last block and publishes it when it fills.

`BlockManager(..., fault=NAME)` plants one of FAULTS: the bug classes kvcheck must catch.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

FAULTS = ("stale_hash_after_reuse",     # eviction forgets to drop the hash-table entry
          "hash_ignores_parent",        # a chain hash computed as if every block were the first
          "hash_missing_salt",          # the cache salt (tenant) left out of the hash
          "evicts_referenced_block")    # eviction does not check the reference count


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, fault: str | None = None) -> None:
        assert fault is None or fault in FAULTS, fault
        self.block_size, self.fault = block_size, fault
        self.ref = [0] * num_blocks
        self.hash_of: list[str | None] = [None] * num_blocks   # the hash a block is cached under
        self.table: dict[str, int] = {}                         # block hash -> cached block
        self.empty = list(range(num_blocks - 1, -1, -1))        # never used or evicted (a stack)
        self.lru: OrderedDict[int, None] = OrderedDict()        # cached, unreferenced: oldest first

    def block_hash(self, parent: str | None, tokens: tuple[int, ...], extra: tuple[str, ...] = ()) -> str:
        h = hashlib.sha256()
        if self.fault != "hash_ignores_parent":
            h.update(repr(parent).encode())
        h.update(repr(tuple(tokens)).encode())
        if self.fault != "hash_missing_salt":
            h.update(repr(tuple(extra)).encode())
        return h.hexdigest()[:16]

    def cached_prefix(self, hashes: list[str]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (read-only)."""
        out = []
        for h in hashes:
            if h not in self.table:
                break
            out.append(self.table[h])
        return out

    def allocate(self, block_hash: str | None, hit: int | None = None) -> int | None:
        if hit is not None:                              # a prefix hit: take a reference
            self.ref[hit] += 1
            self.lru.pop(hit, None)
            return hit
        b = self._take_free()
        if b is None:
            return None                                  # every block is referenced
        self.ref[b] = 1
        if block_hash is not None:
            self.publish(b, block_hash)
        return b

    def _take_free(self) -> int | None:
        if not self.empty:
            victim = next(iter(self.lru), None)          # LRU eviction inside allocation
            if victim is None and self.fault == "evicts_referenced_block":
                victim = next((b for b, h in enumerate(self.hash_of) if h is not None), None)
            if victim is None:
                return None
            self._drop(victim)
        return self.empty.pop()

    def _drop(self, b: int) -> None:
        self.lru.pop(b, None)
        if self.fault != "stale_hash_after_reuse":
            self.table.pop(self.hash_of[b], None)
        self.hash_of[b] = None
        self.empty.append(b)

    def evict(self, b: int) -> bool:
        """Drop a cached block (memory pressure). Refused for a referenced one."""
        if self.hash_of[b] is None or (self.ref[b] > 0 and self.fault != "evicts_referenced_block"):
            return False
        self._drop(b)
        return True

    def append_token(self, b: int, token: int, full_hash: str | None) -> None:
        """Decode: one token into block b; `full_hash` when it fills the block."""
        if full_hash is not None:
            self.publish(b, full_hash)

    def publish(self, b: int, h: str) -> None:
        if h not in self.table:                          # the first copy stays the cached one
            self.table[h], self.hash_of[b] = b, h

    def free(self, blocks: list[int]) -> None:
        for b in reversed(blocks):                       # the tail of a prompt is evicted first
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash_of[b] is None:
                    self.empty.append(b)
                else:
                    self.lru[b] = None
