"""The coverage floor (kvcheck/fuzz/floor.py): a clean campaign that left a declared action
untried is undecided (exit 3) in `kvcheck fuzz`, in the default gate's profiles and in a project
file's systems alike; and the machine's steering (Tally.steer) makes the gate's own budgets meet
it, so the floor costs no green run its pass."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvcheck.fuzz.floor import shortfall

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from badinput import run  # noqa: E402


def test_shortfall_names_what_is_missing_and_what_was_never_enabled() -> None:
    assert shortfall({"steps": 10, "examples": 1, "REUSE": 1}, [], []) is None
    assert shortfall({"steps": 0, "examples": 0}, [], []) == "0 steps ran; 0 examples ran"
    assert shortfall({"steps": 5, "REUSE": 0, "RECOMPUTE": 0}, [], []) == "no lookup decided"
    why = shortfall({"steps": 5, "REUSE": 1}, ["use_stale", "verify_ok"], ["verify_ok"], 5)
    assert why is not None and why.startswith("the SUT declares verify_ok, which the spec never enabled in 5 steps")
    assert why.endswith("; use_stale never exercised (a longer budget)")
    assert shortfall({"steps": 5}, ["x"]) == "x never exercised (a longer budget)"   # engines: steps only


@pytest.mark.parametrize("sut,steps", [("spec", 8000), ("reference", 3000)])
def test_the_gate_budgets_exercise_every_action(capsys, tmp_path, sut, steps) -> None:
    """The default gate's fuzz profiles (CiProfiles) at their budgets, on the gate's seed: every
    action the SUT declares is drawn (before the steering, 2,000-step campaigns missed verify_ok
    and use_stale on most seeds; seeds 0-9 measured in docs/adapters.md)."""
    from kvcheck.checker.gate_profiles import CiProfiles
    assert steps == {"spec": CiProfiles.fuzz_spec_steps, "reference": CiProfiles.fuzz_reference_steps}[sut]
    code, out, _ = run(capsys, "fuzz", "--sut", sut, "--budget", str(steps), "--seed", "0", "--json",
                       "--out", str(tmp_path))
    res = json.loads(out)
    assert code == 0 and res["coverage"]["actions_missing"] == [], res["coverage"]


def test_a_short_campaign_is_undecided_everywhere(capsys, tmp_path) -> None:
    """300 reference steps leave actions untried: `kvcheck fuzz` and a project gate both say
    undecided (exit 3) and name them; neither passes."""
    code, out, _ = run(capsys, "fuzz", "--sut", "reference", "--budget", "300", "--seed", "0", "--out", str(tmp_path))
    assert code == 3 and "undecided: " in out and "(a longer budget" in out, out
    proj = tmp_path / "kvcheck.toml"
    proj.write_text('[systems.reference]\nengines = ["fuzz"]\nbudgets = { fuzz = 300 }\n')
    code, out, _ = run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "o"), "--json")
    rep = json.loads(out)
    cov = next(c for c in rep["checks"] if c["engine"] == "fuzz" and c["check"] == "coverage")
    assert code == 3 and cov["verdict"] == "undecided" and "(a longer budget" in cov["note"], cov


def test_an_engine_driver_below_the_floor_says_what_it_left_untried(capsys, tmp_path) -> None:
    """vLLM's own driver (the same rule): 100 steps leave some actions untried: exit 3 with the
    line naming them, never a bare exit code."""
    pytest.importorskip("vllm")
    code, out, _ = run(capsys, "fuzz", "--sut", "vllm", "--layout", "full+swa", "--budget", "100", "--seed", "0",
                       "--out", str(tmp_path))
    assert code == 3 and "\n  undecided: " in out and "never exercised (a longer budget)" in out, out
