"""Physical pools: free lists, null page, addresses and alignment, layout encoding."""
from __future__ import annotations

import pytest
import torch

from kvcheck.reference.pools import ALIGN, NULL_SLOT, Pool, PoolError, PoolSet, encode_shift
from kvcheck.spec.objects import POOL

torch.set_num_threads(1)


def test_alloc_free_and_double_free() -> None:
    p = Pool("tail", capacity=2, page_numel=10, page_tokens=4)
    a, b = p.alloc(), p.alloc()
    assert a.slot != b.slot and NULL_SLOT not in (a.slot, b.slot)
    assert p.occupancy == 2 and p.pool_id == POOL["tail"]
    p.free(a)
    with pytest.raises(PoolError):
        p.free(a)
    with pytest.raises(PoolError):
        p.read_raw(a)                                 # use after free


def test_addresses_aligned_and_distinct_across_pools() -> None:
    ps = PoolSet({k: 2 for k in POOL}, {k: 30 for k in POOL}, {k: 4 for k in POOL})
    pages = [ps[k].alloc() for k in POOL]
    addrs = [pg.addr for pg in pages]
    assert len(set(addrs)) == len(addrs) and all(a % ALIGN == 0 for a in addrs)
    assert {pg.pool.pool_id for pg in pages} == set(POOL.values())   # one pool per kind


def test_roundtrip_and_version_encoding() -> None:
    p = Pool("compressed_kv", capacity=2, page_numel=16, page_tokens=4)
    pg = p.alloc()
    x = torch.arange(16, dtype=torch.float32)
    p.write(pg, x, encode_shift("compressed_kv", abi=0, cmp=0, ix=0))
    assert torch.equal(p.read(pg, encode_shift("compressed_kv", 0, 0, 0)), x)
    # read by the kernel of another compressor format or ABI: garbage
    assert not torch.equal(p.read(pg, encode_shift("compressed_kv", 0, 1, 0)), x)
    assert not torch.equal(p.read(pg, encode_shift("compressed_kv", 1, 0, 0)), x)


def test_misaligned_page_reads_shifted_but_dma_is_exact() -> None:
    p = Pool("swa_window", capacity=2, page_numel=16, page_tokens=4)
    pg = p.alloc(aligned=False)
    assert not pg.aligned and pg.addr % ALIGN != 0
    x = torch.arange(1, 17, dtype=torch.float32)
    p.write(pg, x, 0)
    assert torch.equal(p.read_raw(pg), x)                  # byte copy handles any alignment
    assert not torch.equal(p.read(pg, 0), x)               # the aligned vector load does not


def test_migration_moves_and_bumps_generation() -> None:
    p = Pool("indexer", capacity=2, page_numel=8, page_tokens=4)
    pg = p.alloc()
    x = torch.ones(8)
    p.write(pg, x, 0)
    slot, gen, addr = pg.slot, pg.gen, pg.addr
    p.move(pg)
    assert pg.slot != slot and pg.gen == gen + 1 and pg.addr != addr and pg.aligned
    assert torch.equal(p.read(pg, 0), x)


def test_null_page_is_never_allocated_and_reads_zero() -> None:
    p = Pool("tail", capacity=3, page_numel=4, page_tokens=4)
    slots = {p.alloc().slot for _ in range(3 + 2)}
    assert NULL_SLOT not in slots
    assert torch.count_nonzero(p.data[NULL_SLOT]) == 0
