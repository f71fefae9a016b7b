"""Call-time contracts of the Triton kernels: a page pool's layout/ABI descriptor, the block table,
alignment and dtypes are checked before any launch; a mismatch raises `AbiError` (never a silent
misread: the kernels compute addresses from the layout they were written for, not from the
tensor's strides).

A page pool is a tensor [num_pages, page_size, n_heads, head_dim]. Its descriptor (`PoolLayout`)
is derived from the tensor (`describe`) and compared with what the kernel expects
(`kernel_layout`: float32, row-major contiguous strides, the query's head count and head dim,
ABI_VERSION). A pool manager may also *declare* the layout it wrote (`declare(pages, layout)`,
e.g. with a fixed block-table width); the declaration must then match as well. The block table is
1-D, int32/int64, contiguous, aligned, its width fixed (the declared `table_width`, if any) and
every entry NULL_PAGE (-1) or a page of the pool.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

ABI_VERSION = 1
ALIGNMENT = 16          # bytes: every pointer handed to a kernel (16 B = one 128-bit vector load)
NULL_PAGE = -1          # same value as attention.NULL_PAGE (a block-table hole)
KERNEL_DTYPE = torch.float32


class AbiError(ValueError):
    """A tensor handed to a kernel does not have the layout the kernel was written for."""


@dataclass(frozen=True)
class PoolLayout:
    """Layout/ABI descriptor of a KV page pool [num_pages, page_size, n_heads, head_dim].
    strides are in elements; table_width None = not fixed by this descriptor."""

    abi_version: int
    dtype: torch.dtype
    page_size: int
    n_heads: int
    head_dim: int
    strides: tuple[int, ...]
    alignment: int = ALIGNMENT
    table_width: int | None = None


def canonical_strides(page_size: int, n_heads: int, head_dim: int) -> tuple[int, ...]:
    return (page_size * n_heads * head_dim, n_heads * head_dim, head_dim, 1)


def kernel_layout(page_size: int, n_heads: int, head_dim: int,
                  table_width: int | None = None) -> PoolLayout:
    """What the paged kernel expects: float32, row-major contiguous, this ABI version."""
    return PoolLayout(ABI_VERSION, KERNEL_DTYPE, page_size, n_heads, head_dim,
                      canonical_strides(page_size, n_heads, head_dim), ALIGNMENT, table_width)


def describe(pages: torch.Tensor, table_width: int | None = None) -> PoolLayout:
    """The descriptor of a pool tensor as it actually is."""
    if pages.dim() != 4:
        raise AbiError(f"page pool must be 4-D [num_pages, page_size, n_heads, head_dim], "
                       f"got shape {tuple(pages.shape)}")
    _, P, H, D = pages.shape
    return PoolLayout(ABI_VERSION, pages.dtype, P, H, D, tuple(pages.stride()), ALIGNMENT,
                      table_width)


def declare(pages: torch.Tensor, layout: PoolLayout) -> torch.Tensor:
    """Attach the layout a pool manager claims for `pages` (checked at every kernel call)."""
    pages._kvcheck_abi = layout          # tensors accept Python attributes
    return pages


def declared(pages: torch.Tensor) -> PoolLayout | None:
    return getattr(pages, "_kvcheck_abi", None)


def _diff(a: PoolLayout, b: PoolLayout, skip: tuple[str, ...] = ()) -> list[str]:
    da, db = asdict(a), asdict(b)
    return [f"{k}: {da[k]!r} != expected {db[k]!r}" for k in da if k not in skip and da[k] != db[k]]


def check_aligned(name: str, t: torch.Tensor, alignment: int = ALIGNMENT) -> None:
    if t.numel() and t.data_ptr() % alignment:
        raise AbiError(f"{name}: address {t.data_ptr():#x} is not {alignment}-byte aligned "
                       f"(storage offset {t.storage_offset()} elements)")


def check_pool(name: str, pages: torch.Tensor, expected: PoolLayout) -> PoolLayout:
    """Actual and declared layout of a pool must both equal `expected`; returns the actual."""
    actual = describe(pages, expected.table_width)
    bad = _diff(actual, expected)
    dec = declared(pages)
    if dec is not None:
        bad += [f"declared {d}" for d in _diff(dec, expected, () if dec.table_width is not None
                                               else ("table_width",))]
    if bad:
        raise AbiError(f"{name}: layout mismatch: " + "; ".join(bad))
    check_aligned(name, pages, expected.alignment)
    return actual


def check_block_table(block_table: torch.Tensor, num_pages: int, width: int | None) -> None:
    if block_table.dim() != 1:
        raise AbiError(f"block_table must be 1-D, got shape {tuple(block_table.shape)}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise AbiError(f"block_table dtype {block_table.dtype}: expected int32 or int64")
    if not block_table.is_contiguous():
        raise AbiError("block_table must be contiguous")
    if width is not None and block_table.shape[0] != width:
        raise AbiError(f"block_table width {block_table.shape[0]} != fixed width {width} "
                       f"(pad with NULL_PAGE={NULL_PAGE})")
    check_aligned("block_table", block_table)
    if block_table.numel():
        lo, hi = int(block_table.min()), int(block_table.max())
        if lo < NULL_PAGE or hi >= num_pages:
            raise AbiError(f"block_table entries must be NULL_PAGE or in [0, {num_pages}), "
                           f"got range [{lo}, {hi}]")


def check_paged(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                block_table: torch.Tensor) -> PoolLayout:
    """All checks of a paged-attention call; returns the (common) pool layout."""
    check_operand("q", q, 3)
    if k_pages.dim() != 4:
        describe(k_pages)                                   # raises the shape error
    _, H, D = q.shape
    dec = declared(k_pages) or declared(v_pages)
    width = dec.table_width if dec is not None else None
    expected = kernel_layout(k_pages.shape[1], H, D, width)
    check_pool("k_pages", k_pages, expected)
    check_pool("v_pages", v_pages, replace(expected, page_size=k_pages.shape[1]))
    if v_pages.shape[0] != k_pages.shape[0]:
        raise AbiError(f"k_pages has {k_pages.shape[0]} pages, v_pages {v_pages.shape[0]}")
    check_block_table(block_table, k_pages.shape[0], width)
    return expected


def check_operand(name: str, t: torch.Tensor, dim: int | None = None,
                  dtype: torch.dtype = KERNEL_DTYPE) -> None:
    """A dense operand: dtype, rank, contiguity, alignment."""
    if t.dtype != dtype:
        raise AbiError(f"{name}: dtype {t.dtype}, kernel expects {dtype}")
    if dim is not None and t.dim() != dim:
        raise AbiError(f"{name}: expected {dim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise AbiError(f"{name}: must be contiguous (strides {tuple(t.stride())})")
    check_aligned(name, t)
