"""A small sequence-level prefix cache, written for kvcheck's example of the sequence shape.

The shape of a manager that works per sequence rather than per block hash: `admit(seq, tokens)`
starts a sequence on a cached prefix, `extend(seq, tokens)` grows it by one block, `release(seq)`
ends it. A block is cached under the whole token prefix up to its end (token ids compared, no
hash to collide, no cache salt). There is no evict call: an unreferenced block, cached or not, is
reused for new content in LRU order, which evicts what it cached (implicit eviction).

`SeqManager(..., bug="key_without_prefix")` plants a bug: a block is cached under its own tokens
only, so a hit can serve another block's KV (the same tokens after another prefix).
"""
from __future__ import annotations

from collections import OrderedDict

BUGS = ("key_without_prefix",)


class SeqManager:
    def __init__(self, num_blocks: int, block_size: int, bug: str | None = None) -> None:
        assert bug is None or bug in BUGS, bug
        self.B, self.bug = block_size, bug
        self.ref = [0] * num_blocks
        self.key: list[tuple[int, ...] | None] = [None] * num_blocks   # what a block is cached under
        self.index: dict[tuple[int, ...], int] = {}                    # key -> cached block
        self.lru: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.seqs: dict[int, list[int]] = {}                           # a sequence's blocks
        self.tokens: dict[int, tuple[int, ...]] = {}                   # ... and its tokens

    def _key(self, prefix: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(block) if self.bug == "key_without_prefix" else tuple(prefix) + tuple(block)

    def match(self, tokens: tuple[int, ...]) -> list[int]:
        """Read-only: the cached blocks of the longest prefix of `tokens` (whole blocks)."""
        out: list[int] = []
        for i in range(len(tokens) // self.B):
            b = self.index.get(self._key(tokens[:i * self.B], tokens[i * self.B:(i + 1) * self.B]))
            if b is None:
                break
            out.append(b)
        return out

    def admit(self, seq: int, tokens: tuple[int, ...]) -> list[int] | None:
        """Start `seq` on the cached prefix `tokens`; None (nothing held) when it is not cached."""
        blocks = self.match(tokens)
        if len(blocks) * self.B != len(tokens):
            return None
        for b in blocks:
            self._hold(b)
        self.seqs[seq], self.tokens[seq] = list(blocks), tuple(tokens)
        return blocks

    def extend(self, seq: int, block: tuple[int, ...]) -> int | None:
        """One more block: the cached one for this prefix, else the least recently released
        block (what it cached is dropped). None: every block is referenced."""
        prefix = self.tokens[seq]
        key = self._key(prefix, block)
        b = self.index.get(key)
        if b is None:
            if not self.lru:
                return None
            b = next(iter(self.lru))
            if self.key[b] is not None and self.index.get(self.key[b]) == b:
                del self.index[self.key[b]]
            self.key[b], self.index[key] = key, b
        self._hold(b)
        self.seqs[seq].append(b)
        self.tokens[seq] = prefix + tuple(block)
        return b

    def _hold(self, b: int) -> None:
        self.ref[b] += 1
        self.lru.pop(b, None)

    def release(self, seq: int) -> None:
        for b in reversed(self.seqs.pop(seq, [])):      # the tail is reused first
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.lru[b] = None
        self.tokens.pop(seq, None)
