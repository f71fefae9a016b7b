"""Physical page pools of the reference engine: one pool per cache-object type.

Owns device memory as the engine sees it: a paged float32 tensor per object type, a free list,
a null page (slot 0: what padded / out-of-window block-table entries point at), physical
addresses (byte offsets into the pool) with a hardware alignment, and a layout descriptor per
pool (dtype, row shape, strides, page size, kernel ABI version).

Encoding: a page's bytes depend on the ABI/layout version it was written under (and, for
compressed entries and indexer keys, on the compressor / indexer format version): the flat row
is rotated by a version-dependent shift. A page written under one version and read by the kernel
of another therefore reads garbage, exactly as a real layout or quantization change would. The
attention path reads with an aligned load (`addr & ~(ALIGN-1)`), so a page placed at a
misaligned address is read shifted; the DMA path (offload) copies bytes exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcheck.spec.objects import DEVICE_KINDS, POOL

from .kinds import manager_for

ALIGN = 256                    # bytes: hardware alignment a kernel's vector loads require
ELEM = 4                       # float32
SLACK = 16                     # floats of slack per slot: room for a misaligned (bounce) placement
MISALIGN = 4                   # floats: offset of a misaligned placement (16 bytes)
NULL_SLOT = 0


class PoolError(RuntimeError):
    """Out of pages, double free, or a page used after it was freed."""


def encode_shift(kind: str, abi: int, cmp: int, ix: int) -> int:
    """Rotation of a page's flat data for its layout (ABI) and format versions (per kind)."""
    return manager_for(kind).format_shift(abi, cmp, ix)


@dataclass(frozen=True)
class LayoutDesc:
    """What a kernel must agree with to read a pool's pages."""

    kind: str
    dtype: str
    page_numel: int             # floats of payload per page
    slot_numel: int             # floats per physical slot (payload + slack, padded to ALIGN)
    stride_bytes: int
    page_tokens: int
    abi: int

    def to_dict(self) -> dict:
        return {"kind": self.kind, "dtype": self.dtype, "page_numel": self.page_numel,
                "slot_numel": self.slot_numel, "stride_bytes": self.stride_bytes,
                "page_tokens": self.page_tokens, "abi": self.abi}


@dataclass(eq=False)
class Page:
    """A handle on one allocated physical slot. `gen` changes on every move or free so that a
    holder can re-validate the data pointer it bound."""

    pool: "Pool"
    slot: int
    offset: int = 0             # floats from the slot start (0 = aligned)
    numel: int = 0
    gen: int = 0
    freed: bool = False

    @property
    def addr(self) -> int:
        return self.pool.base + (self.slot * self.pool.layout.slot_numel + self.offset) * ELEM

    @property
    def aligned(self) -> bool:
        return self.addr % ALIGN == 0


class Pool:
    """One physical pool. `capacity` is the admission cap (pages that may be live at once);
    the backing tensor has extra slots for compaction (migration targets) and the null page."""

    _next_base = 1 << 20

    def __init__(self, kind: str, capacity: int, page_numel: int, page_tokens: int, abi: int = 0,
                 spare: int = 2, slots: int | None = None) -> None:
        self.kind = kind
        self.pool_id = POOL[kind]
        self.capacity = capacity
        slot = page_numel + SLACK
        slot = -(-slot * ELEM // ALIGN) * ALIGN // ELEM
        self.layout = LayoutDesc(kind, "float32", page_numel, slot, slot * ELEM, page_tokens, abi)
        self.n_slots = 1 + (capacity if slots is None else slots) + spare
        self.data = torch.zeros(self.n_slots, slot)
        self.base = Pool._next_base
        Pool._next_base += ((self.n_slots * slot * ELEM) // ALIGN + 16) * ALIGN
        self.free_slots = list(range(self.n_slots - 1, 0, -1))     # slot 0 is the null page
        self.live: dict[int, Page] = {}

    # ---- allocation -------------------------------------------------------------------
    @property
    def occupancy(self) -> int:
        return len(self.live)

    def set_abi(self, abi: int) -> None:
        self.layout = LayoutDesc(**{**self.layout.to_dict(), "abi": abi})

    def alloc(self, aligned: bool = True) -> Page:
        if not self.free_slots:
            raise PoolError(f"{self.kind} pool: no free slot")
        slot = self.free_slots.pop()
        p = Page(self, slot, 0 if aligned else MISALIGN)
        self.live[slot] = p
        return p

    def free(self, p: Page) -> None:
        if p.freed or self.live.get(p.slot) is not p:
            raise PoolError(f"{self.kind} pool: double free of slot {p.slot}")
        del self.live[p.slot]
        p.freed = True
        p.gen += 1
        self.data[p.slot].zero_()
        self.free_slots.append(p.slot)

    def move(self, p: Page) -> None:
        """Compaction: copy the page to another free slot (aligned), free the old one."""
        if not self.free_slots:
            raise PoolError(f"{self.kind} pool: no slot to migrate to")
        new = self.free_slots.pop(0)
        raw = self.read_raw(p)
        del self.live[p.slot]
        self.data[p.slot].zero_()
        self.free_slots.append(p.slot)
        p.slot, p.offset = new, 0
        p.gen += 1
        self.live[new] = p
        self.write_raw(p, raw)

    # ---- data -------------------------------------------------------------------------
    def write(self, p: Page, flat: torch.Tensor, shift: int) -> None:
        """Store a flat float32 row encoded for the writer's versions."""
        self.write_raw(p, torch.roll(flat.reshape(-1), shift) if flat.numel() else flat.reshape(-1))

    def write_raw(self, p: Page, raw: torch.Tensor) -> None:
        if p.freed:
            raise PoolError(f"{self.kind} pool: write after free (slot {p.slot})")
        n = raw.numel()
        if n > self.layout.page_numel:
            raise PoolError(f"{self.kind} pool: {n} floats do not fit a page of {self.layout.page_numel}")
        self.data[p.slot].zero_()
        self.data[p.slot, p.offset:p.offset + n] = raw
        p.numel = n

    def read_raw(self, p: Page) -> torch.Tensor:
        """DMA path: exact bytes at the page's address (handles any alignment)."""
        if p.freed:
            raise PoolError(f"{self.kind} pool: read after free (slot {p.slot})")
        return self.data[p.slot, p.offset:p.offset + p.numel].clone()

    def read(self, p: Page, shift: int) -> torch.Tensor:
        """Kernel path: an aligned vector load from `addr & ~(ALIGN-1)`, decoded for the
        *current* kernel's versions (shift)."""
        if p.freed:
            raise PoolError(f"{self.kind} pool: read after free (slot {p.slot})")
        raw = self.data[p.slot, 0:p.numel].clone()       # aligned-down load
        return torch.roll(raw, -shift) if raw.numel() else raw


POOL_KINDS = DEVICE_KINDS


class PoolSet:
    """The engine's device memory: one pool per object type (five-state routing by structure:
    a page of one type can only come from that type's pool)."""

    def __init__(self, capacity: dict[str, int], page_numel: dict[str, int],
                 page_tokens: dict[str, int], abi: int = 0, slots: int | None = None,
                 spare: int = 2) -> None:
        self.pools = {k: Pool(k, capacity[k], max(1, page_numel.get(k, 1)), page_tokens.get(k, 1), abi,
                              spare=spare, slots=slots) for k in POOL_KINDS}

    def __getitem__(self, kind: str) -> Pool:
        return self.pools[kind]

    def set_abi(self, abi: int) -> None:
        for p in self.pools.values():
            p.set_abi(abi)

    def layouts(self) -> dict[str, dict]:
        return {k: p.layout.to_dict() for k, p in self.pools.items()}
