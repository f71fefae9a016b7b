"""Batch-invariant matrix products: `linear` (x @ w) and `bmm_rows` (batched, per-row invariant).

Owns the one GEMM rule every other op relies on. Invariance: the row count handed to the BLAS is
always padded up to a multiple of ROW_TILE (zero rows), so a row never reaches the M=1 GEMV path
nor an odd-M edge kernel; measured on torch 2.13 CPU (MKL sgemm), a padded row's bits are then the
same whatever M, its offset in the batch, or the other rows' values (tests/kernels). The weight is
row-major [K, N] (`x @ w`); nn.Linear's [N, K] layout is NOT invariant for small M and is never
used. Measured: only M=1 (GEMV) differed from the padded GEMM among M in 1..4096, offsets 0..40,
1 and 2 threads; ROW_TILE=16 and ROW_TILE=2 were both invariant, 2 is cheaper for decode. Cost: one
GEMM plus, for odd M, a one-row pad copy (~1.0-1.1x plain `x @ w` at 512x64x192).
"""
from __future__ import annotations

import torch

ROW_TILE = 2


_CONST: dict[tuple, torch.Tensor] = {}


def const(shape: tuple[int, ...], value, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A cached read-only constant block (never written: only ever copied by torch.cat)."""
    key = (tuple(shape), value, dtype)
    t = _CONST.get(key)
    if t is None:
        t = _CONST[key] = torch.full(shape, value, dtype=dtype)
    return t


def pad_dim(x: torch.Tensor, dim: int, before: int, after: int, value=0.0) -> torch.Tensor:
    """Pad one dim with a constant (a cat with cached blocks: ~2x cheaper than F.pad here)."""
    if before == 0 and after == 0:
        return x
    parts = []
    for n in (before, after):
        shape = list(x.shape)
        shape[dim] = n
        parts.append(const(tuple(shape), value, x.dtype) if n else None)
    return torch.cat([t for t in (parts[0], x, parts[1]) if t is not None], dim=dim)


def _pad_rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    m = x.shape[dim]
    mp = max(ROW_TILE, -(-m // ROW_TILE) * ROW_TILE)
    return pad_dim(x, dim, 0, mp - m), m


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
