"""A request's token prefix as the content model holds it: compared in O(1), by prefix hash.

The content model (checks.py, timeline.py, mamba.py, twin.py) stamps every block with what its
bytes hold: (salt, the tokens of the prefix up to the block's end). As tuples, building and
comparing a stamp costs its length, so a layout at a real model's sizes (thousands of tokens,
hundreds of blocks per request) pays the square of its prompt. A `Prefix` is the same value —
it has a length, a prefix (`p[:m]`), equality and a hash — kept as (length, polynomial hash of
the tokens) over the request's own token list, whose hashes are computed once, as tokens arrive.
Equal prefixes of different requests compare equal (equal hashes); a 61-bit modular hash makes
a false equality astronomically unlikely (~n/2^61 per comparison).
"""
from __future__ import annotations

from typing import Any

_M = (1 << 61) - 1          # a Mersenne prime modulus
_B = 1_000_003              # the base (tokens are small non-negative ints)


class Chain:
    """Prefix hashes of one token list (vLLM's ``Request.all_token_ids``), extended as tokens
    arrive. The list is taken to change only at its end (vLLM appends sampled tokens; a list cut
    back — async scheduling's stale outputs — loses the hashes past the first token that differs
    from what was hashed, found walking back from the end)."""

    __slots__ = ("src", "tokens", "h", "seen")

    def __init__(self, src: Any) -> None:
        # (vLLM's ConstantList: its plain list underneath, read without a Python call per item)
        self.src, self.tokens, self.h, self.seen = src, getattr(src, "_x", src), [0], []

    def at(self, n: int) -> int:
        """The hash of the first n tokens (n <= len(tokens))."""
        h, toks, seen = self.h, self.tokens, self.seen
        k = min(len(seen), len(toks))
        while k and seen[k - 1] != toks[k - 1]:
            k -= 1
        if k < len(seen):
            del h[k + 1:], seen[k:]
        for i in range(len(seen), n):
            seen.append(toks[i])
            h.append((h[-1] * _B + toks[i] + 1) % _M)
        return h[n]


class Prefix:
    """The first `n` tokens of a chain, as a value: len, [:m], ==, hash."""

    __slots__ = ("chain", "n", "key")

    def __init__(self, chain: Chain, n: int) -> None:
        self.chain, self.n = chain, n
        self.key = (n, chain.at(n))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, s: slice) -> "Prefix":
        if not isinstance(s, slice) or s.start not in (None, 0) or s.step is not None:
            raise TypeError("a Prefix supports only p[:m]")
        if s.stop is None or s.stop >= self.n:
            return self
        return Prefix(self.chain, max(0, s.stop))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Prefix):
            return self.key == other.key
        return isinstance(other, tuple) and len(other) == self.n and tuple(self.chain.tokens[:self.n]) == other

    def __hash__(self) -> int:
        return hash(self.key)

    def __iter__(self) -> Any:
        return iter(self.chain.tokens[:self.n])

    def __repr__(self) -> str:
        toks = list(self)
        return f"Prefix({toks if len(toks) <= 12 else toks[:6] + ['...'] + toks[-3:]}, n={self.n})"


def prefix(req: Any, end: int) -> tuple:
    """(salt, the first `end` tokens of the request), the content model's stamp."""
    chain = req.chain
    if chain is None or chain.src is not req.obj.all_token_ids:
        chain = req.chain = Chain(req.obj.all_token_ids)
    return (req.salt, Prefix(chain, max(0, min(end, len(chain.tokens)))))
