"""Batch-invariant attention: over a slot range (raw KV, paged or contiguous, and compressed
entries) and over per-query gathered slots (CSA's top-k entries), composable in one softmax.

Invariance: keys are cut into *absolute* tiles of KV_TILE slots (tile j holds slots
[j*KV_TILE, (j+1)*KV_TILE), zero-padded). Scores and per-tile weighted sums are padded-row GEMMs
(projection.bmm_rows) of one fixed shape per tile, [M, D] x [D, KV_TILE] and [M, KV_TILE] x
[KV_TILE, D+1] (the softmax denominator rides in the GEMM as a ones column); the max is exact in any
order; the per-tile sums are added in ascending tile order; segments (window, entries, top-k) merge
by the online-softmax rule, the max starting at a finite floor M0. A query's bits therefore depend
only on its own key set, never on which tiles the batch spans: a tile outside its range adds an
exact +0 (p = exp(-inf) = 0), and a masked slot contributes an exact 0 term whatever its value. Gathered slots (top-k) are
reduced by an explicit loop over the k slots, so their order is the slot order, fixed per query.
Null slots: a block-table entry NULL_PAGE (or a False in `valid`) is masked.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .projection import bmm_rows

KV_TILE = 64
NULL_PAGE = -1
_NEG = float("-inf")


@dataclass
class Carry:
    """Online-softmax state for T queries: m [H, T, 1] running max (starts at M0, a finite
    floor, so an all-masked tile needs no NaN guard), acc [H, T, D+1] (last column is the running
    softmax denominator)."""

    m: torch.Tensor
    acc: torch.Tensor


M0 = -1e30


def new_carry(n_heads: int, n_q: int, head_dim: int) -> Carry:
    return Carry(torch.full((n_heads, n_q, 1), M0), torch.zeros(n_heads, n_q, head_dim + 1))


def _update(c: Carry, s: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold scores s [H, T, n] (mask broadcastable, True = visible) into the running max;
    return (alpha, p). Masked scores are -inf, so p = exp(-inf - m) = 0 exactly; an all-masked
    tile leaves m unchanged and gives alpha = exp(0) = 1."""
    s = s.masked_fill(~mask, _NEG)
    m_new = torch.maximum(c.m, s.amax(-1, keepdim=True))
    alpha = torch.exp(c.m - m_new)
    c.m = m_new
    return alpha, torch.exp(s - m_new)


def attend_range(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                 lo: torch.Tensor, hi: torch.Tensor, carry: Carry,
                 valid: torch.Tensor | None = None) -> Carry:
    """Query i attends to slots lo[i] <= s < hi[i] (absolute slot numbers). k, v [S, H, D] hold
    slots [start, start+S); q [T, H, D] is pre-scaled. Slots a query may see must be present
    (and `valid`, if given). Updates and returns `carry`.

    All tiles the batch spans are scored at once (a bmm over H x tiles of fixed [T, D] x [D, 64]
    shape), the segment max is exact, and the per-tile weighted sums are added in tile order."""
    T, H, D = q.shape
    S = k.shape[0]
    if S == 0 or T == 0:
        return carry
    lo_min, hi_max = int(lo.min()), int(hi.max())
    if lo_min < start or hi_max > start + S:
        raise ValueError(f"slot range [{lo_min}, {hi_max}) not within [{start}, {start + S})")
    j0, j1 = lo_min // KV_TILE, (hi_max - 1) // KV_TILE + 1
    n, base = j1 - j0, j0 * KV_TILE
    a, b = max(base, start), min(j1 * KV_TILE, start + S)     # slots present in the span
    kz = k.new_zeros(n * KV_TILE, H, D)
    kz[a - base:b - base] = k[a - start:b - start]
    vz = v.new_zeros(n * KV_TILE, H, D + 1)
    vz[:, :, D] = 1.0
    vz[a - base:b - base, :, :D] = v[a - start:b - start]
    pos = torch.arange(base, j1 * KV_TILE)
    mask = (pos >= lo[:, None]) & (pos < hi[:, None])          # [T, n*TILE]
    if valid is not None:
        vt = valid.new_zeros(n * KV_TILE)
        vt[a - base:b - base] = valid[a - start:b - start]
        mask = mask & vt
    kt = kz.view(n, KV_TILE, H, D).permute(2, 0, 3, 1).reshape(H * n, D, KV_TILE)
    qh = q.transpose(0, 1)[:, None].expand(H, n, T, D).reshape(H * n, T, D)
    sc = bmm_rows(qh, kt).view(H, n, T, KV_TILE).permute(0, 2, 1, 3).reshape(H, T, n * KV_TILE)
    alpha, p = _update(carry, sc, mask[None])
    pt = p.view(H, T, n, KV_TILE).permute(0, 2, 1, 3).reshape(H * n, T, KV_TILE)
    vt3 = vz.view(n, KV_TILE, H, D + 1).permute(2, 0, 1, 3).reshape(H * n, KV_TILE, D + 1)
    pv = bmm_rows(pt, vt3).view(H, n, T, D + 1)
    acc = carry.acc * alpha
    for j in range(n):                                           # ascending absolute tiles
        acc = acc + pv[:, j]
    carry.acc = acc
    return carry


def attend_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                    carry: Carry) -> Carry:
    """Query i attends to its own n slots k[i, j], v[i, j] ([T, n, H, D]) where valid[i, j]."""
    T, n, H, D = k.shape
    if n == 0 or T == 0:
        return carry
    s = (q[:, None] * k).sum(-1).permute(2, 0, 1)                # [H, T, n], reduce over D only
    alpha, p = _update(carry, s, valid[None])
    ve = torch.cat([v, v.new_ones(T, n, H, 1)], dim=-1).permute(2, 0, 1, 3)  # [H, T, n, D+1]
    acc = carry.acc * alpha
    for j in range(n):                                           # fixed slot order
        acc = acc + p[:, :, j:j + 1] * ve[:, :, j]
    carry.acc = acc
    return carry


def finish(carry: Carry) -> torch.Tensor:
    """-> [T, H, D]; a query with no visible slot gets zeros."""
    den = carry.acc[..., -1:]
    out = carry.acc[..., :-1] / torch.where(den > 0, den, 1.0)
    return out.transpose(0, 1).contiguous()


def gather_pages(pages: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pages [num_pages, P, ...], block_table [n] (NULL_PAGE = absent) -> (slots [n*P, ...],
    valid [n*P]); logical page i holds slots [i*P, (i+1)*P)."""
    P = pages.shape[1]
    null = block_table == NULL_PAGE
    g = pages[block_table.clamp(min=0)]
    g = torch.where(null.view(-1, *([1] * (g.dim() - 1))), torch.zeros_like(g), g)
    return g.reshape(-1, *pages.shape[2:]), (~null).repeat_interleave(P)


def paged_attention(q: torch.Tensor, q_pos: torch.Tensor, k_pages: torch.Tensor,
                    v_pages: torch.Tensor, block_table: torch.Tensor, window: int | None,
                    scale: float) -> torch.Tensor:
    """Causal (window=None) or sliding-window attention over paged KV of one sequence.
    q [T, H, D] at absolute positions q_pos [T]; query t sees s with t-W < s <= t. Null pages
    must lie outside every query's window."""
    k, valid = gather_pages(k_pages, block_table)
    v, _ = gather_pages(v_pages, block_table)
    hi = q_pos + 1
    lo = torch.zeros_like(q_pos) if window is None else (q_pos - window + 1).clamp(min=0)
    c = new_carry(q.shape[1], q.shape[0], q.shape[2])
    attend_range(q * scale, k, v, 0, lo, hi, c, valid)
    return finish(c)
