"""The backend switch: `get_ops("torch" | "triton")` returns one op table (`Ops`) with the same
names and signatures in both backends, so a caller (HybridLM(backend=...)) routes every op call
through it.

"torch": the batch-invariant PyTorch reference ops (bitwise reuse == recompute on CPU).
"triton": the Triton kernels (kernels/triton_ops.py) for the attention-side ops: attend_range,
attend_gathered, attend_selected, paged_attention, compress, index_scores, topk_desc. The dense
row ops (linear, bmm_rows, rms_norm, rope, silu) and the Carry helpers (new_carry, finish,
gather_pages) are shared with the torch backend. Without a GPU, the triton backend runs in
Triton's interpreter: if triton_ops has not been imported yet and CUDA is unavailable,
TRITON_INTERPRET=1 is set before importing it.

Caches computed by different backends are numerically different (another reduction order): the
table's `version` names the backend and tiling (HybridLM.versions["kernels"]).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable

from . import activation, attention, compression, indexer, norm, projection, topk

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class Ops:
    """One backend's op table (every field has the torch twin's signature)."""

    name: str
    version: str
    linear: Callable
    bmm_rows: Callable
    rms_norm: Callable
    rope: Callable
    silu: Callable
    new_carry: Callable
    finish: Callable
    gather_pages: Callable
    attend_range: Callable
    attend_gathered: Callable
    attend_selected: Callable
    paged_attention: Callable
    compress: Callable
    index_scores: Callable
    topk_desc: Callable


def attend_selected_torch(q, k, v, sel, carry):
    """Torch twin of triton_ops.attend_selected: entries k[sel[i, j]] (k, v [E, H, D]; -1 =
    empty slot) gathered, then attend_gathered."""
    T, n = sel.shape
    if k.shape[0] == 0:
        k, v = k.new_zeros(1, *k.shape[1:]), v.new_zeros(1, *v.shape[1:])
    idx = sel.clamp(min=0)
    return attention.attend_gathered(q, k[idx], v[idx], sel >= 0, carry)


_SHARED = dict(linear=projection.linear, bmm_rows=projection.bmm_rows, rms_norm=norm.rms_norm,
               rope=norm.rope, silu=activation.silu, new_carry=attention.new_carry,
               finish=attention.finish, gather_pages=attention.gather_pages)
# the GEMM rule (projection.py) is part of the reduction order: row2 (single GEMM, rows padded to
# 2) was the AVX2-only rule; row4/b2 (>= 2 matrices of a multiple of 4 rows) gives other bits
_TILING = f"kv{attention.KV_TILE}/row{projection.ROW_TILE}/b{projection.MIN_BATCH}"

TORCH = Ops(name="torch", version=f"torch-ref/{_TILING}", **_SHARED,
            attend_range=attention.attend_range, attend_gathered=attention.attend_gathered,
            attend_selected=attend_selected_torch, paged_attention=attention.paged_attention,
            compress=compression.compress, index_scores=indexer.index_scores,
            topk_desc=topk.topk_desc)

_TABLES: dict[str, Ops] = {"torch": TORCH}


def _triton() -> Ops:
    if "kvcheck.kernels.triton_ops" not in sys.modules and "TRITON_INTERPRET" not in os.environ:
        import torch
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"     # read by triton.jit at decoration time
    from . import abi, triton_ops as tr
    mode = "interp" if tr.INTERPRET else "cuda"
    # the interpreter (numpy) and a GPU round exp/sum differently: caches differ between them
    return Ops(name="triton", version=f"triton-abi{abi.ABI_VERSION}-{mode}/{_TILING}",
               **_SHARED, attend_range=tr.attend_range, attend_gathered=tr.attend_gathered,
               attend_selected=tr.attend_selected, paged_attention=tr.paged_attention,
               compress=tr.compress, index_scores=tr.index_scores, topk_desc=tr.topk_desc)


def get_ops(backend: str = "torch") -> Ops:
    """The op table of `backend` ("torch" or "triton")."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}: expected one of {BACKENDS}")
    if backend not in _TABLES:
        _TABLES[backend] = _triton()
    return _TABLES[backend]
