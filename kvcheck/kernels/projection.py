"""Batch-invariant matrix products: `linear` (x @ w) and `bmm_rows` (batched, per-row invariant).

Owns the one GEMM rule every other op relies on: every product is a *batched* GEMM of at least
2 matrices, each with a row count that is a multiple of ROW_TILE = 4 (zero rows padded).
Why (measured on torch 2.13 CPU, MKL 2024.2 sgemm, docs/kernels.md): on AVX512 (and on this AMD
CPU with MKL limited to AVX2) a GEMM with fewer than 4 rows takes another path than one with 4 or
more, and a single GEMM is split across threads by MKL, so the per-thread piece (and its edge
kernel) depends on M and on the thread count; a batched GEMM with B >= 2 showed no such
dependence (it appears to run each matrix whole, on one thread).
Under this rule a row's bits are the same whatever M, its offset, the other rows, 1-8 threads,
and ATen AVX512/AVX2 and MKL AVX512/AVX2/AVX (sweeps over M in 1..2048). The weight is row-major
[K, N] (`x @ w`); nn.Linear's [N, K] layout is never used. Cost: ~1.05x plain `x @ w` at 512
rows, ~5-6x at 1 row (a fixed ~12 us overhead of the batched call, +0.3-0.6 ms per decode step).
"""
from __future__ import annotations

import torch

ROW_TILE = 4          # rows per matrix: a multiple of this (MKL's < 4-row path differs)
MIN_BATCH = 2         # matrices per call: at least this (a lone GEMM is split across threads)


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


def padded_rows(m: int, tile: int = ROW_TILE) -> int:
    """m rounded up to a multiple of `tile` (at least one tile)."""
    return max(tile, -(-m // tile) * tile)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [K, N] (+ b [N]) -> [M, N]; row i's bits depend only on x[i], w, b.
    Rows are padded to a multiple of MIN_BATCH * ROW_TILE and split into MIN_BATCH matrices."""
    m, k = x.shape
    mp = padded_rows(m, MIN_BATCH * ROW_TILE)
    xp = pad_dim(x.contiguous(), 0, 0, mp - m).view(MIN_BATCH, mp // MIN_BATCH, k)
    y = torch.bmm(xp, w.expand(MIN_BATCH, *w.shape)).view(mp, w.shape[1])[:m]
    return y if b is None else y + b


def bmm_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N]; B and K, N are fixed by the caller, M is padded
    (and a lone matrix gets a zero twin). Row (i, r)'s bits depend only on a[i, r] and b[i]."""
    B, m, _ = a.shape
    ap = pad_dim(a.contiguous(), 1, 0, padded_rows(m) - m)
    b = b.contiguous()
    if B == 1:                                   # MIN_BATCH = 2: one zero twin
        ap, b = pad_dim(ap, 0, 0, 1), b.expand(MIN_BATCH, *b.shape[1:])
    return torch.bmm(ap, b)[:B, :m]
