"""Hypothesis campaigns in lockstep: the spec and a user adapter conform; planted bugs are
found, shrunk and replayed; budgets, seeds and bad input behave."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcheck.checker.cli import main
from kvcheck.checker.replay import replay_trace, sut_by_name
from kvcheck.fuzz.campaign import Budget, run_campaign
from kvcheck.spec.config import Config
from kvcheck.spec.trace import Trace

ROOT = Path(__file__).resolve().parents[2]
TOY_CFG = Config.load(ROOT / "examples" / "toy.json")
TOY = "examples.toy_allocator:ToyAllocator"


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)            # MODULE:CLASS resolves from the working directory


def test_budget_parsing() -> None:
    assert Budget.parse("60s").seconds == 60 and Budget.parse("2m").seconds == 120
    assert Budget.parse("5000").steps == 5000
    with pytest.raises(ValueError):
        Budget.parse("soon")


def test_clean_spec_campaign_holds(tmp_path) -> None:
    res = run_campaign(Config(), "spec", Budget(steps=3000), seed=1, out=tmp_path)
    assert res["exit_code"] == 0 and res["findings"] == []
    assert res["steps"] >= 3000 and len(res["coverage"]["actions"]) >= 20


def test_spec_fault_is_found_with_expected_invariant_and_replays(tmp_path) -> None:
    res = run_campaign(Config(), "spec", Budget(seconds=120), seed=0, fault="shared_free_list", out=tmp_path,
                       steps_per_example=40)
    assert res["exit_code"] == 10
    f = res["findings"][0]
    assert "five_state_routing" in f["checks"]
    assert len(f["trace_steps"]) <= 12       # shrunk by Hypothesis, then by step deletion (unshrunk: ~200)
    code, out = replay_trace(Trace.load(f["trace"]))
    assert code == 10 and "five_state_routing" in out["violation"]["invariants"]


def test_user_adapter_conforms(tmp_path) -> None:
    res = run_campaign(TOY_CFG, TOY, Budget(steps=3000), seed=0, out=tmp_path)
    assert res["exit_code"] == 0, res["findings"]
    assert set(res["coverage"]["actions"]) >= {"lookup", "bind", "append", "evict", "finish"}
    assert res["coverage"]["decisions"]["REUSE"] > 0 and res["coverage"]["decisions"]["RECOMPUTE"] > 0


def test_user_adapter_bug_is_a_conformance_finding_that_replays(tmp_path) -> None:
    res = run_campaign(TOY_CFG, TOY, Budget(seconds=120), seed=0, fault="hash_only_hit", out=tmp_path)
    assert res["exit_code"] == 13
    f = res["findings"][0]
    assert f["checks"] == ["decision_matches_spec"] and f["trace_steps"][-1].startswith("lookup")
    trace = Trace.load(f["trace"])
    code, out = replay_trace(trace, sut_by_name(TOY, trace.meta["sut_fault"]))
    assert code == 13 and out["divergence"]["why"] == "SUT decision differs from the spec"
    code, _ = replay_trace(trace, sut_by_name(TOY, None))      # the fixed allocator passes
    assert code == 0
    proc = subprocess.run([sys.executable, f["reproducer"].split(" ", 1)[1]], capture_output=True, text=True)
    assert proc.returncode == 13


def test_cli_fuzz_json_and_bad_input(capsys, tmp_path) -> None:
    code = main(["fuzz", "--budget", "1500", "--seed", "3", "--out", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code in (0, 3) and out["steps"] >= 1500 and out["command"].startswith("kvcheck fuzz")
    for argv, msg in ((["fuzz", "--budget", "soon"], "budget must be"),
                      (["fuzz", "--sut", "nosuchmodule:X"], "cannot import"),
                      (["fuzz", "--sut", "reference2"], "unknown system under test"),
                      (["fuzz", "--sut", TOY, "--fault", "nope"], "unknown fault")):
        proc = subprocess.run([sys.executable, "-m", "kvcheck", *argv], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 2 and msg in proc.stderr and "Traceback" not in proc.stderr


def test_pytest_plugin_fixture(kvcheck_campaign) -> None:
    res = kvcheck_campaign(TOY, config=TOY_CFG, budget="800")
    assert res["steps"] >= 800
    kvcheck_campaign(TOY, config=TOY_CFG, budget="60s", fault="hash_only_hit", expect_exit=13)


def test_observability_jsonl(tmp_path, capsys) -> None:
    obs = tmp_path / "run.jsonl"
    code = main(["fuzz", "--budget", "800", "--seed", "1", "--out", str(tmp_path), "--json",
                 "--observability", str(obs)])
    res = json.loads(capsys.readouterr().out)
    assert code in (0, 3) and res["observability"] == str(obs)
    rows = [json.loads(line) for line in obs.read_text().splitlines()]
    cases = [r for r in rows if r["type"] == "test_case"]
    assert len(cases) >= 1
    assert {c["status"] for c in cases} <= {"passed", "failed", "gave_up"}
    assert any(k.startswith("target:") for c in cases for k in c["features"])
    assert main(["fuzz", "--budget", "10", "--observability", str(tmp_path)]) == 2   # a directory
    assert "is a directory" in capsys.readouterr().err
    assert main(["fuzz", "--budget", "10", "--observability", str(tmp_path / "no" / "o.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "no").exists()


def test_engine_fault_is_followed_to_its_expected_invariant(tmp_path) -> None:
    """The engine decides a hit the spec refuses (tail not checked): the machine follows the
    engine alone and reports the invariant the wrong hit breaks, not the divergence."""
    res = run_campaign(Config(), "reference", Budget(seconds=90), seed=0, fault="engine_tail_check_skipped",
                       out=tmp_path, shrink_seconds=20)
    f = res["findings"][0]
    assert res["exit_code"] == 10 and "hit_sound_tail" in f["checks"], f
    trace = Trace.load(f["trace"])
    code, out = replay_trace(trace, sut_by_name("reference", "engine_tail_check_skipped"))
    assert code == 10 and "hit_sound_tail" in out["violation"]["invariants"]
    assert "divergence" in out                      # the engine left the spec first
    code, _ = replay_trace(trace, sut_by_name("reference", None))
    assert code in (0, 13)                          # the clean engine breaks no invariant there


@pytest.mark.parametrize("fault, code, check", [
    ("engine_pinned_object_evicted", 10, "toctou_bound_stable"),   # needs a negative probe
    ("engine_cache_salt_missing", 13, "decision_matches_spec"),     # needs the isolation hook
])
def test_engine_faults_beyond_enabled_actions(tmp_path, fault, code, check) -> None:
    res = run_campaign(Config(), "reference", Budget(seconds=60), seed=0, fault=fault, out=tmp_path,
                       shrink_seconds=10)
    f = res["findings"][0]
    assert res["exit_code"] == code and check in f["checks"], f
    assert len(f["trace_steps"]) <= 12
    if code == 10:      # the probe step replays on the engine: it takes the forbidden action
        rcode, out = replay_trace(Trace.load(f["trace"]), sut_by_name("reference", fault))
        assert rcode == 10 and "forbids" in out["divergence"]["why"]


def test_shrinking_keeps_the_leading_check() -> None:
    """An unsound hit says most about a failure; a broken lease or a moved graph page next."""
    from kvcheck.fuzz.machine import lead
    assert lead(["hit_sound_tail", "toctou_bound_stable"]) == "hit_sound_tail"
    assert lead(["toctou_bound_stable", "hit_sound_on_disk", "hit_sound_swa_window"]) == "hit_sound_on_disk"
    assert lead(["graph_topology", "toctou_bound_stable"]) == "toctou_bound_stable"
    assert lead(["abstract_state_matches_spec"]) == "abstract_state_matches_spec"


def test_deep_spec_fault_found_and_shrunk_near_its_shortest(tmp_path) -> None:
    """A 12-13 step counterexample (a stale indexer reused after bump_indexer): found within the
    budget (the uniform byte draws and the version-bump mix make it common) and shrunk
    from a 200-step example to its neighbourhood (BMC: the shortest in the one-group fault
    config is 13 steps; the default config has a 12-step one). Shrinking is time-bounded, so the bound here is loose; the
    lengths themselves are benchmarked (benchmarks/fuzz.py)."""
    res = run_campaign(Config(), "spec", Budget(steps=60_000), seed=0, fault="decision_ignores_indexer_version",
                       out=tmp_path, shrink_seconds=20)
    f = res["findings"][0]
    assert res["exit_code"] == 10 and "hit_sound_indexer" in f["checks"], f
    assert "bump_indexer" in f["trace_steps"] and len(f["trace_steps"]) <= 20, f["trace_steps"]
    code, out = replay_trace(Trace.load(f["trace"]))
    assert code == 10 and "hit_sound_indexer" in out["violation"]["invariants"]


def test_weight_update_is_caught_by_the_differential_oracle(tmp_path) -> None:
    """Compressed entries kept across bump_model are current by their own version stamp, so
    the abstract state is the spec's: only reuse vs full recompute shows it. It needs a weight
    update after compression, common only in the version-bump mix."""
    fault = "engine_entries_kept_across_weight_update"
    res = run_campaign(Config(), "reference", Budget(steps=30_000), seed=0, fault=fault, out=tmp_path,
                       shrink_seconds=20)
    f = res["findings"][0]
    assert res["exit_code"] == 11 and f["checks"] == ["reuse_equals_recompute"], f
    steps = " ".join(f["trace_steps"])
    assert "bump_model" in f["trace_steps"] and ("compress(" in steps or "indexer_sync(" in steps), steps
    code, out = replay_trace(Trace.load(f["trace"]), sut_by_name("reference", fault))
    assert code == 11 and "differential" in out
    code, _ = replay_trace(Trace.load(f["trace"]), sut_by_name("reference", None))
    assert code == 0                                # the clean engine refreshes the entries


@pytest.mark.parametrize("seed", [0, 3])
def test_a_divergence_ends_at_the_diverging_step_or_is_what_it_broke(tmp_path, seed) -> None:
    """Loaded copies placed without their checksum: the engine's state leaves the spec's at
    checksum_fail. Followed alone, either it breaks nothing (the trace ends at checksum_fail,
    abstract_state_matches_spec) or, where the copy was corrupt, the reuse it serves differs from
    a recompute (reuse_equals_recompute: what the divergence broke is the finding)."""
    res = run_campaign(Config(), "reference", Budget(steps=20_000), seed=seed, fault="engine_load_before_checksum",
                       out=tmp_path, shrink_seconds=20)
    f = res["findings"][0]
    steps = f["trace_steps"]
    if res["exit_code"] == 13:
        assert f["checks"] == ["abstract_state_matches_spec"], f
        # (how short it gets depends on how far time-bounded shrinking went: lengths are benchmarked)
        assert steps[-1].startswith("checksum_fail("), steps
    else:
        assert res["exit_code"] == 11 and f["checks"] == ["reuse_equals_recompute"], f
        fail = next(i for i, s in enumerate(steps) if s.startswith("checksum_fail("))
        assert any(s.startswith("corrupt(") for s in steps[:fail]) and steps[-1].startswith("use("), steps
