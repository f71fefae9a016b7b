"""The toy engine's own cache manager: a prefix cache for one attention layer.

Written the way an engine team writes theirs (a page map with reference counts, a set of
published block hashes) and knowing nothing of kvcheck: sut.py is the adapter that drives it
with kvcheck's actions. `PrefixCache(trust_hash=True)` is the planted bug: a prefix whose
hashes are published is reused without checking that its pages are still there.
"""
from __future__ import annotations


class PoolFull(Exception):
    """No free page for a new block."""


class PrefixCache:
    def __init__(self, capacity: int, trust_hash: bool = False) -> None:
        self.capacity = capacity
        self.trust_hash = trust_hash
        self.refs: dict[int, int] = {}         # block -> holders, for pages present on device
        self.evicted: set[int] = set()         # blocks whose page was evicted (hash kept)
        self.published: set[int] = set()       # blocks whose hash a lookup can hit

    def match(self, n: int) -> tuple[int, int]:
        """(reusable blocks, blocks whose hashes match) for a prompt of n blocks."""
        logical = 0
        while logical < n and logical in self.published:
            logical += 1
        if self.trust_hash:
            return logical, logical
        k = 0
        while k < logical and k in self.refs:
            k += 1
        return k, logical

    def present(self, k: int) -> bool:
        """Are the pages of blocks [0, k) all on device?"""
        return all(j in self.refs for j in range(k))

    def pin(self, k: int, delta: int) -> None:
        for j in range(k):
            self.refs[j] += delta

    def write(self, j: int) -> None:
        """Block j computed by a running request: its page (shared if cached), pinned, published."""
        if j not in self.refs:
            if len(self.refs) >= self.capacity:
                raise PoolFull(f"{len(self.refs)} of {self.capacity} pages in use")
            self.refs[j] = 0
            self.evicted.discard(j)
        self.refs[j] += 1
        self.published.add(j)

    def evict(self, j: int) -> bool:
        """Free block j's page if nobody holds it (its hash stays published: a tombstone)."""
        if self.refs.get(j, 1) != 0:
            return False
        del self.refs[j]
        self.evicted.add(j)
        return True
