"""Batch-invariant attention: over a slot range (raw KV, paged or contiguous, and compressed
entries) and over per-query gathered slots (CSA's top-k entries), composable in one softmax.

Invariance: keys are cut into *absolute* tiles of KV_TILE slots (tile j holds slots
[j*KV_TILE, (j+1)*KV_TILE), zero-padded). Scores and per-tile weighted sums are batched GEMMs with
one fixed shape per (head, tile) entry, [Tp, D] x [D, KV_TILE] and [Tp, KV_TILE] x [KV_TILE, D+1],
through projection.bmm_rows (query rows padded to a multiple of ROW_TILE once, in the carry; at
least two matrices per call: the GEMM rule of projection.py; the softmax denominator rides in
the GEMM as a ones column). The max is exact in any order; the per-tile sums
are added in ascending tile order; segments (window, entries, top-k) merge by the online-softmax
rule, the max starting at a finite floor M0. A query's bits therefore depend only on its own key
set, never on which tiles the batch spans: a tile outside its range adds an exact +0 (p = 0), and
a masked slot contributes an exact 0 term whatever its value. Gathered slots (top-k) are reduced
by an explicit loop over the k slots, so their order is the slot order, fixed per query. Null
slots: a block-table entry NULL_PAGE (or a False in `valid`) is masked.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .projection import bmm_rows, pad_dim, padded_rows

KV_TILE = 64
Q_CHUNK = 64          # queries scored together in a long prefill (any multiple of ROW_TILE)
NULL_PAGE = -1
_NEG = float("-inf")


@dataclass
class Carry:
    """Online-softmax state for n queries, rows padded to a multiple of ROW_TILE (padded rows see
    nothing): m [H, Tp, 1] running max (starts at a finite floor M0, so an all-masked tile needs no
    NaN guard), acc [H, Tp, D+1] (the last column is the running softmax denominator)."""

    m: torch.Tensor
    acc: torch.Tensor
    n: int


M0 = -1e30


def new_carry(n_heads: int, n_q: int, head_dim: int) -> Carry:
    tp = padded_rows(n_q)
    return Carry(torch.full((n_heads, tp, 1), M0), torch.zeros(n_heads, tp, head_dim + 1), n_q)


def _merge(c: Carry, s: torch.Tensor, hidden: torch.Tensor, amax_dims,
           m_view=lambda m: m) -> torch.Tensor:
    """Fold scores s (hidden = masked) into the running max, rescale acc, return p. Masked
    slots get p = 0 exactly (exp is never evaluated at -inf: on this CPU exp(-inf) takes a slow
    path ~9x the normal cost); an all-masked segment leaves m unchanged (rescale by exp(0) = 1)."""
    m_new = torch.maximum(c.m, s.masked_fill(hidden, _NEG).amax(amax_dims).unsqueeze(-1))
    c.acc = c.acc * torch.exp(c.m - m_new)
    c.m = m_new
    return torch.exp((s - m_view(m_new)).masked_fill(hidden, 0.0)).masked_fill(hidden, 0.0)


def attend_range(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                 lo: torch.Tensor, hi: torch.Tensor, carry: Carry,
                 valid: torch.Tensor | None = None,
                 span: tuple[int, int] | None = None) -> Carry:
    """Query i attends to slots lo[i] <= s < hi[i] (absolute slot numbers). k, v [S, H, D] hold
    slots [start, start+S); q [T, H, D] is pre-scaled. Slots a query may see must be present
    (and `valid`, if given). `span` = (min(lo), max(hi)) if the caller knows it. Updates and
    returns `carry`.

    All tiles the batch spans are scored at once (a bmm over H x tiles of fixed [Tp, D] x
    [D, KV_TILE] shape), the segment max is exact, and the per-tile weighted sums ([Tp, KV_TILE] x
    [KV_TILE, D+1]) are added in ascending tile order."""
    T, H, D = q.shape
    S = k.shape[0]
    if S == 0 or T == 0:
        return carry
    if T > Q_CHUNK:
        # Long prefill: each chunk of Q_CHUNK queries scores only the tiles its own queries can
        # see (a causal or windowed chunk spans far fewer tiles than the whole batch). Bits are
        # unchanged: a query's result never depends on which tiles its batch spans.
        tp = carry.m.shape[1]
        for a in range(0, T, Q_CHUNK):
            b = min(a + Q_CHUNK, T)
            rows = tp - a if b == T else b - a
            sub = Carry(carry.m[:, a:a + rows], carry.acc[:, a:a + rows], b - a)
            attend_range(q[a:b], k, v, start, lo[a:b], hi[a:b], sub, valid)
            carry.m[:, a:a + rows] = sub.m
            carry.acc[:, a:a + rows] = sub.acc
        return carry
    lo_min, hi_max = span if span is not None else (int(lo.min()), int(hi.max()))
    if lo_min >= hi_max:
        return carry
    if lo_min < start or hi_max > start + S:
        raise ValueError(f"slot range [{lo_min}, {hi_max}) not within [{start}, {start + S})")
    tp = carry.m.shape[1]
    j0, j1 = lo_min // KV_TILE, (hi_max - 1) // KV_TILE + 1
    n, base = j1 - j0, j0 * KV_TILE
    a, b = max(base, start), min(j1 * KV_TILE, start + S)     # slots present in the span
    rows = (a - base, j1 * KV_TILE - b)
    kz = pad_dim(k[a - start:b - start], 0, *rows)
    vz = pad_dim(pad_dim(v[a - start:b - start], 2, 0, 1, 1.0), 0, *rows)
    kt = kz.view(n, KV_TILE, H, D).permute(2, 0, 3, 1).reshape(H * n, D, KV_TILE)
    vt = vz.view(n, KV_TILE, H, D + 1).permute(2, 0, 1, 3).reshape(H * n, KV_TILE, D + 1)
    qh = pad_dim(q.transpose(0, 1), 1, 0, tp - T)              # [H, Tp, D]
    qh = qh[:, None].expand(H, n, tp, D).reshape(H * n, tp, D)
    pos = torch.arange(base, j1 * KV_TILE).view(n, 1, KV_TILE)
    hidden = (pos < lo.view(1, T, 1)) | (pos >= hi.view(1, T, 1))
    if tp > T:                                                # padded rows see nothing
        hidden = pad_dim(hidden, 1, 0, tp - T, True)           # [n, Tp, TILE]
    if valid is not None:
        hidden = hidden | ~pad_dim(valid[a - start:b - start], 0, *rows).view(n, 1, KV_TILE)
    s = bmm_rows(qh, kt).view(H, n, tp, KV_TILE)
    p = _merge(carry, s, hidden, (1, 3), lambda m: m[:, None]).view(H * n, tp, KV_TILE)
    pv = bmm_rows(p, vt).view(H, n, tp, D + 1)
    acc = carry.acc
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
    tp = carry.m.shape[1]
    s = (q[:, None] * k).sum(-1).permute(2, 0, 1)                # [H, T, n], reduce over D only
    s = pad_dim(s, 1, 0, tp - T)
    hidden = pad_dim(~valid, 0, 0, tp - T, True)[None]
    p = _merge(carry, s, hidden, (2,))                           # [H, Tp, n]
    ve = pad_dim(pad_dim(v, 3, 0, 1, 1.0).permute(2, 0, 1, 3), 1, 0, tp - T)
    acc = carry.acc
    for j in range(n):                                           # fixed slot order
        acc = acc + p[:, :, j:j + 1] * ve[:, :, j]
    carry.acc = acc
    return carry


def finish(carry: Carry) -> torch.Tensor:
    """-> [n, H, D]; a query with no visible slot gets zeros."""
    acc = carry.acc[:, :carry.n]
    den = acc[..., -1:]
    return (acc[..., :-1] / torch.where(den > 0, den, 1.0)).transpose(0, 1).contiguous()


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
