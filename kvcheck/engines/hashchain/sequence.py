"""The sequence-level shape of the hash-chain base class: for a manager whose operations take a
sequence and its tokens rather than block hashes (admit a sequence on its cached prefix, grow it
block by block, free it). The user maps five callbacks; scheduling, content, the state mapping
and the content shadow are the base class's (base.py). docs/adapters.md, "A sequence-level
manager", walks through examples/seq_adapter.py.
"""
from __future__ import annotations

import inspect
from typing import Any

from kvcheck.spec.config import Config
from kvcheck.spec.sut import ActionRejected
from .base import HashChainAdapter

SALTED = ("lookup", "admit", "append")      # the callbacks given tokens: a salt keys them too


class SequenceAdapter(HashChainAdapter):
    """Subclass it and implement `start`, `lookup`, `admit`, `append`, `free` (optionally
    `evict`). Sequences are the spec's request slots 0..requests-1, block ids ints, tokens tuples
    of ints; every token tuple is whole blocks (a multiple of `self.B`, the block size). With a
    salted config (`"salt": true`) `lookup`, `admit` and `append` each declare a `salt`
    parameter and receive the tenant's cache salt (a string) with the tokens."""

    name = "sequence"

    # ---- what the user supplies ------------------------------------------------------------
    def start(self, num_blocks: int, block_size: int) -> None:
        """Make a fresh, empty manager with `num_blocks` physical blocks of `block_size` tokens."""
        raise NotImplementedError

    def lookup(self, tokens: tuple[int, ...]) -> list[int]:  # type: ignore[override]
        """Read-only: the block ids of the longest cached prefix of `tokens`, one per block."""
        raise NotImplementedError

    def admit(self, seq: int, tokens: tuple[int, ...]) -> list[int] | None:
        """Sequence `seq` starts on the cached prefix `tokens` (what a lookup found and the spec
        decided to reuse; empty when nothing is reused): reference those blocks and return their
        ids in order. None: refused, nothing held. Nothing beyond `tokens` is allocated here."""
        raise NotImplementedError

    def append(self, seq: int, tokens: tuple[int, ...]) -> int | None:
        """Grow sequence `seq` by one block holding `tokens` (one block of tokens): a cached block
        with this content after this sequence's prefix, or a free block the manager fills (and
        may evict what it cached: observed, never requested). Returns the block id; None when no
        block is free (nothing changed)."""
        raise NotImplementedError

    def free(self, seq: int) -> None:  # type: ignore[override]
        """Sequence `seq` finished or was preempted: release its blocks (they stay cached)."""
        raise NotImplementedError

    # optional: evict(block) -> bool, as in the block-level shape (declares `evict`).

    # ---- the base class's calls, in this shape -----------------------------------------------
    def reset(self, cfg: Config) -> None:
        bare = [n for n in SALTED if "salt" not in inspect.signature(getattr(self, n)).parameters]
        if cfg.salt and bare:
            raise ValueError(f"{type(self).__name__}: {', '.join(bare)} take no salt (a manager keying "
                             "blocks by tokens alone): declare a `salt` parameter, or set \"salt\": "
                             "false in the config")
        self.salted = cfg.salt
        super().reset(cfg)

    def _salt(self, tenant: str) -> dict[str, str]:
        """The keyword a salted config passes the callbacks given tokens (none otherwise)."""
        return {"salt": tenant} if self.salted else {}

    def _ask(self, tenant: str, toks: tuple[int, ...]) -> Any:
        return self.lookup(tuple(toks), **self._salt(tenant))

    def _admit(self, r: int, hits: list[int]) -> None:
        tenant, toks = self._prompt(r)
        got = self.admit(r, tuple(toks[:len(hits) * self.B]), **self._salt(tenant))
        if got is None:
            raise ActionRejected(f"admit refused sequence {r} on its {len(hits)} cached blocks")
        if not isinstance(got, (list, tuple)) or len(got) != len(hits):
            raise TypeError(f"admit() must return {len(hits)} block ids (one per cached block), got {got!r:.60}")
        for i, b in enumerate(got):
            self._take(r, b, i, hit=True)

    def _alloc(self, r: int, j: int, hit: int | None) -> int | None:
        tenant, toks = self._prompt(r)
        got = self.append(r, tuple(toks[j * self.B:(j + 1) * self.B]), **self._salt(tenant))
        if got is not None:
            self._take(r, got, j, hit=got == hit)    # another block than the hit: the manager filled it
        return got

    def _release(self, r: int, blocks: list[int]) -> None:
        self.free(r)

    def hash(self, parent: Any, tokens: tuple[int, ...], extra: tuple[str, ...]) -> Any:
        return (parent or ()) + tuple(tokens)      # unused by this shape's calls: the token chain

    def allocate(self, req: int, block_hash: Any, hit: int | None = None) -> int | None:
        raise AssertionError("a sequence-level adapter allocates through admit and append")
