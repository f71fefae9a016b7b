"""Deterministic top-k: order by (score descending, index ascending); -inf scores are never
selected. Invariance: a stable sort keeps ascending index order among equal scores, and extra
-inf columns (other queries' wider candidate sets) sort after every real candidate.
"""
from __future__ import annotations

import torch


def topk_desc(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [T, E] -> indices [T, k] (int64), -1 where fewer than k candidates are finite."""
    T, E = scores.shape
    if E == 0:
        return torch.full((T, k), -1, dtype=torch.long)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    ok = torch.gather(scores, 1, order) != float("-inf")
    idx = torch.where(ok, order, -1)
    if idx.shape[1] < k:
        idx = torch.cat([idx, idx.new_full((T, k - idx.shape[1]), -1)], dim=1)
    return idx
