"""Host/disk tiers: durable writes, verified loads, quarantine of bad copies."""
from __future__ import annotations

import os
import stat

import pytest

from kvcheck.reference.tiers import (CopyInvalid, TierError, TierStore, check_header, durable_write,
                                     pack, unpack)

HDR = {"model_id": "m", "ver": 0, "ix": 0, "cmp": 0, "abi": 0}
CUR = {"ver": 0, "ix": 0, "cmp": 0, "abi": 0}


def test_roundtrip_real_file(tmp_path) -> None:
    t = TierStore(tmp_path, ("device", "host", "disk"))
    t.offload("k", HDR, b"payload" * 100).result()
    assert (tmp_path / "k.kvblk").exists()
    t.load("k")
    h, p = unpack(t.loaded("k"))
    check_header(h, "m", CUR)
    assert p == b"payload" * 100
    t.close()


@pytest.mark.parametrize("how", ["flip", "truncate", "tear"])
def test_damaged_copy_is_rejected_and_quarantined(tmp_path, how) -> None:
    t = TierStore(tmp_path)
    t.offload("k", HDR, bytes(range(256)) * 8).result()
    t.corrupt("k", how)
    t.load("k")
    with pytest.raises(CopyInvalid):
        unpack(t.loaded("k"))
    t.quarantine("k")
    assert not (tmp_path / "k.kvblk").exists() and (tmp_path / "k.quarantined").exists()
    t.close()


def test_foreign_and_stale_headers_rejected() -> None:
    h, _ = unpack(pack(HDR, b"x"))
    with pytest.raises(CopyInvalid, match="foreign"):
        check_header(h, "other-model", CUR)
    with pytest.raises(CopyInvalid, match="stale"):
        check_header(h, "m", {**CUR, "ver": 1})
    with pytest.raises(CopyInvalid, match="layout"):
        check_header(h, "m", {**CUR, "abi": 1})
    with pytest.raises(CopyInvalid, match="magic"):
        unpack(b"NOTKVCK!" + pack(HDR, b"x")[8:])


def test_crash_mid_write_keeps_previous_durable_copy(tmp_path) -> None:
    path = tmp_path / "k.kvblk"
    old = pack(HDR, b"old" * 50)
    durable_write(path, old)
    with pytest.raises(OSError, match="crash"):
        durable_write(path, pack(HDR, b"new" * 50), crash_after=40)
    assert path.read_bytes() == old
    assert unpack(path.read_bytes())[1] == b"old" * 50


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_cache_dir_is_a_clear_error(tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(TierError, match="not writable"):
            TierStore(ro / "cache")
    finally:
        ro.chmod(stat.S_IRWXU)


def test_cache_dir_under_a_file_is_a_clear_error(tmp_path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(TierError, match="not writable"):
        TierStore(f / "cache")


def test_engine_cache_dir_configurable(tmp_path) -> None:
    from kvcheck.engines.reference.sut import ReferenceSUT
    from kvcheck.spec.config import Config
    sut = ReferenceSUT(cache_dir=str(tmp_path / "c"))
    sut.reset(Config())
    assert sut.engine.mgr.tiers.dir == tmp_path / "c"
    sut.close()
