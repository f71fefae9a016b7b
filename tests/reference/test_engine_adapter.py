"""The reference engine as a system under test: lockstep conformance with the spec (a clean
campaign), and every engine fault caught by its expected check, with a reproducer that replays."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcheck.fuzz.campaign import Budget, run_campaign
from kvcheck.engines.reference.sut import ReferenceSUT
from kvcheck.engines.reference.diff import replay_reference, run_reference_diff
from kvcheck.reference.faults import ENGINE_FAULTS
from kvcheck.fuzz import faults as faultlib
from kvcheck.spec.config import Config
from kvcheck.spec.trace import Trace

torch.set_num_threads(1)


def test_clean_campaign_in_lockstep(tmp_path) -> None:
    res = run_campaign(Config(), "reference", Budget(steps=2500), seed=3, out=tmp_path)
    assert res["exit_code"] == 0, res["findings"]
    assert res["steps"] >= 2500


def test_faults_registered_and_declared() -> None:
    assert len(ENGINE_FAULTS) >= 16
    for f in ENGINE_FAULTS:
        assert faultlib.get(f.name).layer == "engine"
        assert ReferenceSUT.faults[f.name] == f.expected
    with pytest.raises(ValueError):
        ReferenceSUT(fault="no_such_fault")


# (the faults of a configurable semantic: tests/reference/test_engine_semantics.py, by both runners)
@pytest.mark.parametrize("fault", [f.name for f in ENGINE_FAULTS if not f.needs])
def test_each_engine_fault_caught_by_its_expected_check(fault, tmp_path) -> None:
    expected = faultlib.get(fault).expected
    res = run_reference_diff(scenarios=60, seed=0, fault=fault, out_dir=tmp_path, minimize_seconds=0.5)
    assert res["exit_code"] in (10, 11, 13), res
    m = res["mismatches"][0]
    assert expected in m["checks"], m
    again = replay_reference(Trace.load(m["trace"]))
    assert again["exit_code"] == res["exit_code"] and expected in again["checks"]
    assert m["replay"].startswith("kvcheck replay ") and m["replay"].endswith("--sut reference")
    assert Path(m["trace"]).exists()
