"""Triton kernels for the hybrid-attention ops: twins of the PyTorch ops (same signatures, same
`Carry` online-softmax state), batch-invariant by construction.

Invariance rule (all kernels): one program per query row (and head), fixed block shapes that never
depend on the batch (KV_TILE = 64 key slots per step, the head dim padded to a power of two), keys
visited in *absolute* tiles in ascending order, only the tiles the query itself can see. A row's
bits therefore depend only on its own inputs, never on how many rows share the launch, which
chunk it came in, or where its keys start in the buffer. Top-k is a selection by (score desc,
index asc) with exact comparisons only.

Where the reduction order equals the PyTorch twin's (compress's token loop, attend_gathered's
slot loop, topk) results match bitwise when the elementwise ops round alike (checked in
tests/kernels); attention over a slot range rescales per tile (online softmax, flash style)
instead of once per segment, and dot products are `tl.sum` instead of BLAS: equal within ~1e-6
relative, not bitwise.

Execution: on a CUDA machine the kernels are compiled; CPU tensors handed to them (the reference
model is CPU) are staged to the GPU and back. With TRITON_INTERPRET=1 (set before this module is
imported) they run in Triton's interpreter on CPU tensors: that is how CI tests them.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import abi
from .attention import KV_TILE, Carry, finish, new_carry  # noqa: F401  (re-exported twins)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
NEG_INF = float("-inf")


# ---- device staging ----------------------------------------------------------------------------
def _dev(t: torch.Tensor) -> torch.Tensor:
    """Where the kernel reads `t`: as is under the interpreter or if already on a GPU, else a copy
    on the current CUDA device (the CPU reference model driving GPU kernels)."""
    if INTERPRET or t.is_cuda:
        return t
    if not torch.cuda.is_available():
        raise RuntimeError("Triton kernels need a CUDA device, or TRITON_INTERPRET=1 set before "
                           "kvcheck.kernels.triton_ops is imported (kernels.backend does this "
                           "when no GPU is present)")
    return t.to("cuda", non_blocking=False)


def _dense(name: str, t: torch.Tensor, dtype: torch.dtype = abi.KERNEL_DTYPE) -> torch.Tensor:
    """A dense operand, normalised to a contiguous aligned buffer (a copy if it was a view), then
    checked (dtype is never converted silently: a wrong dtype raises AbiError)."""
    t = t.contiguous()
    if t.numel() and t.data_ptr() % abi.ALIGNMENT:
        t = t.clone()
    abi.check_operand(name, t, dtype=dtype)
    return t


def _p2(n: int) -> int:
    return max(1, triton.next_power_of_2(int(n)))


GPU_TILE_ELEMS = 8192     # on a GPU: HB * KV_TILE * padded head dim per program at most


def _heads(H: int, D: int) -> int:
    """Heads per program: a function of (H, D) only, never of the batch (invariance)."""
    if INTERPRET:
        return _p2(H)
    return max(1, min(_p2(H), GPU_TILE_ELEMS // (KV_TILE * _p2(D))))


# ---- kernels -----------------------------------------------------------------------------------
# The attention kernels run one program per (query row, block of HB heads): the head block only
# batches independent per-head reductions (HB = all heads under the interpreter, where per-op
# overhead dominates; HB * KV_TILE * head_dim bounded on a GPU). The online-softmax step is
# written inline in each kernel (a nested jit call costs ~10 ms per call in the interpreter).
@triton.jit
def _attend_range_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, lo_ptr, hi_ptr, m_ptr, acc_ptr,
                         start, S, Tp, H,
                         D: tl.constexpr, BD: tl.constexpr, HB: tl.constexpr,
                         TILE: tl.constexpr, HAS_VALID: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64) * HB + tl.arange(0, HB)
    d = tl.arange(0, BD)
    hd = (h[:, None] < H) & (d[None, :] < D)                              # [HB, BD]
    q = tl.load(q_ptr + (t * H + h[:, None]) * D + d[None, :], mask=hd, other=0.0)
    lo = tl.load(lo_ptr + t)
    hi = tl.load(hi_ptr + t)
    row = h * Tp + t                                                      # carry rows [HB]
    m = tl.load(m_ptr + row, mask=h < H, other=-1e30)
    acc = tl.load(acc_ptr + row[:, None] * (D + 1) + d[None, :], mask=hd, other=0.0)
    den = tl.load(acc_ptr + row * (D + 1) + D, mask=h < H, other=0.0)
    for j in range(lo // TILE, (hi + TILE - 1) // TILE):                  # ascending abs. tiles
        s_abs = j * TILE + tl.arange(0, TILE)
        vis = (s_abs >= lo) & (s_abs < hi) & (s_abs >= start) & (s_abs < start + S)
        r = s_abs - start
        if HAS_VALID:
            vis = vis & (tl.load(valid_ptr + r, mask=vis, other=0) != 0)
        off = (r[:, None, None] * H + h[None, :, None]) * D + d[None, None, :]
        km = vis[:, None, None] & hd[None, :, :]
        k = tl.load(k_ptr + off, mask=km, other=0.0)                      # [TILE, HB, BD]
        v = tl.load(v_ptr + off, mask=km, other=0.0)
        s = tl.where(vis[:, None], tl.sum(q[None, :, :] * k, axis=2), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))                          # [HB]
        alpha = tl.exp(m - m_new)
        p = tl.where(vis[:, None], tl.exp(s - m_new[None, :]), 0.0)      # masked: exact 0
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, axis=0)
        den = den * alpha + tl.sum(p, axis=0)
        m = m_new
    tl.store(m_ptr + row, m, mask=h < H)
    tl.store(acc_ptr + row[:, None] * (D + 1) + d[None, :], acc, mask=hd)
    tl.store(acc_ptr + row * (D + 1) + D, den, mask=h < H)


@triton.jit
def _paged_kernel(q_ptr, pos_ptr, k_ptr, v_ptr, bt_ptr, out_ptr, width, H, window, scale,
                  P: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, HB: tl.constexpr,
                  TILE: tl.constexpr, HAS_WINDOW: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64) * HB + tl.arange(0, HB)
    d = tl.arange(0, BD)
    hd = (h[:, None] < H) & (d[None, :] < D)
    q = tl.load(q_ptr + (t * H + h[:, None]) * D + d[None, :], mask=hd, other=0.0) * scale
    pos = tl.load(pos_ptr + t)
    hi = pos + 1
    if HAS_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    else:
        lo = pos * 0
    m = tl.full([HB], -1e30, tl.float32)     # attention.M0: a finite floor, no NaN guard needed
    acc = tl.zeros([HB, BD], dtype=tl.float32)
    den = tl.zeros([HB], dtype=tl.float32)
    for j in range(lo // TILE, (hi + TILE - 1) // TILE):
        s_abs = j * TILE + tl.arange(0, TILE)
        lp = s_abs // P                      # logical page
        inside = (s_abs >= lo) & (s_abs < hi) & (lp < width)
        page = tl.load(bt_ptr + lp, mask=inside, other=-1).to(tl.int64)
        vis = inside & (page >= 0)           # NULL_PAGE = -1 is masked
        slot = page * P + (s_abs - lp * P)
        off = (slot[:, None, None] * H + h[None, :, None]) * D + d[None, None, :]
        km = vis[:, None, None] & hd[None, :, :]
        k = tl.load(k_ptr + off, mask=km, other=0.0)
        v = tl.load(v_ptr + off, mask=km, other=0.0)
        s = tl.where(vis[:, None], tl.sum(q[None, :, :] * k, axis=2), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.where(vis[:, None], tl.exp(s - m_new[None, :]), 0.0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, axis=0)
        den = den * alpha + tl.sum(p, axis=0)
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + (t * H + h[:, None]) * D + d[None, :], out, mask=hd)


@triton.jit
def _gathered_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, sel_ptr, m_ptr, acc_ptr, n, Tp, H,
                     D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, HB: tl.constexpr,
                     GATHER: tl.constexpr):
    """GATHER=False: query t's own slots k[t, j] ([T, n, H, D]) where valid[t, j].
    GATHER=True: entries k[sel[t, j]] ([E, H, D]) where sel[t, j] >= 0 (sparse gather in-kernel).
    Max over all n slots first, then the weighted sum as a loop in slot order (the twin's order)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64) * HB + tl.arange(0, HB)
    d = tl.arange(0, BD)
    hd = (h[:, None] < H) & (d[None, :] < D)
    jn = tl.arange(0, BN)
    nm = jn < n
    q = tl.load(q_ptr + (t * H + h[:, None]) * D + d[None, :], mask=hd, other=0.0)
    if GATHER:
        e = tl.load(sel_ptr + t * n + jn, mask=nm, other=-1).to(tl.int64)
        vld = nm & (e >= 0)
        base = e * H
    else:
        vld = nm & (tl.load(valid_ptr + t * n + jn, mask=nm, other=0) != 0)
        base = (t * n + jn) * H
    off = (base[:, None, None] + h[None, :, None]) * D + d[None, None, :]
    kk = tl.load(k_ptr + off, mask=vld[:, None, None] & hd[None, :, :], other=0.0)
    s = tl.where(vld[:, None], tl.sum(q[None, :, :] * kk, axis=2), float("-inf"))   # [BN, HB]
    row = h * Tp + t
    m = tl.load(m_ptr + row, mask=h < H, other=-1e30)
    m_new = tl.maximum(m, tl.max(s, axis=0))
    alpha = tl.exp(m - m_new)
    acc = tl.load(acc_ptr + row[:, None] * (D + 1) + d[None, :], mask=hd, other=0.0)
    acc = acc * alpha[:, None]
    den = tl.load(acc_ptr + row * (D + 1) + D, mask=h < H, other=0.0) * alpha
    p = tl.where(vld[:, None], tl.exp(s - m_new[None, :]), 0.0)
    for j in range(0, n):                     # fixed slot order
        pj = tl.sum(tl.where(jn[:, None] == j, p, 0.0), axis=0)      # exact: one non-zero term
        if GATHER:
            ej = tl.load(sel_ptr + t * n + j).to(tl.int64)
            bj = tl.maximum(ej, 0) * H
            vm = hd & ((tl.zeros([HB, BD], tl.int64) + ej) >= 0)   # empty slot: no read
        else:
            bj = (t * n + j) * H
            vm = hd
        vj = tl.load(v_ptr + (bj + h[:, None]) * D + d[None, :], mask=vm, other=0.0)
        acc = acc + pj[:, None] * vj
        den = den + pj
    tl.store(m_ptr + row, m_new, mask=h < H)
    tl.store(acc_ptr + row[:, None] * (D + 1) + d[None, :], acc, mask=hd)
    tl.store(acc_ptr + row * (D + 1) + D, den, mask=h < H)


@triton.jit
def _compress_kernel(kv_ptr, gate_ptr, bias_ptr, out_ptr, m, C, BC: tl.constexpr):
    """entry[w, c] = sum_i softmax_i(gate + bias) * kv over the block's m tokens, in token order."""
    w = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    base = w * m * C
    mx = tl.load(gate_ptr + base + c, mask=cm, other=0.0) + tl.load(bias_ptr + c, mask=cm, other=0.0)
    for i in range(1, m):
        z = (tl.load(gate_ptr + base + i * C + c, mask=cm, other=0.0)
             + tl.load(bias_ptr + i * C + c, mask=cm, other=0.0))
        mx = tl.maximum(mx, z)
    z0 = tl.load(gate_ptr + base + c, mask=cm, other=0.0) + tl.load(bias_ptr + c, mask=cm, other=0.0)
    den = tl.exp(z0 - mx)
    num = den * tl.load(kv_ptr + base + c, mask=cm, other=0.0)
    for i in range(1, m):
        z = (tl.load(gate_ptr + base + i * C + c, mask=cm, other=0.0)
             + tl.load(bias_ptr + i * C + c, mask=cm, other=0.0))
        e = tl.exp(z - mx)
        den = den + e
        num = num + e * tl.load(kv_ptr + base + i * C + c, mask=cm, other=0.0)
    tl.store(out_ptr + w * C + c, num / den, mask=cm)


@triton.jit
def _index_kernel(q_ptr, w_ptr, k_ptr, lim_ptr, out_ptr, E,
                  HI: tl.constexpr, DI: tl.constexpr, BD: tl.constexpr, TILE: tl.constexpr):
    """score(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s]), heads in order; -inf at s >= limit."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    sm = s < E
    d = tl.arange(0, BD)
    dm = d < DI
    k = tl.load(k_ptr + s[:, None] * DI + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    q0 = tl.load(q_ptr + t * HI * DI + d, mask=dm, other=0.0)
    score = tl.load(w_ptr + t * HI) * tl.maximum(tl.sum(q0[None, :] * k, axis=1), 0.0)
    for h in tl.static_range(1, HI):
        qh = tl.load(q_ptr + (t * HI + h) * DI + d, mask=dm, other=0.0)
        score = score + tl.load(w_ptr + t * HI + h) * tl.maximum(tl.sum(qh[None, :] * k, axis=1), 0.0)
    lim = tl.load(lim_ptr + t)
    score = tl.where(s < lim, score, float("-inf"))
    tl.store(out_ptr + t * E + s, score, mask=sm)


@triton.jit
def _topk_kernel(s_ptr, out_ptr, E, K, BE: tl.constexpr):
    """k rounds of exact selection: the next element in (score desc, index asc) order after the
    previous pick; -inf never selected (-1)."""
    t = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BE)
    s = tl.load(s_ptr + t * E + idx, mask=idx < E, other=float("-inf"))
    prev_s = tl.max(tl.full([BE], float("inf"), tl.float32), axis=0)
    prev_i = tl.min(tl.full([BE], -1, tl.int32), axis=0)
    for r in range(0, K):
        cand = ((s < prev_s) | ((s == prev_s) & (idx > prev_i))) & (s > float("-inf"))
        best = tl.max(tl.where(cand, s, float("-inf")), axis=0)
        bi = tl.min(tl.where(cand & (s == best), idx, BE), axis=0)
        found = best > float("-inf")
        tl.store(out_ptr + t * K + r, tl.where(found, bi, -1).to(tl.int64))
        prev_s = tl.where(found, best, prev_s)
        prev_i = tl.where(found, bi, prev_i)
        # once nothing is found, cand stays empty: every later slot is -1


# ---- the ops (same signatures as the PyTorch twins) ----------------------------------------------
def attend_range(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                 lo: torch.Tensor, hi: torch.Tensor, carry: Carry,
                 valid: torch.Tensor | None = None,
                 span: tuple[int, int] | None = None) -> Carry:
    """Twin of attention.attend_range: query i attends to slots lo[i] <= s < hi[i]; k, v [S, H, D]
    hold slots [start, start + S); q [T, H, D] pre-scaled. Updates and returns `carry`."""
    T, H, D = q.shape
    S = k.shape[0]
    if S == 0 or T == 0:
        return carry
    lo_min, hi_max = span if span is not None else (int(lo.min()), int(hi.max()))
    if lo_min >= hi_max:
        return carry
    if lo_min < start or hi_max > start + S:
        raise ValueError(f"slot range [{lo_min}, {hi_max}) not within [{start}, {start + S})")
    qd, kd, vd = (_dev(_dense(n, x)) for n, x in (("q", q), ("k", k), ("v", v)))
    if kd.shape != (S, H, D) or vd.shape != (S, H, D):
        raise abi.AbiError(f"k/v must be [S, H, D] = [{S}, {H}, {D}], got {tuple(k.shape)}, "
                           f"{tuple(v.shape)}")
    lod, hid = (_dev(_dense(n, x.to(torch.int64), torch.int64)) for n, x in (("lo", lo), ("hi", hi)))
    vald = _dev(_dense("valid", valid.to(torch.int8), torch.int8)) if valid is not None else lod
    md, accd = _dev(_dense("carry.m", carry.m)), _dev(_dense("carry.acc", carry.acc))
    HB = _heads(H, D)
    _attend_range_kernel[(T, triton.cdiv(H, HB))](
        qd, kd, vd, vald, lod, hid, md, accd, start, S, carry.m.shape[1], H,
        D=D, BD=_p2(D), HB=HB, TILE=KV_TILE, HAS_VALID=valid is not None)
    carry.m, carry.acc = md.to(carry.m.device), accd.to(carry.acc.device)
    return carry


def _gathered(q, k, v, valid, sel, carry: Carry, n: int) -> Carry:
    T, H, D = q.shape
    if n == 0 or T == 0:
        return carry
    qd, kd, vd = (_dev(_dense(nm, x)) for nm, x in (("q", q), ("k", k), ("v", v)))
    if sel is not None:
        seld = _dev(_dense("sel", sel.to(torch.int64), torch.int64))
        vald = seld
    else:
        vald = _dev(_dense("valid", valid.to(torch.int8), torch.int8))
        seld = vald
    md, accd = _dev(_dense("carry.m", carry.m)), _dev(_dense("carry.acc", carry.acc))
    HB = _heads(H, D)
    _gathered_kernel[(T, triton.cdiv(H, HB))](qd, kd, vd, vald, seld, md, accd, n,
                                             carry.m.shape[1], H, D=D, BD=_p2(D), BN=_p2(n),
                                             HB=HB, GATHER=sel is not None)
    carry.m, carry.acc = md.to(carry.m.device), accd.to(carry.acc.device)
    return carry


def attend_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                    carry: Carry) -> Carry:
    """Twin of attention.attend_gathered: query i attends to its own n slots k[i, j], v[i, j]
    ([T, n, H, D]) where valid[i, j]."""
    T, n, H, D = k.shape
    return _gathered(q, k, v, valid, None, carry, n)


def attend_selected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel: torch.Tensor,
                    carry: Carry) -> Carry:
    """Sparse gather-attention: query i attends to entries k[sel[i, j]], v[sel[i, j]] (k, v
    [E, H, D]; sel [T, n], -1 = empty slot), gathered inside the kernel. Equals
    attend_gathered(q, k[sel], v[sel], sel >= 0, carry) (backend.attend_selected_torch)."""
    if k.shape[0] and sel.numel() and int(sel.max()) >= k.shape[0]:
        raise abi.AbiError(f"sel refers to entry {int(sel.max())} of {k.shape[0]}")
    return _gathered(q, k, v, None, sel, carry, sel.shape[1])


def paged_attention(q: torch.Tensor, q_pos: torch.Tensor, k_pages: torch.Tensor,
                    v_pages: torch.Tensor, block_table: torch.Tensor, window: int | None,
                    scale: float) -> torch.Tensor:
    """Twin of attention.paged_attention: causal (window=None) or sliding-window attention of
    q [T, H, D] at positions q_pos [T] over pools [num_pages, P, H, D] through block_table [n]
    (NULL_PAGE = -1 absent). Pool layouts, block table and alignment are ABI-checked."""
    T, H, D = q.shape
    abi.check_paged(q, k_pages, v_pages, block_table)
    P, width = k_pages.shape[1], block_table.shape[0]
    if T and int(q_pos.max()) >= width * P:
        raise ValueError(f"slot range [0, {int(q_pos.max()) + 1}) not within [0, {width * P})")
    out = torch.zeros(T, H, D, device=q.device)
    if T == 0:
        return out
    od = _dev(out)
    posd = _dev(_dense("q_pos", q_pos.to(torch.int64), torch.int64))
    HB = _heads(H, D)
    _paged_kernel[(T, triton.cdiv(H, HB))](
        _dev(q), posd, _dev(k_pages), _dev(v_pages), _dev(block_table), od, width, H,
        0 if window is None else int(window), float(scale),
        P=P, D=D, BD=_p2(D), HB=HB, TILE=KV_TILE, HAS_WINDOW=window is not None)
    return od.to(q.device)


def compress(kv: torch.Tensor, gate: torch.Tensor, pos_bias: torch.Tensor) -> torch.Tensor:
    """Twin of compression.compress: kv, gate [nb, m, C], pos_bias [m, C] -> entries [nb, C]."""
    nb, m, C = kv.shape
    if nb == 0:
        return kv.new_zeros(0, C)
    kvd, gd, bd = (_dev(_dense(n, x)) for n, x in (("kv", kv), ("gate", gate),
                                                     ("pos_bias", pos_bias)))
    if gd.shape != kvd.shape or bd.shape != (m, C):
        raise abi.AbiError(f"gate {tuple(gate.shape)} / pos_bias {tuple(pos_bias.shape)} do not "
                           f"match kv {tuple(kv.shape)}")
    out = torch.empty(nb, C, device=kvd.device)
    BC = min(_p2(C), 128)
    _compress_kernel[(nb, triton.cdiv(C, BC))](kvd, gd, bd, out, m, C, BC=BC)
    return out.to(kv.device)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                 limit: torch.Tensor) -> torch.Tensor:
    """Twin of indexer.index_scores: q [T, Hi, Di], w [T, Hi], keys [E, Di], limit [T] ->
    scores [T, E] (-inf at s >= limit)."""
    T, Hi, Di = q.shape
    E = keys.shape[0]
    if E == 0:
        return q.new_zeros(T, 0)
    out = torch.empty(T, E, device=_dev(keys).device)
    if T == 0:
        return out.to(q.device)
    qd, wd, kd = (_dev(_dense(n, x)) for n, x in (("q", q), ("w", w), ("keys", keys)))
    ld = _dev(_dense("limit", limit.to(torch.int64), torch.int64))
    _index_kernel[(T, triton.cdiv(E, KV_TILE))](qd, wd, kd, ld, out, E, HI=Hi, DI=Di,
                                                BD=_p2(Di), TILE=KV_TILE)
    return out.to(q.device)


def topk_desc(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Twin of topk.topk_desc: scores [T, E] -> indices [T, k] (int64) by (score desc, index
    asc), -1 where fewer than k candidates are finite. Scores must not be NaN."""
    T, E = scores.shape
    if E == 0 or T == 0 or k == 0:
        return torch.full((T, k), -1, dtype=torch.long, device=scores.device)
    sd = _dev(_dense("scores", scores))
    out = torch.empty(T, k, dtype=torch.long, device=sd.device)
    _topk_kernel[(T,)](sd, out, E, k, BE=_p2(E))
    return out.to(scores.device)
