"""HybridLM(backend="triton"): prefill logits agree with the torch backend to 1e-5, and reuse
(snapshot/restore, then continue) equals recompute bitwise within the triton backend."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from kvcheck.kernels.backend import BACKENDS, get_ops  # noqa: E402
from kvcheck.reference.model import HybridLM  # noqa: E402

TOKENS = list(b"the hybrid cache, reused!")      # 25 tokens: csa m=8 and hca m=16 blocks complete


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models():
    ops = get_ops("triton")
    if ops.version.startswith("triton-abi") and "interp" not in ops.version \
            and not torch.cuda.is_available():
        pytest.skip("triton compiled mode without a GPU")
    return HybridLM(), HybridLM(backend="triton")


def test_backend_switch_surface():
    assert BACKENDS == ("torch", "triton")
    assert get_ops("torch").attend_range.__module__ == "kvcheck.kernels.attention"
    assert get_ops("triton").attend_range.__module__ == "kvcheck.kernels.triton_ops"
    with pytest.raises(ValueError, match="backend"):
        get_ops("cuda")
    with pytest.raises(ValueError, match="backend"):
        HybridLM(backend="numpy")


def test_versions_name_the_backend(models):
    ref, tri = models
    assert ref.versions["kernels"] == "torch-ref/kv64/row4/b2"       # the GEMM rule's reduction order
    assert tri.versions["kernels"].startswith("triton-abi1-")
    assert ref.fingerprint == tri.fingerprint                         # same weights and config


def test_prefill_logits_agree_with_torch(models):
    ref, tri = models
    a, sa = ref.prefill(TOKENS)
    b, sb = tri.prefill(TOKENS)
    err = float((a - b).abs().max())
    assert err <= 1e-5 * float(a.abs().max()), err
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    for name, t in sa.tensors().items():             # caches agree too (not bitwise)
        u = sb.tensors()[name]
        assert t.shape == u.shape
        if t.numel():
            assert float((t - u).abs().max()) <= 1e-5 * max(float(t.abs().max()), 1e-6), name


def test_reuse_equals_recompute_bitwise_in_triton(models):
    _, tri = models
    full, st_full = tri.prefill(TOKENS)
    cut = 17
    _, st = tri.prefill(TOKENS[:cut])
    snap = st.snapshot()
    resumed = tri.restore(snap)
    rest, st_rest = tri.prefill(TOKENS[cut:-2], resumed)              # chunked continuation
    assert torch.equal(rest, full[cut:-2])
    row, st_dec = tri.decode(TOKENS[-2], st_rest)                      # then token by token
    assert torch.equal(row, full[-2])
    row, st_dec = tri.decode(TOKENS[-1], st_dec)
    assert torch.equal(row, full[-1])
    for name, t in st_full.tensors().items():
        assert torch.equal(t, st_dec.tensors()[name]), name
