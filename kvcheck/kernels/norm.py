"""Batch-invariant RMSNorm and rotary position embedding (RoPE).

RMSNorm reduces over the (fixed, innermost, contiguous) feature dim of one row; the vectorised
CPU reduction's order depends only on that length, so a row's bits do not depend on how many rows
share the call (tested). RoPE is elementwise; its angles are computed from the absolute position
alone (pos * inv_freq in float32), so a cached key and a recomputed key rotate identically.
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [..., C] -> x / sqrt(mean(x^2) + eps) * weight."""
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight


_TABLES: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(d: int, theta: float, need: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / signed-sin tables [P, d] for positions [0, P), P >= need. Grown by recomputing
    (elementwise per position, so an entry's bits never depend on the table size)."""
    cos, sin = _TABLES.get((d, theta), (None, None))
    if cos is None or cos.shape[0] < need:
        size = max(1024, 1 << (max(need, 1) - 1).bit_length())
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        ang = torch.arange(size, dtype=torch.float32)[:, None] * inv[None, :]
        c, s = torch.cos(ang), torch.sin(ang)
        cos, sin = torch.cat([c, c], -1), torch.cat([-s, s], -1)
        _TABLES[(d, theta)] = (cos, sin)
    return cos, sin


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] (a - b*s computed as
    a + b*(-s), bit-identical). x [T, H, D] (D even), pos [T] int64 absolute positions."""
    d = x.shape[-1]
    cos, sin = _tables(d, theta, int(pos.max()) + 1 if pos.numel() else 0)
    return x * cos[pos][:, None] + torch.roll(x, d // 2, -1) * sin[pos][:, None]
