"""A Ctrl-C that Hypothesis turns into another exception is still an interruption, never a
finding: Hypothesis 6.170, interrupted inside its engine's setup, fails its own
`assert state._runner is not None` while handling the KeyboardInterrupt (CI saw a clean
`fuzz --ray` stopped by Ctrl-C report "the SUT raised AssertionError", exit 13). The same
exception without a Ctrl-C behind it stays a finding."""
from __future__ import annotations

from pathlib import Path

import pytest

import kvcheck.fuzz.campaign as campaign
from kvcheck.fuzz.campaign import Budget, run_campaign
from kvcheck.spec.config import Config


def _hypothesis_raising(interrupted: bool):
    def make(machine, settings=None):
        def test() -> None:
            if not interrupted:
                raise AssertionError("the SUT's own assert")
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                assert False, "state._runner is not None"     # what Hypothesis raises while unwinding
        return test
    return make


def test_an_exception_raised_while_a_ctrl_c_unwinds_is_the_interruption(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(campaign, "get_state_machine_test", _hypothesis_raising(True))
    res = run_campaign(Config(), "spec", Budget(seconds=30), 0, None, None, tmp_path)
    assert res["exit_code"] == 130 and res["interrupted"] and res["findings"] == []


def test_the_same_exception_without_a_ctrl_c_is_a_finding(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(campaign, "get_state_machine_test", _hypothesis_raising(False))
    res = run_campaign(Config(), "spec", Budget(seconds=30), 0, None, None, tmp_path)
    assert res["exit_code"] == 13 and not res["interrupted"]
    assert res["findings"][0]["checks"] == ["sut_raised"] and "AssertionError" in res["findings"][0]["message"]
