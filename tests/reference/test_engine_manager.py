"""The manager's decisions on hand-built scenarios, each compared with the spec's."""
from __future__ import annotations

import torch

from kvcheck.engines.reference.sut import ReferenceSUT
from kvcheck.spec.config import Config
from kvcheck.spec.sut import SpecSUT

torch.set_num_threads(1)
ROOMY = Config(capacity={"compressed_kv": 20, "tail": 20, "swa_window": 40, "indexer": 20})


def lockstep(steps, cfg=None):
    cfg = cfg or ROOMY
    a, s = ReferenceSUT(), SpecSUT()
    a.reset(cfg)
    s.reset(cfg)
    decisions = []
    for act, p in steps:
        want, got = s.apply(act, dict(p)), a.apply(act, dict(p))
        assert want == got, (act, p, want, got)
        assert a.observe() == s.observe(), (act, p)
        assert a.differential_check(act, p) is None
        if act == "lookup":
            decisions.append(got["decision"])
    return a, decisions


def compute(r, n, evict_tails=False):
    out = [("submit", {"r": r, "n": n}), ("lookup", {"r": r}), ("bind", {"r": r}), ("use", {"r": r})]
    for j in range(n):
        out.append(("append", {"r": r, "j": j}))
        if j in (1, 3):
            out += [("compress", {"g": 1, "kind": "compressed_kv", "j": j}),
                    ("indexer_sync", {"g": 1, "kind": "indexer", "j": j})]
        if j == 3:
            out += [("compress", {"g": 2, "kind": "compressed_kv", "j": 3})]
        if evict_tails and j in (1, 2):      # the tail pool holds 4: drop tails not needed later
            out.append(("evict", {"g": 2, "kind": "tail", "j": j - 1}))
            if j == 2:
                out.append(("evict", {"g": 1, "kind": "tail", "j": 0}))
    return out + [("finish", {"r": r})]


def test_full_reuse_then_worked_example_partial() -> None:
    steps = compute(0, 4) + [("submit", {"r": 1, "n": 4}), ("lookup", {"r": 1})]
    a, d = lockstep(steps)
    assert d[-1] == {"kind": "REUSE", "k": 4, "logical": 4, "reasons": []}
    # docs/spec.md worked example: evict the swa page of block 2 -> PARTIAL(2), window_incomplete
    steps2 = compute(0, 4) + [("evict", {"g": 0, "kind": "swa_window", "j": 2}),
                              ("submit", {"r": 1, "n": 4}), ("lookup", {"r": 1}), ("bind", {"r": 1}),
                              ("use", {"r": 1}), ("append", {"r": 1, "j": 2}), ("append", {"r": 1, "j": 3}),
                              ("finish", {"r": 1})]
    a, d = lockstep(steps2)
    assert d[-1] == {"kind": "PARTIAL", "k": 2, "logical": 4, "reasons": ["window_incomplete"]}


def test_prefetch_then_restore_then_reuse_bitwise() -> None:
    steps = compute(0, 2) + [
        ("offload_start", {"j": 1}), ("offload_ack", {"j": 1}),
        ("evict", {"g": 0, "kind": "swa_window", "j": 1}),
        ("submit", {"r": 1, "n": 2}), ("lookup", {"r": 1}),                    # PREFETCH
        ("prefetch_start", {"j": 1}), ("lookup", {"r": 1}),                    # still PREFETCH
        ("prefetch_complete", {"j": 1}), ("verify_ok", {"j": 1, "aligned": 1}),
        ("lookup", {"r": 1}), ("bind", {"r": 1}), ("use", {"r": 1}), ("finish", {"r": 1})]
    a, d = lockstep(steps)
    assert [x["kind"] for x in d[-3:]] == ["PREFETCH", "PREFETCH", "REUSE"]
    assert "on_disk_not_ready" in d[-3]["reasons"]
    assert (a.engine.mgr.tiers.dir / f"{a.engine.prefix_hashes[1]}.kvblk").exists()


def test_corrupt_copy_is_quarantined_never_served() -> None:
    steps = compute(0, 2) + [
        ("offload_start", {"j": 1}), ("offload_ack", {"j": 1}), ("corrupt", {"j": 1}),
        ("evict", {"g": 0, "kind": "swa_window", "j": 1}),
        ("submit", {"r": 1, "n": 2}), ("lookup", {"r": 1}), ("preempt", {"r": 1}), ("resume", {"r": 1}),
        ("prefetch_start", {"j": 1}), ("prefetch_complete", {"j": 1}), ("checksum_fail", {"j": 1}),
        ("lookup", {"r": 1})]
    a, d = lockstep(steps)
    assert d[0]["kind"] != "PREFETCH"               # a damaged copy is no reason to wait
    assert "on_disk_not_ready" not in d[0]["reasons"]
    assert d[-1]["kind"] != "PREFETCH" and a.engine.mgr.tiers.quarantined


def test_version_bumps_degrade_with_reasons() -> None:
    for bump, reason in (("bump_model", "model_version"), ("bump_compressor", "model_version"),
                         ("bump_indexer", "indexer_version"), ("bump_abi", "abi_mismatch")):
        a, d = lockstep(compute(0, 4) + [(bump, {}), ("submit", {"r": 1, "n": 4}), ("lookup", {"r": 1})])
        assert d[-1]["kind"] in ("PARTIAL", "RECOMPUTE") and reason in d[-1]["reasons"], (bump, d[-1])


def test_differential_oracle_sees_a_flipped_device_page() -> None:
    a, d = lockstep(compute(0, 4) + [("submit", {"r": 1, "n": 4}), ("lookup", {"r": 1}), ("bind", {"r": 1})])
    o = a.engine.mgr.entry(a.engine.prefix_hashes[3], 3).objs[(3, "swa_window")]
    o.page.pool.data[o.page.slot, 5] += 1.0          # a silent bit flip in device memory
    a.apply("use", {"r": 1})
    assert "differ from a full recompute" in a.differential_check("use", {"r": 1})
