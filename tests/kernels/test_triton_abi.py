"""Call-time contracts (kvcheck/kernels/abi.py): a pool, block table or operand that does not have
the layout a kernel was written for raises AbiError before any launch, never a silent misread."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kvcheck.kernels import abi  # noqa: E402
from kvcheck.kernels import attention as A  # noqa: E402
from kvcheck.kernels import triton_ops as tr  # noqa: E402
from kvcheck.kernels.abi import AbiError  # noqa: E402

if not tr.INTERPRET and not torch.cuda.is_available():
    pytest.skip("triton_ops was imported without TRITON_INTERPRET and there is no GPU",
                allow_module_level=True)

N, P, H, D = 6, 4, 2, 16


def _setup():
    g = torch.Generator().manual_seed(0)
    kp, vp = torch.randn(N, P, H, D, generator=g), torch.randn(N, P, H, D, generator=g)
    q = torch.randn(3, H, D, generator=g)
    bt = torch.tensor([2, 0, 5, 1])
    return q, torch.tensor([9, 10, 11]), kp, vp, bt


def _call(q, pos, kp, vp, bt):
    return tr.paged_attention(q, pos, kp, vp, bt, None, 0.25)


def test_good_call_passes_and_matches_torch():
    args = _setup()
    out = _call(*args)
    ref = A.paged_attention(*args[:4], args[4], None, 0.25)
    assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_abi_error_is_a_value_error():
    assert issubclass(AbiError, ValueError)


def test_pool_dtype_mismatch():
    q, pos, kp, vp, bt = _setup()
    with pytest.raises(AbiError, match="dtype"):
        _call(q, pos, kp.double(), vp, bt)
    with pytest.raises(AbiError, match="dtype"):
        _call(q, pos, kp.half(), vp.half(), bt)


def test_pool_head_dim_and_heads_mismatch():
    q, pos, kp, vp, bt = _setup()
    with pytest.raises(AbiError, match="head_dim"):
        _call(q, pos, kp[..., :8].contiguous(), vp[..., :8].contiguous(), bt)
    with pytest.raises(AbiError, match="n_heads"):
        _call(q[:, :1].contiguous(), pos, kp, vp, bt)
    with pytest.raises(AbiError, match="4-D"):
        _call(q, pos, kp.reshape(N * P, H, D), vp, bt)


def test_pool_strides_mismatch():
    """Same shape, other memory order (e.g. a [N, P, D, H] pool viewed as [N, P, H, D])."""
    q, pos, kp, vp, bt = _setup()
    other = kp.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)
    assert other.shape == kp.shape and torch.equal(other, kp)
    with pytest.raises(AbiError, match="strides"):
        _call(q, pos, other, vp, bt)


def test_pool_misaligned():
    q, pos, kp, vp, bt = _setup()
    buf = torch.empty(kp.numel() + 1)
    mis = buf[1:].view(N, P, H, D)
    mis.copy_(kp)
    assert mis.is_contiguous() and mis.data_ptr() % abi.ALIGNMENT
    with pytest.raises(AbiError, match="aligned"):
        _call(q, pos, mis, vp, bt)


def test_k_v_pool_disagree():
    q, pos, kp, vp, bt = _setup()
    with pytest.raises(AbiError, match="pages"):
        _call(q, pos, kp, vp[:N - 1].contiguous(), bt)
    with pytest.raises(AbiError, match="page_size"):
        _call(q, pos, kp, vp[:, :2].contiguous(), bt)


def test_declared_layout_must_match():
    q, pos, kp, vp, bt = _setup()
    good = abi.kernel_layout(P, H, D, table_width=4)
    abi.declare(kp, good)
    abi.declare(vp, good)
    _call(q, pos, kp, vp, bt)                                   # declared and actual agree
    for bad in (dataclasses.replace(good, abi_version=abi.ABI_VERSION + 1),
                dataclasses.replace(good, page_size=8),
                dataclasses.replace(good, dtype=torch.bfloat16),
                dataclasses.replace(good, strides=(P * H * D, D, 1, H))):
        abi.declare(kp, bad)
        with pytest.raises(AbiError, match="declared"):
            _call(q, pos, kp, vp, bt)
    abi.declare(kp, good)
    # the block table width is fixed by the declaration (static-graph friendly): pad with -1
    with pytest.raises(AbiError, match="width"):
        _call(q, pos, kp, vp, bt[:3].clone())
    padded = torch.cat([bt, torch.full((2,), A.NULL_PAGE)])
    with pytest.raises(AbiError, match="width"):
        _call(q, pos, kp, vp, padded)
    wide = abi.kernel_layout(P, H, D, table_width=6)
    abi.declare(kp, wide)
    abi.declare(vp, wide)
    out = _call(q, pos, kp, vp, padded)
    assert torch.equal(out, _call(q, pos, kp.clone(), vp.clone(), bt))   # undeclared copies


def test_block_table_contract():
    q, pos, kp, vp, bt = _setup()
    with pytest.raises(AbiError, match="dtype"):
        _call(q, pos, kp, vp, bt.float())
    with pytest.raises(AbiError, match="1-D"):
        _call(q, pos, kp, vp, bt.view(2, 2))
    with pytest.raises(AbiError, match="range"):
        _call(q, pos, kp, vp, torch.tensor([2, 0, N, 1]))         # page N does not exist
    with pytest.raises(AbiError, match="range"):
        _call(q, pos, kp, vp, torch.tensor([2, -2, 5, 1]))
    with pytest.raises(AbiError, match="contiguous"):
        _call(q, pos, kp, vp, torch.tensor([2, 9, 0, 9, 5, 9, 1, 9])[::2])
    _call(q, pos, kp, vp, bt.int())                               # int32 is fine


def test_dense_operand_dtype_is_never_converted():
    q, k, v = torch.randn(2, H, D), torch.randn(5, H, D), torch.randn(5, H, D)
    lo, hi = torch.tensor([0, 0]), torch.tensor([4, 5])
    with pytest.raises(AbiError, match="dtype"):
        tr.attend_range(q.double(), k, v, 0, lo, hi, A.new_carry(H, 2, D))
    with pytest.raises(AbiError, match="dtype"):
        tr.compress(k[None, :, 0].double(), v[None, :, 0].double(), k[:, 0].double())
    with pytest.raises(AbiError):
        tr.attend_selected(q, k, v, torch.tensor([[0, 5], [1, -1]]), A.new_carry(H, 2, D))
