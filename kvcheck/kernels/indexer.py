"""Lightning indexer: score(t, s) = sum_h w[t, h] * ReLU(q[t, h] . k[s]) over compressed indexer
keys s < limit[t]; other entries score -inf.

Invariance: q . k is a `linear` (the GEMM rule of projection.py) against key tiles of a fixed
KV_TILE columns (an entry always sits at the same column of the same tile, zero-padded), and the
head sum is an explicit loop in head order, so score(t, s) depends only on q[t], w[t], k[s].
"""
from __future__ import annotations

import torch

from .attention import KV_TILE
from .projection import linear, pad_dim


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                 limit: torch.Tensor) -> torch.Tensor:
    """q [T, Hi, Di], w [T, Hi], keys [E, Di], limit [T] -> scores [T, E] (-inf at s >= limit)."""
    T, Hi, Di = q.shape
    E = keys.shape[0]
    if E == 0:
        return q.new_zeros(T, 0)
    n = -(-E // KV_TILE) * KV_TILE
    kp = pad_dim(keys, 0, 0, n - E)
    qf = q.reshape(T * Hi, Di)
    tiles = [linear(qf, kp[a:a + KV_TILE].t().contiguous()) for a in range(0, n, KV_TILE)]
    dots = (tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1))[:, :E]
    dots = dots.reshape(T, Hi, E).clamp(min=0)
    score = w[:, 0, None] * dots[:, 0]
    for h in range(1, Hi):
        score = score + w[:, h, None] * dots[:, h]
    s = torch.arange(E)
    return torch.where(s[None, :] < limit[:, None], score, float("-inf"))
