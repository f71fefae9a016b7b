"""`kvcheck fuzz --sut vllm --drive auto` (the default): vLLM's own scheduler (the engine drive)
wherever it can run the request, else the manager drive (mixed), decided once per campaign and
said in the result (`drive`, `drive_reason`), the human line and the rerun command. An explicit
`--drive engine` keeps its refusals. (kvcheck/engines/vllm/drive_plan.py)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from badinput import assert_bad_input, run
from kvcheck.engines.vllm import drive_plan as dp


# ---- without vLLM ------------------------------------------------------------------------------
@pytest.mark.parametrize("layout, fault, twin, workload, want", [
    ("full", None, None, "random", ("engine", dp.ENGINE_WHY)),
    ("gemma3", "drop_ref_on_free", None, "random", ("engine", dp.ENGINE_WHY)),
    ("full+swa-sparse", None, None, "random", ("mixed", dp.TWIN_WHY)),          # a retention interval
    ("full+swa-sparse", None, False, "random", ("engine", dp.ENGINE_WHY)),      # the twin turned off
    ("full+swa", None, True, "random", ("mixed", dp.TWIN_WHY)),
    ("full+swa", "retention_drops_tail", None, "random", ("mixed", dp.TWIN_WHY)),
    ("generated", None, None, "random", ("mixed", dp.GENERATED_WHY)),
    ("full+swa", None, None, "chat", ("mixed", dp.workload_why("chat"))),
    ("full+swa-sparse", "worker_table_stale", None, "random", ("engine", dp.engine_fault_why("worker_table_stale"))),
    ("qwen3-next+mtp", "mamba_accept_ignored", None, "random", ("engine", dp.engine_fault_why("mamba_accept_ignored"))),
    ("qwen3-next+mtp", None, None, "random", ("engine", dp.ENGINE_WHY)),         # drafts with Mamba: on the engine drive
    ("qwen3-next", None, None, "random", ("engine", dp.ENGINE_WHY)),
    ("gemma3@real", None, None, "random", ("engine", dp.ENGINE_WHY)),
])
def test_what_auto_resolves_to_before_anything_is_built(layout, fault, twin, workload, want) -> None:
    assert dp.static_choice(layout, fault, twin, workload) == want
    assert "\n" not in want[1] and want[1].startswith("auto: ")


@pytest.mark.parametrize("argv, needle", [
    (["--layout", "full", "--drive", "nope"], "--drive: unknown drive 'nope'; known: auto, mixed"),
    (["--layout", "full", "--drive", "AUTO"], "--drive: unknown drive"),
    (["--layout", "full", "--drive", "engine", "--ray"], "--drive: the Ray shards run the mixed drive only"),
])
def test_a_bad_drive_is_one_line_exit_2(capsys, tmp_path, argv, needle) -> None:
    code, out, err = run(capsys, "fuzz", "--sut", "vllm", *argv, "--budget", "20", "--out", str(tmp_path))
    assert_bad_input(code, err, needle)
    assert not out


def test_the_ray_shards_campaign_is_the_manager_drive(monkeypatch) -> None:
    """A shard (fuzz/ray_campaign.py) runs the engine's `campaign` without a drive: mixed, never auto."""
    from kvcheck.engines.vllm import drivers
    from kvcheck.engines.vllm.engine import ENGINE
    seen: dict = {}
    monkeypatch.setattr(drivers, "run_campaign", lambda layout, **kw: seen.update(kw) or {})
    ENGINE.campaign("full", budget_s=None, steps=5, seed=0, fault=None, out_dir="x", strict_reuse=False)
    assert seen["drive"] == "mixed"


def test_a_trace_naming_auto_or_an_unknown_drive_is_refused_in_one_line() -> None:
    from kvcheck.engines.vllm.engine_gen import knobs_of
    assert knobs_of({}) is None and knobs_of({"drive": "mixed"}) is None
    for drive in ("auto", "bogus", 3):
        with pytest.raises(ValueError) as e:
            knobs_of({"drive": drive})
        assert str(e.value).startswith("trace meta.drive") and "\n" not in str(e.value)


# ---- on the installed vLLM ---------------------------------------------------------------------
def _fuzz(capsys, tmp_path, *argv: str, budget: str = "40") -> tuple[int, dict]:
    code, out, err = run(capsys, "fuzz", "--sut", "vllm", *argv, "--budget", budget, "--json",
                         "--out", str(tmp_path))
    return code, json.loads(out)


def test_auto_runs_vllms_own_scheduler_on_a_plain_layout(capsys, tmp_path) -> None:
    pytest.importorskip("vllm")
    code, res = _fuzz(capsys, tmp_path, "--layout", "full")
    assert res["drive"] == "engine" and res["drive_reason"] == "auto: vLLM's own scheduler", res
    assert res["scheduler"]["driver"].startswith("vllm.v1.core.sched.scheduler.Scheduler")
    assert res["command"].endswith("--seed 0 --drive engine")
    # the human line says it too, and its rerun names the drive
    code, out, _ = run(capsys, "fuzz", "--sut", "vllm", "--layout", "full", "--budget", "40", "--out", str(tmp_path))
    assert "drive engine (auto: vLLM's own scheduler); rerun: kvcheck fuzz" in out and "--drive engine" in out, out


@pytest.mark.parametrize("argv, why", [
    (["--layout", "full+swa-sparse"], dp.TWIN_WHY),
    (["--layout", "generated"], dp.GENERATED_WHY),
    (["--layout", "full+swa", "--workload", "chat"], dp.workload_why("chat")),
])
def test_auto_falls_back_to_the_manager_drive_and_says_why(capsys, tmp_path, argv, why) -> None:
    pytest.importorskip("vllm")
    code, res = _fuzz(capsys, tmp_path, *argv)
    assert (res["drive"], res["drive_reason"]) == ("mixed", why), res
    assert "--drive mixed" in res["command"] and "scheduler" not in res


def test_explicit_drives_are_kept_and_their_refusals_too(capsys, tmp_path) -> None:
    pytest.importorskip("vllm")
    code, res = _fuzz(capsys, tmp_path, "--layout", "full", "--drive", "mixed")
    assert (res["drive"], res["drive_reason"]) == ("mixed", "--drive mixed given")
    # the grammar's layouts through vLLM's own scheduler (each sampled one built as the release builds it)
    code, res = _fuzz(capsys, tmp_path, "--layout", "generated", "--drive", "engine", budget="300")
    assert res["drive"] == "engine" and res["layouts_sampled"] >= 1 and res["steps"] == 300, res
    code, _, err = run(capsys, "fuzz", "--sut", "vllm", "--layout", "full+swa-sparse", "--drive", "engine",
                       "--fault", "retention_drops_tail", "--budget", "20", "--out", str(tmp_path))
    assert_bad_input(code, err, "dense twin")


def test_a_layout_the_release_cannot_express_on_its_scheduler_falls_back_under_auto_only(capsys, tmp_path,
                                                                                        monkeypatch) -> None:
    """As on 0.14.1, whose engine derives other block sizes for mixed_block: the pre-flight builds
    the scheduler once; auto runs the manager drive, an explicit --drive engine stays exit 2."""
    pytest.importorskip("vllm")
    from kvcheck.engines.vllm import engine_sched
    from kvcheck.fuzz.boundary import CannotExpress

    def build(layout, knobs):
        raise CannotExpress(f"layout {layout!r} needs scheduler block 8 and hash block 4; vLLM X derives 4 and 4")
    monkeypatch.setattr(engine_sched, "build", build)
    code, res = _fuzz(capsys, tmp_path, "--layout", "full")
    assert res["drive"] == "mixed" and res["drive_reason"].startswith("auto: vLLM's own scheduler cannot express"), res
    assert "derives 4 and 4" in res["drive_reason"] and res["command"].endswith("--drive mixed")
    code, out, err = run(capsys, "fuzz", "--sut", "vllm", "--layout", "full", "--drive", "engine", "--budget", "20",
                         "--json", "--out", str(tmp_path))
    assert code == 2 and "derives 4 and 4" in json.loads(out)["cannot_express"]


@pytest.mark.parametrize("argv, drive", [
    (["--layout", "full", "--fault", "drop_ref_on_free", "--seed", "1"], "engine"),
    (["--layout", "full+swa-sparse", "--fault", "retention_drops_tail"], "mixed"),
])
def test_a_findings_rerun_command_names_the_resolved_drive_and_its_trace_replays(capsys, tmp_path, argv,
                                                                                  drive) -> None:
    pytest.importorskip("vllm")
    code, res = _fuzz(capsys, tmp_path, *argv, budget="4000")
    assert res["caught"] and res["drive"] == drive, res.get("findings")
    assert f"--drive {drive}" in res["command"]
    f = next(x for x in res["findings"] if x["check"] == res["expected_check"])
    meta = json.loads(Path(f["trace"]).read_text())["meta"]
    assert meta.get("drive", "mixed") == drive
    code, out, err = run(capsys, "replay", f["trace"], "--sut", "vllm", "--json")
    assert json.loads(out)["reproduced"], out
    # a trace never names auto: one that does is one line, exit 2
    d = json.loads(Path(f["trace"]).read_text())
    d["meta"]["drive"] = "auto"
    bad = tmp_path / "auto.json"
    bad.write_text(json.dumps(d))
    code, _, err = run(capsys, "replay", str(bad), "--sut", "vllm")
    assert_bad_input(code, err, "meta.drive")


def test_a_layout_the_release_cannot_express_is_said_in_the_json(capsys, tmp_path, monkeypatch) -> None:
    """kvcheck matrix reads "cannot express" from the JSON: a layout whose block sizes the
    release's engine derives otherwise (sched_build.build), asked on the engine drive explicitly."""
    pytest.importorskip("vllm")
    from kvcheck.engines.vllm import drive_plan
    from kvcheck.fuzz.boundary import CannotExpress

    def refuse(layout):
        raise CannotExpress(f"layout {layout!r} needs scheduler block 16 and hash block 4; this release derives 16 and 16")
    # (the pre-flight's build of the scheduler: refused; the manager drive's check of the layout: passed)
    monkeypatch.setattr(drive_plan, "make_adapter", lambda *a: None if isinstance(a[-1], str) else refuse(a[0]))
    code, out, err = run(capsys, "fuzz", "--sut", "vllm", "--layout", "full", "--drive", "engine",
                         "--budget", "20", "--json", "--out", str(tmp_path))
    assert code == 2 and "derives 16 and 16" in json.loads(out)["cannot_express"], out
    code, res = _fuzz(capsys, tmp_path, "--layout", "full", budget="200")     # auto falls back, saying why
    assert res["drive"] == "mixed" and "cannot express" in res["drive_reason"], res
