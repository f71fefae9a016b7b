"""A sequence-level prefix cache written for kvcheck's tests, and its adapter on the hash-chain
base class: the shape of a third-party manager a new user plugs in (kvcheck issue 35).

The manager works per sequence: `admit(seq, tokens)` allocates a whole prompt at admission,
`append_block(seq, tokens)` grows a sequence by one block; a hash hit is confirmed by comparing
token ids; there is no cache salt; there is no evict call: a free block (cached or not) is
reused for new content in LRU order, which evicts what it held (implicit eviction).

Planted bugs (`SeqCache(..., bug=NAME)`; None is the fix of both):
  wrong_block_hit  the chain hash leaves the parent out and the token check compares the block's
                   own tokens only, so a hit can serve another block's KV (prompt 0's block 1
                   repeats block 0)                                      -> hit_sound_content
  lost_reuse       the read-only match stops one block short of the cached prefix (an
                   off-by-one), so a reusable block is recomputed        -> decision_matches_spec

`SeqCache(..., late_publish=True)` is legal behaviour, not a bug: a sequence's blocks enter the
hash table only when it is freed (the shape of a radix cache that inserts a request's prefix when
it finishes). Two requests that compute one prefix meanwhile hold two physical copies of it (a
duplicate); the first one published stays the cached one.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

from kvcheck.engines.hashchain.base import HashChainAdapter

BUGS = {"wrong_block_hit": "hit_sound_content", "lost_reuse": "decision_matches_spec"}
# planted in the late-publishing manager only: at a sequence's release each block is published
# under the hash of its own tokens (no parent, the last block wins), so prompt 0's block 1
# answers a lookup of block 0
LATE_BUGS = {"late_key_without_parent": "hit_sound_content"}


class SeqCache:
    def __init__(self, num_blocks: int, block_size: int, bug: str | None = None,
                 late_publish: bool = False) -> None:
        assert bug is None or bug in BUGS or (late_publish and bug in LATE_BUGS), bug
        self.B, self.bug, self.late = block_size, bug, late_publish
        self.ref = [0] * num_blocks
        self.key: list[str | None] = [None] * num_blocks          # the hash a block is cached under
        self.toks: list[tuple[int, ...] | None] = [None] * num_blocks
        self.table: dict[str, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # free
        self.seqs: dict[int, list[int]] = {}
        self.last: dict[int, str | None] = {}                     # a sequence's last block hash

    def _hash(self, parent: str | None, block: tuple[int, ...]) -> str:
        parent = None if self.bug == "wrong_block_hit" else parent
        return hashlib.sha256(repr((parent, block)).encode()).hexdigest()[:16]

    def _cached(self, parent: str | None, block: tuple[int, ...]) -> tuple[str, int | None]:
        h = self._hash(parent, block)
        b = self.table.get(h)
        return h, b if b is not None and self.toks[b] == block else None    # token ids compared

    def match(self, tokens: tuple[int, ...]) -> list[int]:
        """Read-only: the cached blocks of the longest prefix of `tokens` (full blocks)."""
        out, parent = [], None
        for i in range(len(tokens) // self.B):
            parent, b = self._cached(parent, tuple(tokens[i * self.B:(i + 1) * self.B]))
            if b is None:
                break
            out.append(b)
        return out[:-1] if self.bug == "lost_reuse" else out

    def append_block(self, seq: int, block: tuple[int, ...]) -> int | None:
        """Grow sequence `seq` by one block: a cached one when its hash and tokens match, else
        the least recently freed block (what it cached is evicted). None: no free block."""
        blocks = self.seqs.setdefault(seq, [])
        h, b = self._cached(self.last.get(seq), tuple(block))
        if b is None:
            if not self.lru:
                return None
            b = next(iter(self.lru))
            if self.key[b] is not None and self.table.get(self.key[b]) == b:
                del self.table[self.key[b]]
            self.key[b], self.toks[b] = h, tuple(block)
            if not self.late:
                self.table[h] = b
        self.lru.pop(b, None)
        self.ref[b] += 1
        blocks.append(b)
        self.last[seq] = h
        return b

    def admit(self, seq: int, tokens: tuple[int, ...]) -> list[int] | None:
        """A whole prompt at admission (None, nothing held: it does not fit)."""
        for i in range(len(tokens) // self.B):
            if self.append_block(seq, tuple(tokens[i * self.B:(i + 1) * self.B])) is None:
                self.free(seq)
                return None
        return list(self.seqs[seq])

    def evict(self, b: int) -> bool:
        """Drop an unreferenced block: its hash entry goes, its memory is reused first."""
        if self.ref[b]:
            return False
        if self.key[b] is not None and self.table.get(self.key[b]) == b:
            del self.table[self.key[b]]
        self.key[b] = self.toks[b] = None
        self.lru[b] = None
        self.lru.move_to_end(b, last=False)
        return True

    def free(self, seq: int) -> None:
        for b in self.seqs.get(seq, []) if self.late else ():
            if self.bug == "late_key_without_parent":        # under its own tokens' hash, last one wins
                self.table[self._hash(None, self.toks[b])] = b
                continue
            self.table.setdefault(self.key[b], b)           # published now; the first copy stays
        for b in reversed(self.seqs.pop(seq, [])):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.lru[b] = None
        self.last.pop(seq, None)


class SeqAdapter(HashChainAdapter):
    """The manager on the block-level base class: a hash is the token chain itself."""

    name = "seqcache"
    faults = dict(BUGS)

    def start(self, num_blocks, block_size):
        self.m = SeqCache(num_blocks, block_size, bug=self.fault)

    def hash(self, parent, tokens, extra):
        return (parent or ()) + tuple(tokens)        # no salt: the engine has none

    def lookup(self, hashes):
        return self.m.match(hashes[-1]) if hashes else []

    def allocate(self, req, block_hash, hit=None):
        return self.m.append_block(req, block_hash[-self.B:])

    def free(self, req, blocks):
        self.m.free(req)


class LatePublishAdapter(SeqAdapter):
    """The fixed manager publishing a sequence's blocks only when it is freed (legal duplicates;
    config publish = "release", duplicates = "allow"). It maps the manager's evict: with
    prompts > 1 the base class evicts another prompt's copy of a position a request rewrites."""

    name = "seqcache-late"
    faults = {**BUGS, **LATE_BUGS}

    def start(self, num_blocks, block_size):
        self.m = SeqCache(num_blocks, block_size, bug=self.fault, late_publish=True)

    def evict(self, block):
        return self.m.evict(block)
