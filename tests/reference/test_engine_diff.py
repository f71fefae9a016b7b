"""Reuse vs full recompute on generated workloads: bitwise equal, every decision and object."""
from __future__ import annotations

import torch

from kvcheck.engines.reference.diff import run_reference_diff
from kvcheck.reference.engine import Engine
from kvcheck.spec.config import Config
from kvcheck.spec.objects import DECISION_KINDS, OBJECT_KINDS

torch.set_num_threads(1)


def test_diff_scenarios_bitwise_equal(tmp_path) -> None:
    res = run_reference_diff(scenarios=40, seed=0, out_dir=tmp_path)
    assert res["exit_code"] == 0 and res["mismatches"] == [] and res["bitwise_equal"], res
    assert all(res["decisions"][k] > 0 for k in DECISION_KINDS), res["decisions"]
    assert all(res["objects_exercised"][k] > 0 for k in OBJECT_KINDS), res["objects_exercised"]
    assert 0 < res["usable_hit_rate"] <= res["logical_hit_rate"] <= 1
    assert res["comparisons"] > 20


def test_serve_reuse_equals_recompute_and_salt_isolates() -> None:
    cfg = Config(capacity={"compressed_kv": 20, "tail": 20, "swa_window": 40, "indexer": 20})
    eng = Engine(cfg)
    try:
        a = eng.serve(0, 4)
        assert a["decision"]["kind"] == "RECOMPUTE"
        b = eng.serve(1, 4, suffix=[7, 8, 9, 10])
        assert b["decision"]["kind"] == "REUSE" and b["start"] == 4 * cfg.block_size
        full = eng.recompute(eng.prefix + [7, 8, 9, 10])
        assert torch.equal(b["logits"], full[b["start"]:])
        c = eng.serve(0, 4, salt="tenant-b")                 # another tenant: no hit
        assert c["decision"]["logical"] == 0
        m = eng.metrics()
        assert m["usable_blocks"] == 4 and m["decisions"]["REUSE"] == 1
    finally:
        eng.close()


def test_mutant_engine_entry_point() -> None:
    from kvcheck.engines.reference.diff import mutant_engine
    clean = mutant_engine(Config(), None, 2.0, 0)
    assert clean["detected"] is False and clean["steps"] >= 1
    hit = mutant_engine(Config(), "engine_shared_free_list", 5.0, 0)
    assert hit["detected"] and "five_state_routing" in hit["caught_by"]
