"""Known engine defects are acknowledged expectations, never silence (kvcheck/fuzz/known.py):
a recognised defect fails with its check's exit code unless the team acknowledged it (with a
reason), an acknowledged one is shown, and one the release cannot have is "fixed?"."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from kvcheck.fuzz.known import KnownDefect, judge, parse_acknowledgements, parse_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from badinput import assert_bad_input, run  # noqa: E402

COW = KnownDefect("fine_cow_same_step", "state_copy_sound", "safety", "0.28.0", "0.33.0", "vllm#41838")
MARGIN = KnownDefect("unitary_eagle_margin", "lost_reuse", "lost_reuse", "0.14.1", "0.33.0", "none found")
DEFECTS = {d.name: d for d in (COW, MARGIN)}


def _res(**known: int) -> dict:
    return {"exit_code": 0, "findings": [], "coverage": {"lookup": 9, **{f"known:{k}": n for k, n in known.items()}}}


def test_an_unacknowledged_safety_defect_is_a_finding_with_exit_10() -> None:
    r = judge(_res(fine_cow_same_step=3), DEFECTS, None, "0.33.0")
    assert r["exit_code"] == 10 and r["findings"] == []      # counted, not saved: no trace to replay
    (row,) = r["known"]
    assert row["status"] == "finding" and row["fails"] and row["recognised"] == 3
    assert row["kind"] == "safety" and row["check"] == "state_copy_sound" and row["name"] == "fine_cow_same_step"
    assert "vllm#41838" in row["message"] and "acknowledge" in row["message"]


def test_an_acknowledged_one_is_shown_and_does_not_fail() -> None:
    ack = parse_acknowledgements({"fine_cow_same_step": {"reason": "waiting for PR #42359",
                                                         "upstream": "vllm#41838"}}, "known")
    r = judge(_res(fine_cow_same_step=3), DEFECTS, ack, "0.33.0")
    assert r["exit_code"] == 0 and r["findings"] == []
    assert r["known"] == [{"name": "fine_cow_same_step", "recognised": 3, "check": "state_copy_sound",
                           "kind": "safety", "upstream": "vllm#41838", "releases": "0.28.0..0.33.0",
                           "reason": "waiting for PR #42359", "status": "acknowledged"}]


def test_lost_reuse_is_reported_and_fails_only_where_lost_reuse_fails() -> None:
    r = judge(_res(unitary_eagle_margin=1), DEFECTS, None, "0.33.0", fails_kinds=frozenset({"safety"}))
    assert r["exit_code"] == 0 and r["known"][0]["kind"] == "lost_reuse" and not r["known"][0]["fails"]
    r = judge(_res(unitary_eagle_margin=1), DEFECTS, None, "0.33.0", fails_kinds=frozenset({"lost_reuse"}))
    assert r["exit_code"] == 13


def test_an_acknowledgement_the_release_cannot_have_is_fixed_and_fails_when_strict() -> None:
    ack = parse_cli(["fine_cow_same_step=accepted"])
    r = judge(_res(), DEFECTS, ack, "0.20.0")
    assert r["exit_code"] == 0 and r["known"][0]["status"] == "fixed?"
    assert "remove the entry" in r["known"][0]["message"]
    assert judge(_res(), DEFECTS, ack, "0.20.0", strict=True)["exit_code"] == 13
    assert judge(_res(), DEFECTS, ack, "0.33.0", strict=True)["known"][0]["status"] == "acknowledged, not hit"
    r = judge(_res(), DEFECTS, parse_cli(["no_such_defect=x"]), "0.33.0")
    assert r["known"][0]["status"] == "unknown" and "fine_cow_same_step" in r["known"][0]["message"]


@pytest.mark.parametrize("table, needle", [
    ({"x": {}}, "known.x: reason must be a non-empty string"),
    ({"x": {"reason": "  "}}, "reason must be a non-empty string"),
    ({"x": {"reason": "r", "why": 1}}, "known.x: must be"),
    ({"x": {"reason": "r", "upstream": 3}}, "upstream must be a string"),
    ({"../x": "r"}, "is not a defect name"),
    ([1, 2], "known: must be a table"),
])
def test_bad_acknowledgements_name_the_entry(table, needle) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        parse_acknowledgements(table, "known")


def _with_known_defect(monkeypatch) -> None:
    """A real (tiny) vLLM campaign whose manager met fine_cow_same_step twice (as a campaign on
    qwen3-next-fine+mtp does; docs/findings-vllm.md), so the verdict is the rule's, end to end."""
    pytest.importorskip("vllm")
    from kvcheck.engines.vllm import drivers
    real = drivers._campaign

    def campaign(*a, **k):
        res = real(*a, **k)
        res["coverage"]["known:fine_cow_same_step"] = 2
        res["vllm_version"] = "0.33.0"
        return res
    monkeypatch.setattr(drivers, "_campaign", campaign)


def test_a_vllm_campaign_meeting_a_known_safety_defect_exits_10_unless_acknowledged(monkeypatch, capsys, tmp_path):
    _with_known_defect(monkeypatch)
    args = ("fuzz", "--sut", "vllm", "--layout", "full+swa", "--budget", "60", "--json", "--out", str(tmp_path),
            "--drive", "mixed")       # (every action in 60 steps: the manager drive's)
    code, out, _ = run(capsys, *args)
    res = json.loads(out)
    assert code == 10 and res["exit_code"] == 10
    assert [r["name"] for r in res["known"] if r["status"] == "finding"] == ["fine_cow_same_step"]
    code, out, _ = run(capsys, *args, "--acknowledge", "fine_cow_same_step=waiting for vllm PR #42359")
    res = json.loads(out)
    assert code == 0 and all(r["status"] != "finding" for r in res["known"])
    assert res["known"][0]["status"] == "acknowledged" and "--acknowledge=fine_cow_same_step" in res["command"]
    assert_bad_input(*run(capsys, *args, "--acknowledge", "fine_cow_same_step")[::2], "NAME=REASON")
    assert_bad_input(*run(capsys, "fuzz", "--sut", "spec", "--acknowledge", "a=b")[::2],
                     "--acknowledge applies to --sut sglang and --sut vllm only")


def test_the_project_gate_fails_on_it_unless_the_file_acknowledges_it(monkeypatch, capsys, tmp_path):
    _with_known_defect(monkeypatch)
    base = ('[systems.vllm]\nlayouts = ["full+swa"]\nengines = ["fuzz"]\nbudget = 400\n')
    proj = tmp_path / "kvcheck.toml"
    proj.write_text(base)
    code, out, _ = run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "a"), "--json")
    assert code == 10, out
    proj.write_text('[known]\nfine_cow_same_step = { reason = "waiting for PR #42359", upstream = "vllm#41838" }\n'
                    + base)
    junit = tmp_path / "j.xml"
    code, out, _ = run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "b"), "--json",
                       "--junit", str(junit))
    assert code == 0, out
    xml = junit.read_text()
    assert 'name="known:fine_cow_same_step"' in xml and "acknowledged known defect" in xml and 'type="xfail"' in xml
    proj.write_text('[known]\nfine_cow_same_step = { upstream = "vllm#41838" }\n' + base)
    assert_bad_input(*run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "c"))[::2],
                     "known.fine_cow_same_step: reason must be a non-empty string")


def _with_release(monkeypatch, version: str) -> None:
    """A vLLM campaign that meets no known defect, on `version` (where fine_cow_same_step cannot be)."""
    from kvcheck.engines.vllm import drivers
    real = drivers._campaign

    def campaign(*a, **k):
        res = real(*a, **k)
        res["vllm_version"] = version
        return res
    monkeypatch.setattr(drivers, "_campaign", campaign)


def test_strict_known_on_the_command_line_fails_a_stale_acknowledgement(monkeypatch, capsys, tmp_path):
    """`--strict-known` mirrors the project file's known_strict: an acknowledged defect the release
    under test cannot have is "fixed? remove the entry" and fails; without the flag it is shown only."""
    _with_release(monkeypatch, "0.20.0")
    args = ("fuzz", "--sut", "vllm", "--layout", "full+swa", "--budget", "40", "--json", "--out", str(tmp_path),
            "--acknowledge", "fine_cow_same_step=waiting for vllm PR #42359", "--drive", "mixed")
    code, out, _ = run(capsys, *args)
    res = json.loads(out)
    assert code == 0 and res["known"][0]["status"] == "fixed?"
    code, out, _ = run(capsys, *args, "--strict-known")
    res = json.loads(out)
    assert code == 13 and res["known"][0]["status"] == "fixed?" and "--strict-known" in res["command"]
    assert_bad_input(*run(capsys, "fuzz", "--sut", "spec", "--strict-known")[::2],
                     "--strict-known applies to --sut sglang and --sut vllm only")


def test_strict_known_on_the_gate_is_the_files_known_strict(monkeypatch, capsys, tmp_path):
    _with_release(monkeypatch, "0.20.0")
    proj = tmp_path / "kvcheck.toml"
    proj.write_text('[known]\nfine_cow_same_step = { reason = "waiting for PR #42359" }\n'
                    '[systems.vllm]\nlayouts = ["full+swa"]\nengines = ["fuzz"]\nbudget = 400\n')
    code, out, _ = run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "a"), "--json")
    assert code == 0, out
    code, out, _ = run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "b"), "--json", "--strict-known")
    assert code != 0 and "fixed?" in out, out
    assert_bad_input(*run(capsys, "gate", "--strict-known", "--out", str(tmp_path / "c"))[::2],
                     "--strict-known applies to a project gate")
