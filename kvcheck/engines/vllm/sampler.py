"""The fake model both drives sample from: a greedy token that is a stable function of the context,
an EAGLE drafter right with probability ~0.7, and the rejection sampler (a replay proposes and
samples the same)."""
from __future__ import annotations

import zlib

from .layouts import VOCAB


def next_token(tokens: list[int]) -> int:
    """The fake model's greedy token after `tokens` (a stable hash of the recent context)."""
    return zlib.crc32(bytes(t & 0xFF for t in tokens[-8:]) + len(tokens).to_bytes(4, "little")) % VOCAB


def draft_tokens(ctx: list[int], k: int) -> list[int]:
    """The EAGLE drafter's k tokens after `ctx`: each the greedy token with probability ~0.7 (a
    stable function of the context, so a replay proposes the same)."""
    ctx, d = list(ctx), []
    for _ in range(k):
        t = next_token(ctx)
        d.append(t if next_token(ctx + [VOCAB]) % 10 < 7 else (t + 1) % VOCAB)
        ctx.append(d[-1])
    return d


def greedy(ctx: list[int], drafts: list[int]) -> list[int]:
    """The sampler's tokens after `ctx`: the greedy token, and after each draft while the drafts
    match it (the rejection sampler)."""
    ctx, out = list(ctx), []
    while True:
        t = next_token(ctx)
        out.append(t)
        if len(out) > len(drafts) or drafts[len(out) - 1] != t:
            return out
        ctx.append(t)
