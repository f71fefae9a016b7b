"""The content shadow of a hash-chain block manager: what every physical block was filled with.

Independent of the engine's own bookkeeping: it records, for each block id the engine hands
out, the tenant and the whole token prefix the block's KV was computed from (a block's KV
depends on every token before it, not only on its own). A hit is sound only when the block it
reuses holds exactly the requester's prefix; anything else is an UNSAFE HIT (wrong content
reused), which a "page not present" check cannot see. Also draws the token content kvcheck
feeds the engine (from the config's seed): the spec's shared prefix, and the sibling prompts
and other tenants that shadow queries ask about (see docs/adapters.md, "Hash-chain managers").
"""
from __future__ import annotations

import random
from typing import Any

Content = tuple[str, tuple[int, ...]]      # (tenant, the token prefix up to the block's end)

FREED: Content = ("(freed by eviction)", ())
ALPHABET = 3          # small on purpose: equal blocks under different prefixes are common


def shared_prefix(seed: int, blocks: int, block_size: int) -> tuple[int, ...]:
    """The spec's one shared token sequence, `blocks` blocks of it (drawn from `seed`). Block 1
    repeats block 0 when there are two or more: a hash that ignores its parent then collides on
    the spec's own traffic, not only in shadow queries."""
    rng = random.Random(f"kvcheck-hashchain-{seed}")
    out = [tuple(rng.randrange(ALPHABET) for _ in range(block_size)) for _ in range(blocks)]
    if blocks >= 2:
        out[1] = out[0]
    return tuple(t for b in out for t in b)


def prompt_table(cfg: Any, tenant: str = "tenant-0") -> list[tuple[str, tuple[int, ...]]]:
    """(tenant, tokens) of each of the config's prompts, as the spec's prompt table says
    (spec/content.py): prompt 0 is the shared prefix; a salted prompt is its tokens under the
    tenant of its extra key (`tenant-{extra_key}`, the cache salt of every block's hash); any
    other prompt p >= 1 has prompt 0's tokens except at block e(p), which it edits."""
    from kvcheck.spec.content import edit_block, extra_key, salted
    B, base = cfg.block_size, shared_prefix(cfg.seed, cfg.blocks, cfg.block_size)
    rng = random.Random(f"kvcheck-prompts-{cfg.seed}")
    out = [(tenant, base)]
    for p in range(1, cfg.prompts):
        if salted(cfg, p):
            out.append((f"tenant-{extra_key(cfg, p)}", base))
            continue
        e = edit_block(cfg, p)
        old = base[e * B:(e + 1) * B]
        new = old
        while new == old:
            new = tuple(rng.randrange(ALPHABET) for _ in range(B))
        out.append((tenant, base[:e * B] + new + base[(e + 1) * B:]))
    return out


def siblings(seed: int, shared: tuple[int, ...], n: int, block_size: int, blocks: int) -> list[tuple[int, ...]]:
    """Prompts that share the first i < n blocks of the shared prefix and then differ: block i
    replaced by another block of the prefix (an edit whose tokens are cached under another
    parent) or by fresh tokens (a sibling)."""
    B = block_size
    rng = random.Random(f"kvcheck-siblings-{seed}-{n}")
    out = []
    for i in range(n):
        head = shared[:i * B]
        for m in range(blocks):
            if shared[m * B:(m + 1) * B] != shared[i * B:(i + 1) * B] or m != i:
                out.append(head + shared[m * B:(m + 1) * B])
        fresh = tuple(rng.randrange(ALPHABET) for _ in range(B))
        if fresh != shared[i * B:(i + 1) * B]:
            out.append(head + fresh)
    return [s for s in dict.fromkeys(out) if s != shared[:len(s)]]


class ContentShadow:
    """Block id -> the content it was last filled with (None: never filled)."""

    def __init__(self, block_size: int) -> None:
        self.B = block_size
        self.content: dict[int, Content] = {}

    def fill(self, block: int, tenant: str, tokens: tuple[int, ...]) -> Content | None:
        """The engine filled `block` with `tokens` (the prefix up to the block's end). Returns
        what it held before."""
        before = self.content.get(block)
        self.content[block] = (tenant, tuple(tokens))
        return before

    def release(self, block: int) -> None:
        """The engine evicted `block`: its memory is free and may be overwritten at any time, so
        a later hit on it (before it is filled again) reads freed memory."""
        self.content[block] = FREED

    def unsafe(self, hits: list[Any], tenant: str, tokens: tuple[int, ...]) -> str | None:
        """Why reusing `hits` (block ids, one per block from the start) for a request of `tenant`
        with `tokens` would read wrong content, or None when every block holds its prefix."""
        for i, b in enumerate(hits):
            need = (tenant, tuple(tokens[:(i + 1) * self.B]))
            have = self.content.get(b) if isinstance(b, int) else None
            if have != need:
                return (f"block {b!r} reused at position {i} holds {describe(have, self.B)}; "
                        f"the request needs {describe(need, self.B)}")
        return None


def describe(c: Content | None, B: int) -> str:
    if c is None:
        return "nothing (never filled)"
    if c == FREED:
        return "nothing (the manager evicted it: freed memory)"
    tenant, toks = c
    blocks = [list(toks[i:i + B]) for i in range(0, len(toks), B)]
    return f"{tenant} {blocks}"
