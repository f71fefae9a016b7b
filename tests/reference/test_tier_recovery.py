"""Restart: a new store on an existing directory recovers its durable copies (a restarted engine
reuses them), quarantines what fails, removes dead writers' temp files, and counts all of it.
Also the tier's byte budget and the files' permissions."""
from __future__ import annotations

import os
import shutil
import stat

import pytest
import torch
from tier_engine import ROOMY, decision, filled, other_weights, restore, served_equals_recompute

from kvcheck.reference.engine import Engine
from kvcheck.reference.tiers import TierFull, TierStore, unpack

torch.set_num_threads(1)
HDR = {"model_id": "m", "ver": 0, "ix": 0, "cmp": 0, "abi": 0}


def key(i: int) -> str:
    return f"{i:064x}"


def test_restarted_engine_reuses_the_durable_copies(tmp_path) -> None:
    filled(ROOMY, tmp_path).close()
    eng = Engine(ROOMY, cache_dir=str(tmp_path), reuse_disk=True)
    try:
        assert eng.mgr.tiers.recovery == {"scanned": 4, "recovered": 4, "quarantined": 0, "tmp_removed": 0}
        assert decision(eng)["kind"] == "PREFETCH"
        assert all(restore(eng, j) for j in range(ROOMY.blocks))
        res, equal = served_equals_recompute(eng)
        assert res["decision"]["kind"] == "REUSE" and res["start"] == ROOMY.blocks * ROOMY.block_size
        assert equal
    finally:
        eng.close()


def test_restarted_engine_with_other_weights_recomputes(tmp_path) -> None:
    filled(ROOMY, tmp_path).close()
    eng = Engine(other_weights(), cache_dir=str(tmp_path), prefix_seed=ROOMY.seed, reuse_disk=True)
    try:
        assert eng.mgr.tiers.recovery["recovered"] == 4       # intact, kept: not ours to delete
        assert eng.adopt_recovered() == 0 and decision(eng)["kind"] == "RECOMPUTE"
        res, equal = served_equals_recompute(eng)
        assert res["start"] == 0 and equal
        assert len(list(tmp_path.glob("*.kvblk"))) == 4
    finally:
        eng.close()


def test_new_store_on_the_directory_loads_the_durable_copies(tmp_path) -> None:
    t = TierStore(tmp_path)
    t.offload(key(0), {**HDR, "block": 0}, b"zero" * 50).result()
    t.close()
    t2 = TierStore(tmp_path)
    t2.load(key(0))
    assert unpack(t2.loaded(key(0)))[1] == b"zero" * 50
    t2.close()


def test_durable_copies_lists_this_identitys_copies_written_or_recovered(tmp_path) -> None:
    t = TierStore(tmp_path)
    t.bind_identity(lambda: {"weights": "w1"})
    t.offload(key(0), HDR, b"a").result()
    assert list(t.durable_copies()) == [key(0)]
    t.close()
    t2 = TierStore(tmp_path)
    t2.bind_identity(lambda: {"weights": "w1"})
    t2.offload(key(1), HDR, b"b").result()
    assert sorted(t2.durable_copies()) == [key(0), key(1)]
    t2.bind_identity(lambda: {"weights": "w2"})
    assert t2.durable_copies() == {}
    t2.close()


def test_recovery_counts_and_quarantine(tmp_path) -> None:
    t = TierStore(tmp_path)
    for i in range(4):
        t.offload(key(i), HDR, bytes([i]) * 100).result()
    t.close()
    blob = bytearray(t.path(key(1)).read_bytes())
    blob[50] ^= 1
    t.path(key(1)).write_bytes(bytes(blob))                      # bit flip
    shutil.copyfile(t.path(key(2)), t.path(key(9)))               # misplaced: bound to key 2
    t.path(key(3)).write_bytes(t.path(key(3)).read_bytes()[:30])  # torn
    (tmp_path / ".tmp-abc.kvblk").write_bytes(b"x" * 10)          # the old code's temp name
    (tmp_path / f".tmp-{2**22 + 12345}-beef-{key(5)}.kvblk").write_bytes(b"x")  # a dead writer
    live = tmp_path / f".tmp-{os.getppid()}-beef-{key(6)}.kvblk"  # a live writer's: kept
    live.write_bytes(b"x")
    t2 = TierStore(tmp_path)
    assert t2.recovery == {"scanned": 5, "recovered": 2, "quarantined": 3, "tmp_removed": 2}
    assert sorted(t2.index) == [key(0), key(2)]
    assert live.exists() and not (tmp_path / ".tmp-abc.kvblk").exists()
    assert {p.name for p in tmp_path.glob("*.quarantined")} == {f"{key(i)}.quarantined" for i in (1, 3, 9)}
    assert "misplaced" in t2.recovery_reasons[f"{key(9)}.quarantined"]
    t2.expect(key(0), HDR)
    t2.load(key(0))
    assert t2.loaded(key(0))                                     # a recovered copy loads
    t2.close()


def test_recovery_is_idempotent(tmp_path) -> None:
    t = TierStore(tmp_path)
    t.offload(key(0), HDR, b"x" * 10).result()
    t.close()
    (tmp_path / f"{key(1)}.kvblk").write_bytes(b"garbage")
    a, b = TierStore(tmp_path), TierStore(tmp_path)
    assert a.recovery["quarantined"] == 1 and b.recovery == {"scanned": 1, "recovered": 1,
                                                             "quarantined": 0, "tmp_removed": 0}
    a.close()
    b.close()


def test_byte_budget_evicts_oldest_and_refuses_what_cannot_fit(tmp_path) -> None:
    t = TierStore(tmp_path)
    t.offload(key(0), HDR, b"\0" * 1000).result()
    size = t.used_bytes()
    t.close()
    cap = 3 * size + size // 2
    t = TierStore(tmp_path, max_bytes=cap)
    for i in range(1, 7):
        t.offload(key(i), HDR, bytes([i]) * 1000).result()
        assert t.used_bytes() <= cap
        assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= cap
    assert sorted(t.index) == [key(4), key(5), key(6)]            # the oldest went first
    assert t.evicted == [key(0), key(1), key(2), key(3)]
    big = t.offload(key(7), HDR, b"\0" * cap)
    with pytest.raises(TierFull):
        big.result()
    assert not t.path(key(7)).exists() and not list(tmp_path.glob(".tmp-*"))
    t.load(key(1))
    with pytest.raises(FileNotFoundError):                        # an evicted copy is missing
        t.loaded(key(1))
    t.close()
    # over budget at start (the budget shrank): the oldest are evicted by the scan
    t = TierStore(tmp_path, max_bytes=size)
    assert sorted(t.index) == [key(6)] and t.used_bytes() <= size
    t.close()


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_copies_honour_the_umask(tmp_path, mask, mode) -> None:
    old = os.umask(mask)
    try:
        t = TierStore(tmp_path)
        t.offload(key(0), HDR, b"x").result()
        assert stat.S_IMODE(t.path(key(0)).stat().st_mode) == mode
        t.close()
    finally:
        os.umask(old)
