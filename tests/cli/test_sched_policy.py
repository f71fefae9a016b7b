"""`kvcheck fuzz --sut vllm --sched-policy fcfs|priority` and a project file's `sched_policy`:
the policy reaches the scheduler driver, is reported in the result, the rerun command and each
finding's trace; a bad value (or the flag elsewhere) is one line, exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from badinput import assert_bad_input, run
from kvcheck.checker.project import load_project

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize("argv, needle", [
    (["--sut", "vllm", "--layout", "full", "--sched-policy", "lifo"],
     "--sched-policy: unknown policy 'lifo'; known: fcfs, priority"),
    (["--sut", "vllm", "--layout", "full", "--sched-policy", "PRIORITY"], "--sched-policy: unknown policy"),
    (["--sut", "spec", "--sched-policy", "priority"], "--sched-policy applies to --sut vllm only"),
    (["--sut", "vllm", "--layout", "full", "--sched-policy", "priority", "--ray"],
     "--sched-policy: the Ray shards drive FCFS only"),
])
def test_bad_sched_policy_is_one_line(capsys, tmp_path, argv, needle) -> None:
    code, _, err = run(capsys, "fuzz", *argv, "--budget", "50", "--out", str(tmp_path))
    assert_bad_input(code, err, needle)


def test_priority_reaches_the_scheduler_driver_and_the_result(capsys, tmp_path, monkeypatch) -> None:
    pytest.importorskip("vllm")
    from kvcheck.engines.vllm import sched as vllm_sched
    used: list[str] = []
    real = vllm_sched.SchedGen.__init__

    def init(self, base, policy="fcfs"):
        used.append(policy)
        real(self, base, policy)
    monkeypatch.setattr(vllm_sched.SchedGen, "__init__", init)
    # (the manager drive's scheduler steps: sched.py's SchedGen)
    code, out, err = run(capsys, "fuzz", "--sut", "vllm", "--layout", "full", "--budget", "400", "--seed", "3",
                         "--drive", "mixed", "--sched-policy", "priority", "--out", str(tmp_path), "--json")
    res = json.loads(out)
    assert res["sched_policy"] == "priority" and res["scheduler_episodes"] > 0, err
    assert used and set(used) == {"priority"}
    assert res["command"].endswith("--drive mixed --sched-policy priority")
    used.clear()
    code, out, _ = run(capsys, "fuzz", "--sut", "vllm", "--layout", "full", "--budget", "400", "--seed", "3",
                       "--drive", "mixed", "--out", str(tmp_path), "--json")
    res = json.loads(out)
    assert res["sched_policy"] == "fcfs" and set(used) == {"fcfs"} and "--sched-policy" not in res["command"]


def test_a_given_policy_holds_on_vllms_own_scheduler_too(capsys, tmp_path) -> None:
    """The default drive (auto: vLLM's own scheduler on a plain layout) takes --sched-policy as
    every episode's policy; without it the policy is drawn per episode. The rerun names both."""
    pytest.importorskip("vllm")
    for policy in ("priority", "fcfs"):
        code, out, err = run(capsys, "fuzz", "--sut", "vllm", "--layout", "full", "--budget", "150", "--seed", "3",
                             "--sched-policy", policy, "--out", str(tmp_path), "--json")
        res = json.loads(out)
        assert res["drive"] == "engine" and res["sched_policy"] == policy, err
        assert res["scheduler"]["knobs"]["policy"] == {policy: res["episodes"]}
        assert res["command"].endswith(f"--drive engine --sched-policy {policy}")
    code, out, _ = run(capsys, "fuzz", "--sut", "vllm", "--layout", "full", "--budget", "150", "--seed", "3",
                       "--out", str(tmp_path), "--json")
    res = json.loads(out)
    assert res["drive"] == "engine" and res["sched_policy"] == "drawn per episode"
    assert "--sched-policy" not in res["command"]


def test_a_findings_trace_records_the_policy(capsys, tmp_path) -> None:
    pytest.importorskip("vllm")
    code, out, _ = run(capsys, "fuzz", "--sut", "vllm", "--layout", "full+swa", "--budget", "5000", "--seed", "1",
                       "--fault", "drop_ref_on_free", "--sched-policy", "priority", "--out", str(tmp_path), "--json")
    res = json.loads(out)
    assert res["findings"], res
    trace = json.loads(Path(res["findings"][0]["trace"]).read_text())
    assert trace["meta"]["sched_policy"] == "priority"
    code, out, _ = run(capsys, "replay", res["findings"][0]["trace"], "--sut", "vllm", "--json")
    assert code == res["exit_code"] and json.loads(out)["reproduced"]


def test_project_file_sched_policy(capsys, tmp_path, monkeypatch) -> None:
    p = tmp_path / "kvcheck.toml"
    p.write_text('[systems.vllm]\nlayouts = ["full"]\nsched_policy = "priority"\n')
    (vllm,) = load_project(p).systems
    assert vllm.sched_policy == "priority"
    p.write_text('[systems.vllm]\nlayouts = ["full"]\n')
    assert load_project(p).systems[0].sched_policy == "fcfs"
    for text, needle in [('[systems.vllm]\nlayouts = ["full"]\nsched_policy = "lifo"\n',
                          "kvcheck.toml: [systems.vllm] sched_policy: must be one of fcfs, priority (got 'lifo')"),
                         ('[systems.vllm]\nlayouts = ["full"]\nsched_policy = 1\n', "sched_policy: must be one of"),
                         ('[systems.reference]\nsched_policy = "priority"\n',
                          "[systems.reference] sched_policy: applies to vllm only")]:
        p.write_text(text)
        code, _, err = run(capsys, "gate", "--project", str(p), "--out", str(tmp_path / "o"))
        assert_bad_input(code, err, needle)
    # the gate's vLLM engine passes it to the campaign
    from kvcheck.checker import project_engines
    from kvcheck.engines.vllm import drivers as v
    seen: dict = {}

    def campaign(layout, **kw):
        seen.update(kw)
        raise v.VllmUnavailable("stop here")
    monkeypatch.setattr(v, "run_campaign", campaign)
    project_engines.run_engine_variant(vllm, "full", 0, tmp_path)   # the vLLM engine's project_run
    assert seen["sched_policy"] == "priority"
