"""Every copy is bound to its key and to the exact model: a valid copy of another block, or one
written by other weights into a shared directory, is CopyInvalid and degrades to recompute."""
from __future__ import annotations

import shutil

import pytest
import torch
from tier_engine import ROOMY, decision, evict, filled, other_weights, restore, served_equals_recompute

from kvcheck.reference.tiers import CopyInvalid, TierStore, unpack

torch.set_num_threads(1)
HDR = {"model_id": "m", "ver": 0, "ix": 0, "cmp": 0, "abi": 0}


def test_store_rejects_a_valid_copy_of_another_key_at_its_path(tmp_path) -> None:
    t = TierStore(tmp_path)
    t.offload("a" * 64, {**HDR, "block": 0}, b"A" * 64).result()
    t.offload("b" * 64, {**HDR, "block": 1}, b"B" * 64).result()
    shutil.copyfile(t.path("a" * 64), t.path("b" * 64))         # A's valid copy at B's path
    t.load("b" * 64)
    with pytest.raises(CopyInvalid, match="misplaced"):
        t.loaded("b" * 64)
    t.close()


def test_two_stores_with_other_identities_do_not_read_each_other(tmp_path) -> None:
    s1, s2 = TierStore(tmp_path), TierStore(tmp_path)
    s1.bind_identity(lambda: {"model_id": "m", "weights": "w1"})
    s2.bind_identity(lambda: {"model_id": "m", "weights": "w2"})
    s1.offload("k" * 64, HDR, b"one" * 10).result()
    s2.offload("k" * 64, HDR, b"two" * 10).result()             # same key, same path
    s1.load("k" * 64)
    with pytest.raises(CopyInvalid, match="foreign copy \\(weights differs\\)"):
        s1.loaded("k" * 64)
    s2.load("k" * 64)
    assert s2.loaded("k" * 64)
    s1.close()
    s2.close()


def test_engine_does_not_serve_block_0s_copy_as_block_2(tmp_path) -> None:
    """Blocks 0 and 2 carry the same object kinds, so block 0's copy would place cleanly."""
    eng = filled(ROOMY, tmp_path)
    try:
        t = eng.mgr.tiers
        shutil.copyfile(t.path(eng.prefix_hashes[0]), t.path(eng.prefix_hashes[2]))
        evict(eng, 2)
        assert restore(eng, 2) is False
        assert (tmp_path / f"{eng.prefix_hashes[2]}.quarantined").exists()
        res, equal = served_equals_recompute(eng)
        assert res["decision"]["kind"] == "PARTIAL" and res["decision"]["k"] == 2 and equal
    finally:
        eng.close()


def test_engines_with_other_weights_sharing_a_cache_dir(tmp_path) -> None:
    """Same architecture and tokens (so the same keys and paths), other weights: engine b's
    copy overwrote a's; a must not serve it (the model fingerprint covers the seed)."""
    a = filled(ROOMY, tmp_path)
    b = filled(other_weights(), tmp_path, prefix_seed=ROOMY.seed)
    try:
        assert a.prefix_hashes == b.prefix_hashes
        evict(a, 0)
        assert restore(a, 0) is False
        assert decision(a)["kind"] == "RECOMPUTE"
        res, equal = served_equals_recompute(a)
        assert res["start"] == 0 and equal
    finally:
        a.close()
        b.close()


def test_fault_key_unchecked_serves_the_misplaced_copy(tmp_path) -> None:
    """The planted fault: the same misplacement is verified, placed and reused, and the
    logits then differ from a full recompute."""
    eng = filled(ROOMY, tmp_path, fault="engine_disk_copy_key_unchecked")
    try:
        t = eng.mgr.tiers
        shutil.copyfile(t.path(eng.prefix_hashes[0]), t.path(eng.prefix_hashes[2]))
        evict(eng, 2)
        assert restore(eng, 2) is True
        res, equal = served_equals_recompute(eng)
        assert res["decision"]["kind"] == "REUSE" and not equal
    finally:
        eng.close()


def test_corrupt_misplace_mode_is_a_valid_copy_of_another_key(tmp_path) -> None:
    t = TierStore(tmp_path)
    t.offload("k" * 64, HDR, bytes(range(256))).result()
    t.corrupt("k" * 64, "misplace")
    header, payload = unpack(t.path("k" * 64).read_bytes())     # framing and checksum valid
    assert header["bind"]["key"] != "k" * 64 and payload != bytes(range(256))
    t.load("k" * 64)
    with pytest.raises(CopyInvalid, match="misplaced"):
        t.loaded("k" * 64)
    t.close()


def test_entry_of_recovered_block_is_bound_to_its_objects(tmp_path) -> None:
    """A copy whose block index matches but whose objects do not is misplaced too."""
    t = TierStore(tmp_path)
    objs = [{"g": 0, "kind": "tail", "offset": 0, "nbytes": 8, "ver": 0, "abi": 0}]
    t.offload("k" * 64, {**HDR, "block": 1, "objects": objs}, b"\0" * 8).result()
    t.expect("k" * 64, {"block": 1, "objects": [{**objs[0], "kind": "swa_window"}]})
    t.load("k" * 64)
    with pytest.raises(CopyInvalid, match="objects"):
        t.loaded("k" * 64)
    t.close()
