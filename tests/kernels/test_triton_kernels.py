"""Triton kernels vs their PyTorch twins (interpreter mode on CPU; see conftest.py), and their
batch invariance. Bitwise where the result is decided by exact comparisons (topk) or the same
kernel computes both sides; within 1e-5 relative (of the output's max magnitude) where the
reduction order or the elementwise exp differs from torch's (numpy's float32 exp and torch's
differ in the last bit for ~40% of inputs, so no exp-based kernel can be bitwise in the
interpreter)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import Phase, given, settings, strategies as st  # noqa: E402

from kvcheck.kernels import attention as A  # noqa: E402
from kvcheck.kernels import compression, indexer, topk  # noqa: E402
from kvcheck.kernels import triton_ops as tr  # noqa: E402

if not tr.INTERPRET and not torch.cuda.is_available():
    pytest.skip("triton_ops was imported without TRITON_INTERPRET and there is no GPU",
                allow_module_level=True)

# no shrinking: under the interpreter a shrink campaign takes minutes; the failing example prints
FEW = settings(max_examples=8, deadline=None,
               phases=[Phase.explicit, Phase.reuse, Phase.generate])
RTOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """|a - b| <= RTOL * max|b| everywhere (infinities must coincide)."""
    assert a.shape == b.shape
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a)) and torch.equal(a[~fin], b[~fin])
    scale = float(b[fin].abs().max()) if fin.any() else 0.0
    err = float((a[fin] - b[fin]).abs().max()) if fin.any() else 0.0
    assert err <= RTOL * max(scale, 1e-30), (err, scale)


def _range(mod, q, k, v, start, lo, hi, valid=None):
    T, H, D = q.shape
    c = A.new_carry(H, T, D)
    mod.attend_range(q, k, v, start, lo, hi, c, valid)
    return A.finish(c)


# ---- paged / range attention --------------------------------------------------------------------
@FEW
@given(S=st.integers(1, 150), T=st.integers(1, 6), seed=st.integers(0, 2**16),
       window=st.sampled_from([None, 5, 64]), H=st.sampled_from([1, 3, 4]))
def test_attend_range_matches_torch_and_is_row_invariant(S, T, seed, window, H):
    D = 16
    T = min(T, S)
    q, k, v = _rand(seed, T, H, D), _rand(seed + 1, S, H, D), _rand(seed + 2, S, H, D)
    pos = torch.arange(S - T, S)
    hi = pos + 1
    lo = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp(min=0)
    valid = torch.rand(S, generator=torch.Generator().manual_seed(seed)) > 0.2
    for vd in (None, valid):
        out = _range(tr, q, k, v, 0, lo, hi, vd)
        _close(out, _range(A, q, k, v, 0, lo, hi, vd))
        for i in sorted({0, T - 1}):          # alone, with the keys cut to start at its lo
            a = int(lo[i])
            alone = _range(tr, q[i:i + 1], k[a:], v[a:], a, lo[i:i + 1], hi[i:i + 1],
                           None if vd is None else vd[a:])
            assert torch.equal(alone[0], out[i])


@FEW
@given(L=st.integers(1, 140), P=st.sampled_from([1, 4, 16, 64]), seed=st.integers(0, 2**16),
       window=st.sampled_from([None, 7, 70]))
def test_paged_attention_matches_torch_any_page_size(L, P, seed, window):
    H, D, T = 2, 16, min(L, 3)
    n = -(-L // P)
    k, v, q = _rand(seed, n * P, H, D), _rand(seed + 1, n * P, H, D), _rand(seed + 2, T, H, D)
    perm = torch.randperm(n + 3, generator=torch.Generator().manual_seed(seed))
    kp, vp = torch.zeros(n + 3, P, H, D), torch.zeros(n + 3, P, H, D)
    kp[perm[:n]], vp[perm[:n]] = k.view(n, P, H, D), v.view(n, P, H, D)
    bt = perm[:n].clone()
    q_pos = torch.arange(L - T, L)
    if window is not None:                    # pages wholly outside every window: null
        first = max(0, L - T - window + 1) // P
        bt[:first] = A.NULL_PAGE
    out = tr.paged_attention(q, q_pos, kp, vp, bt, window, 0.25)
    _close(out, A.paged_attention(q, q_pos, kp, vp, bt, window, 0.25))
    # the page size only changes addressing: bitwise equal to the contiguous triton kernel
    lo = torch.zeros_like(q_pos) if window is None else (q_pos - window + 1).clamp(min=0)
    assert torch.equal(out, _range(tr, q * 0.25, k, v, 0, lo, q_pos + 1))


# ---- compressed entries + SWA branch, gathered / selected entries -------------------------------
@FEW
@given(T=st.integers(1, 5), E=st.integers(0, 20), n=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_swa_plus_selected_entries_match_torch(T, E, n, seed):
    """One softmax over the raw SWA branch then the top-k selected compressed entries."""
    H, D, S = 2, 16, 40
    q, k, v = _rand(seed, T, H, D), _rand(seed + 1, S, H, D), _rand(seed + 2, S, H, D)
    ek, ev = _rand(seed + 3, max(E, 1), H, D)[:E], _rand(seed + 4, max(E, 1), H, D)[:E]
    g = torch.Generator().manual_seed(seed)
    sel = torch.randint(-1, max(E, 1), (T, n), generator=g) if E else torch.full((T, n), -1)
    sel = torch.sort(sel, dim=1).values
    pos = torch.arange(S - T, S)
    lo, hi = (pos - 6 + 1).clamp(min=0), pos + 1

    def run(mod, gathered: bool):
        c = A.new_carry(H, T, D)
        mod.attend_range(q, k, v, 0, lo, hi, c)
        if gathered:
            src_k = ek if E else torch.zeros(1, H, D)
            src_v = ev if E else torch.zeros(1, H, D)
            mod.attend_gathered(q, src_k[sel.clamp(min=0)], src_v[sel.clamp(min=0)], sel >= 0, c)
        else:
            mod.attend_selected(q, ek, ev, sel, c)
        return A.finish(c)

    out = run(tr, True)
    _close(out, run(A, True))
    assert torch.equal(run(tr, False), out)          # in-kernel gather == pre-gathered, bitwise
    i = T - 1                                        # row alone == row in the batch
    c = A.new_carry(H, 1, D)
    tr.attend_range(q[i:i + 1], k, v, 0, lo[i:i + 1], hi[i:i + 1], c)
    tr.attend_selected(q[i:i + 1], ek, ev, sel[i:i + 1], c)
    assert torch.equal(A.finish(c)[0], out[i])


@FEW
@given(T=st.integers(1, 5), E=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_compressed_entries_range_matches_torch(T, E, seed):
    """HCA: entries w < limit[t] in the same carry as the SWA branch (model's call pattern)."""
    H, D = 4, 16
    q, ek, ev = _rand(seed, T, H, D), _rand(seed + 1, E, H, D), _rand(seed + 2, E, H, D)
    limit = torch.randint(0, E + 1, (T,), generator=torch.Generator().manual_seed(seed))
    zero = torch.zeros_like(limit)
    _close(_range(tr, q, ek, ev, 0, zero, limit), _range(A, q, ek, ev, 0, zero, limit))


@FEW
@given(nb=st.integers(1, 6), m=st.sampled_from([1, 4, 8, 16]), C=st.sampled_from([16, 128, 130]),
       seed=st.integers(0, 2**16))
def test_compress_matches_torch_and_is_block_invariant(nb, m, C, seed):
    kv, gate, bias = _rand(seed, nb, m, C), _rand(seed + 1, nb, m, C), _rand(seed + 2, m, C)
    out = tr.compress(kv, gate, bias)
    _close(out, compression.compress(kv, gate, bias))
    for w in sorted({0, nb - 1}):
        assert torch.equal(tr.compress(kv[w:w + 1], gate[w:w + 1], bias)[0], out[w])


# ---- indexer and top-k --------------------------------------------------------------------------
@FEW
@given(T=st.integers(1, 6), E=st.integers(1, 150), seed=st.integers(0, 2**16),
       Hi=st.sampled_from([1, 4]))
def test_index_scores_match_torch_and_are_invariant(T, E, seed, Hi):
    Di = 16
    q, w, keys = _rand(seed, T, Hi, Di), _rand(seed + 1, T, Hi), _rand(seed + 2, E + 10, Di)
    limit = torch.randint(0, E + 1, (T,), generator=torch.Generator().manual_seed(seed))
    out = tr.index_scores(q, w, keys[:E], limit)
    _close(out, indexer.index_scores(q, w, keys[:E], limit))
    wider = tr.index_scores(q, w, keys, limit)       # more keys (a later step): same columns
    assert torch.equal(wider[:, :E], out)
    i = T - 1
    assert torch.equal(tr.index_scores(q[i:i + 1], w[i:i + 1], keys[:E], limit[i:i + 1])[0],
                       out[i])


def test_topk_ties_and_inf_bitwise():
    s = torch.tensor([[1.0, 3.0, 3.0, float("-inf"), 2.0, 3.0],
                      [float("-inf")] * 6,
                      [0.0, -0.0, 0.0, 5.0, float("inf"), 5.0]])
    for k in (1, 3, 6, 8):
        assert torch.equal(tr.topk_desc(s, k), topk.topk_desc(s, k))
    assert tr.topk_desc(s, 3)[0].tolist() == [1, 2, 5]
    assert tr.topk_desc(torch.zeros(2, 0), 3).tolist() == [[-1] * 3] * 2


@FEW
@given(T=st.integers(1, 5), E=st.integers(1, 80), extra=st.integers(0, 40), k=st.integers(1, 12),
       seed=st.integers(0, 2**16))
def test_topk_matches_torch_bitwise_and_is_invariant(T, E, extra, k, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 5, (T, E), generator=g).float()           # many ties
    s[torch.rand(T, E, generator=g) < 0.2] = float("-inf")
    out = tr.topk_desc(s, k)
    assert torch.equal(out, topk.topk_desc(s, k))
    padded = torch.cat([s, torch.full((T, extra), float("-inf"))], dim=1)
    assert torch.equal(tr.topk_desc(padded, k), out)
    assert torch.equal(tr.topk_desc(s[T - 1:], k)[0], out[T - 1])
