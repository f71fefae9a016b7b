"""Block compression: entry[w, c] = sum_i softmax_i(gate[i, c] + pos_bias[i, c]) * kv[i, c] over
the m tokens of block w (softmax over the m tokens, per channel).

Invariance: every reduction over the m tokens is an explicit loop in token order over [nb, C]
elementwise ops (max, then sum of exp, then weighted sum), so an entry's bits depend only on its
block's m rows, never on how many blocks are compressed together or when.
"""
from __future__ import annotations

import torch


def compress(kv: torch.Tensor, gate: torch.Tensor, pos_bias: torch.Tensor) -> torch.Tensor:
    """kv, gate [nb, m, C], pos_bias [m, C] -> entries [nb, C]."""
    nb, m, C = kv.shape
    if nb == 0:
        return kv.new_zeros(0, C)
    z = gate + pos_bias
    mx = z[:, 0]
    for i in range(1, m):
        mx = torch.maximum(mx, z[:, i])
    e = torch.exp(z - mx[:, None])
    den = e[:, 0]
    num = e[:, 0] * kv[:, 0]
    for i in range(1, m):
        den = den + e[:, i]
        num = num + e[:, i] * kv[:, i]
    return num / den
