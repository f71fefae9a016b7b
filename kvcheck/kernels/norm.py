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


_INV: dict[tuple[int, float], torch.Tensor] = {}


def _inv_freq(d: int, theta: float) -> torch.Tensor:
    if (d, theta) not in _INV:
        _INV[(d, theta)] = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    return _INV[(d, theta)]


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE. x [T, H, D] (D even), pos [T] int64 absolute positions."""
    d = x.shape[-1]
    inv = _inv_freq(d, theta)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]          # [T, D/2]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
