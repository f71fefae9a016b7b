"""kvcheck issue 35 ("your own engine"): a sequence-level manager (tests/adapters/seqcache.py) on
the hash-chain base class. Each planted bug is reported with its expected check as the LEADING
finding; the fixed manager is clean without a cache salt; a finding's trace replays clean on the
fix and reproduces the same check on the bug; the most serious finding leads everywhere."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvcheck.engines.hashchain.base import REACH
from kvcheck.fuzz.campaign import Budget, run_campaign
from kvcheck.fuzz.guard import GuardedLockstep, ValuedSpecModel
from kvcheck.fuzz.lockstep import Finding
from kvcheck.fuzz.traces import replay, to_trace
from kvcheck.spec.config import Config, ConfigError
from kvcheck.spec.severity import lead, rank
from kvcheck.spec.system import Spec

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from seqcache import BUGS, SeqAdapter  # noqa: E402

SUT = "seqcache:SeqAdapter"
# no cache salt; allocations evict by LRU (no evict callback: eviction is observed, not requested)
CFG = Config.from_dict({"layers": [{"kind": "full"}], "blocks": 3, "requests": 2, "tiers": ["device"],
                        "capacity": {"swa_window": 2}, "salt": False, "alloc": "evict",
                        "eviction": "drop_hash"})


@pytest.fixture(autouse=True)
def _path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))        # MODULE:CLASS resolves seqcache


def _campaign(tmp_path, fault=None, cfg=CFG, steps=4000):
    return run_campaign(cfg, SUT, Budget(steps=steps), seed=0, fault=fault, out=tmp_path, shrink_seconds=6)


def test_severity_one_order() -> None:
    safety = Finding("safety", ["hit_sound_content"], "unsafe hit")
    toctou = Finding("invariant", ["toctou_bound_stable"], "a bound block evicted")
    diverged = Finding("conformance", ["decision_matches_spec"], "k differs")
    toctou.trail = []
    safety.trail = [("submit", {})] * 30          # longer, yet it leads
    assert min([toctou, diverged, safety], key=Finding.rank) is safety
    assert min([diverged, toctou], key=Finding.rank) is toctou
    # an unsafe hit leads whichever kind of check raised it
    assert rank("invariant", ["hit_sound_swa_window"]) < rank("invariant", ["toctou_bound_stable"])
    assert rank("invariant", ["hit_sound_swa_window"])[0] == rank("safety", ["hit_sound_content"])[0]
    assert lead(["toctou_bound_stable", "hit_sound_tail"]) == "hit_sound_tail"


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_bug_leads_with_its_check(tmp_path, bug) -> None:
    res = _campaign(tmp_path, bug)
    want = BUGS[bug]
    assert res["exit_code"] == (10 if want == "hit_sound_content" else 13), res["findings"]
    f = res["findings"][0]
    assert lead(f["checks"]) == want, f
    assert res["detection_check"] == want and res["seconds_to_detection"] is not None
    raised = res["checks_raised"]
    assert raised[0]["check"] == want and raised[0]["count"] >= 1, raised   # the most serious raised
    assert res["first_failure_check"] in {c["check"] for c in raised}


def test_fixed_manager_without_salt_is_clean(tmp_path) -> None:
    res = _campaign(tmp_path)
    assert res["exit_code"] == 0, res["findings"]
    assert "append_fail" in res["coverage"]["actions"]           # allocations that find no room
    assert not res["coverage"]["actions_missing"], res["coverage"]
    assert res["checks_raised"] == []


def test_with_salt_the_saltless_manager_is_flagged(tmp_path) -> None:
    """The negative control of `salt = false`: asked as a salted engine, another tenant hits."""
    res = _campaign(tmp_path, cfg=replace(CFG, salt=True), steps=1500)
    assert res["exit_code"] == 10
    assert "another tenant" in res["findings"][0]["message"] or "tenant-1" in res["findings"][0]["message"]


def test_salt_false_refuses_salted_prompts() -> None:
    with pytest.raises(ConfigError, match="salt = false"):
        Config.from_dict({**CFG.to_dict(), "prompts": 2, "salted_prompts": 1})


def test_actions_declared_per_config() -> None:
    sut = SeqAdapter()
    sut.reset(CFG)
    assert "append_fail" in sut.actions and not {"evict", "bind_stale"} & sut.actions
    sut.reset(replace(CFG, alloc="refuse"))
    assert not {"append_fail", "evict", "bind_stale"} & sut.actions
    assert set(sut.base_actions) == set(sut.actions) and set(REACH) >= {"append_fail", "bind_stale"}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_finding_replays_clean_on_the_fix(tmp_path, bug) -> None:
    from kvcheck.spec.trace import Trace
    res = _campaign(tmp_path, bug)
    trace = Trace.load(res["findings"][0]["trace"])
    code, out = replay(trace, SeqAdapter(bug))
    assert code == res["exit_code"] and lead(out["finding"]["checks"]) == BUGS[bug], out
    code, out = replay(trace, SeqAdapter(None))
    assert code == 0, out


def test_steps_followed_alone_replay_clean_on_the_fix() -> None:
    """A trace whose engine was followed alone after it left the spec (lost reuse: the engine
    recomputes what the spec reuses): its follow steps are marked; the bug reproduces the same
    check, the fix skips what the spec forbids there and exits 0."""
    spec = Spec(CFG)
    model = ValuedSpecModel(spec)
    core = GuardedLockstep(model, SeqAdapter("lost_reuse"))
    core.sut.reset(CFG)
    prog = [("submit", {"r": 0, "n": 1}), ("lookup", {"r": 0}), ("bind", {"r": 0}), ("use", {"r": 0}),
            ("append", {"r": 0, "j": 0}), ("submit", {"r": 1, "n": 1}), ("lookup", {"r": 1})]
    f = core.run([model.step(a, p) for a, p in prog])
    assert f is not None and f.checks == ["decision_matches_spec"]
    assert len(core.trail) > core.lockstep            # r1 driven to completion on the SUT alone
    trace = to_trace(spec, core.trail, 0, engine="fuzz", expect_upto=core.lockstep, sut=SUT, finding=f)
    follow = [s for s in trace.steps if s.expect.get("mode") == "follow"]
    assert len(follow) == len(core.trail) - core.lockstep
    code, out = replay(trace, SeqAdapter("lost_reuse"))
    assert code == 13 and out["finding"]["checks"] == ["decision_matches_spec"], out
    code, out = replay(trace, SeqAdapter(None))
    assert code == 0, out


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": f"{ROOT}:{HERE}", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "kvcheck", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_cli_replay_without_fault_and_config(tmp_path) -> None:
    res = _campaign(tmp_path, "wrong_block_hit")
    path = res["findings"][0]["trace"]
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(CFG.to_dict()))
    bug = _cli("replay", path, "--sut", SUT, "--config", str(cfg))
    assert bug.returncode == 10 and "hit_sound_content" in bug.stdout, bug.stdout + bug.stderr
    fix = _cli("replay", path, "--sut", SUT, "--without-fault", "--json")
    assert fix.returncode == 0 and json.loads(fix.stdout)["exit_code"] == 0, fix.stdout + fix.stderr
    cfg.write_text(json.dumps({**CFG.to_dict(), "blocks": 4}))
    bad = _cli("replay", path, "--sut", SUT, "--config", str(cfg))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "blocks" in bad.stderr


class _BaseDeclaresMore(SeqAdapter):
    """As if the base class declared bind_stale where nothing reaches it (the old behaviour)."""

    def _declare(self, alloc):
        acts = super()._declare(alloc) | {"bind_stale"}
        self.base_actions = {**self.base_actions, "bind_stale": "an evict callback"}
        return acts


def test_adapter_check_advice_names_the_base_class_declaration() -> None:
    from kvcheck.fuzz.adapter_lint import lint
    res = lint(CFG, "base", _BaseDeclaresMore, steps=400)
    [p] = [p for p in res["problems"] if "bind_stale" in p]
    assert p.startswith("the base class declares bind_stale") and "drop" not in p, p
    clean = lint(CFG, SUT, SeqAdapter, steps=2000)
    assert clean["exit_code"] == 0 and not clean["problems"], clean["problems"]
