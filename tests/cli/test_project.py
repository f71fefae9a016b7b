"""`kvcheck gate` with a project file: the sample file (reference engine, a vLLM layout, the toy
MODULE:CLASS adapter) runs and writes one JUnit test case per check; expected faults are
regression checks that fail when a fault survives; `kvcheck init` writes a starter that passes;
without a file the default profile still writes its report, now with per-check records."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from badinput import assert_bad_input, run
from kvcheck.checker.project import load_project

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "examples" / "kvcheck.toml"
TOY = "examples.toy_allocator:ToyAllocator"


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)            # MODULE:CLASS imports from the working directory


def cases(xml: Path) -> list[ET.Element]:
    return list(ET.parse(xml).getroot().iter("testcase"))


def test_the_sample_project_runs_with_one_junit_case_per_check(capsys, tmp_path) -> None:
    text = SAMPLE.read_text().replace('corpus = "../kvcheck-corpus"', f'corpus = "{tmp_path / "corpus"}"')
    text = text.replace('config = "toy.json"', f'config = "{ROOT / "examples" / "toy.json"}"')
    proj = tmp_path / "kvcheck.toml"
    proj.write_text(text)
    assert {s.name for s in load_project(SAMPLE).systems} == {"reference", "vllm", TOY}
    out, xml = tmp_path / "rep", tmp_path / "out.xml"
    code, stdout, err = run(capsys, "gate", "--project", str(proj), "--out", str(out), "--junit", str(xml))
    assert code == 0, stdout + err
    rep = json.loads((out / "report.json").read_text())
    assert rep["verdict"] == "holds" and rep["findings"] == []
    got = cases(xml)
    assert len(got) == len(rep["checks"]) > 30
    names = [(c.get("classname"), c.get("name")) for c in got]
    assert len(set(names)) == len(names)                       # one case per (system, engine, check)
    assert all(c.find("failure") is None and c.find("error") is None for c in got)
    assert {cl for cl, _ in names} >= {"kvcheck.reference.fuzz", "kvcheck.reference.diff",
                                       "kvcheck.vllm[full+swa].fuzz", f"kvcheck.{TOY}.fuzz"}
    # the planted faults of the sample are caught by their expected checks
    caught = {c["check"]: c for c in rep["checks"] if c["check"].startswith("expected_fault:")}
    assert caught["expected_fault:hash_only_hit"]["counts"]["caught_by"] == ["decision_matches_spec"]
    assert caught["expected_fault:drop_ref_on_free"]["verdict"] == "passed"
    # every engine that ran is in the terminal summary
    for engine in ("reference fuzz", "reference diff", "vllm[full+swa] fuzz", f"{TOY} fuzz"):
        assert engine in stdout
    assert rep["engines"][f"{TOY} fuzz"]["counts"]["steps"] >= 500
    # the vLLM layout's reuse profile is collected, and the HTML report draws it
    prof = {lay: pts for e in rep["engines"].values() for lay, pts in e.get("reuse_profile", {}).items()}
    assert set(prof) == {"full+swa"} and len(prof["full+swa"]) == 33
    assert prof["full+swa"][-1][1] > prof["full+swa"][0][1] == 0     # more shared, more reused
    from kvcheck.checker.report_engines import plots
    assert any("Reuse profile of layout full+swa" in cap for _, cap in plots({"report": rep}))


ADAPTER = """
from examples.toy_allocator import ToyAllocator


class Toy(ToyAllocator):
    # hash_only_hit with the wrong expected check (mis-attributed); noop plants nothing (survives)
    faults = {"hash_only_hit": "refcount_equals_holders", "noop": "decision_matches_spec"}

    def __init__(self, fault=None):
        super().__init__(fault if fault == "hash_only_hit" else None)
"""


def test_a_surviving_or_misattributed_expected_fault_fails_the_gate(capsys, tmp_path, monkeypatch) -> None:
    (tmp_path / "toy_regress.py").write_text(ADAPTER)
    monkeypatch.syspath_prepend(str(tmp_path))
    proj = tmp_path / "kvcheck.toml"
    proj.write_text(f'corpus = "c"\n[systems."toy_regress:Toy"]\nconfig = "{ROOT / "examples" / "toy.json"}"\n'
                    'engines = ["fuzz"]\nbudget = 200\nexpected_faults = ["hash_only_hit", "noop"]\n'
                    'fault_budget = 200\n')
    xml = tmp_path / "j.xml"
    code, stdout, err = run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "o"), "--junit", str(xml))
    assert code == 3, stdout + err                # a regression check that fails: the gate does not pass
    got = {c.get("name"): c for c in cases(xml)}
    mis = got["expected_fault:hash_only_hit"].find("failure").get("message")
    assert "caught by decision_matches_spec, not its expected check refcount_equals_holders" in mis
    assert "survived" in got["expected_fault:noop"].find("failure").get("message")
    assert got["decision_matches_spec"].find("failure") is None        # the clean run still holds
    assert stdout.count("FINDING") == 2


def test_init_writes_a_starter_that_parses_and_passes(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "init")
    assert code == 0 and (tmp_path / "kvcheck.toml").is_file(), err
    code, _, err = run(capsys, "init")
    assert_bad_input(code, err, "kvcheck.toml already exists", "--force")
    code, _, err = run(capsys, "init", "--force")
    assert code == 0, err
    proj = load_project(tmp_path / "kvcheck.toml")
    assert {s.name for s in proj.systems} == {"spec", "reference"}
    assert proj.corpus == tmp_path / "kvcheck-corpus"
    code, out, err = run(capsys, "gate", "--junit", "j.xml", "--json")     # found in the working directory
    assert code == 0, out[-2000:] + err
    rep = json.loads(out)
    assert rep["project"].endswith("kvcheck.toml") and rep["verdict"] == "holds"
    assert any(c["check"] == "expected_fault:eviction_ignores_pins" and c["verdict"] == "passed"
               for c in rep["checks"])
    assert len(cases(tmp_path / "j.xml")) == len(rep["checks"])


def test_a_project_file_in_pyproject_is_found(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.kvcheck.systems.spec]\n'
                                             'engines = ["walk"]\nbudgets = { walk = 3000 }\n')
    code, out, err = run(capsys, "gate", "--json")
    rep = json.loads(out)
    assert rep["project"].endswith("pyproject.toml") and code in (0, 3), err
    assert {c["engine"] for c in rep["checks"]} == {"walk"}


def test_default_profile_writes_checks_and_junit(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVCHECK_GATE_CHECKERS", "0")
    xml = tmp_path / "j.xml"
    code, out, err = run(capsys, "gate", "--out", str(tmp_path / "o"), "--steps", "50", "--junit", str(xml))
    assert code == 3, err                                   # below the coverage minimum, as before
    assert "walk: 50 steps" in out and "spec walk" in out   # the old lines, then every engine
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert {"kvcheck", "command", "seed", "fault", "config", "engines", "verdict", "exit_code",
            "coverage_missing", "checks", "findings"} <= set(rep)
    cov = [c for c in cases(xml) if c.get("name") == "coverage"]
    assert len(cov) == 1 and cov[0].find("error") is not None


def test_report_files_are_readable_by_others_under_a_strict_umask(capsys, tmp_path, monkeypatch) -> None:
    import os
    import stat
    monkeypatch.setenv("KVCHECK_GATE_CHECKERS", "0")
    old = os.umask(0o077)
    try:
        code, _, err = run(capsys, "gate", "--out", str(tmp_path / "o"), "--fault", "eviction_ignores_pins",
                           "--junit", str(tmp_path / "j.xml"))
    finally:
        os.umask(old)
    assert code == 10, err
    files = [p for p in (tmp_path / "o").iterdir()] + [tmp_path / "j.xml"]
    assert len(files) >= 4
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) & 0o044 == 0o044, (p.name, oct(p.stat().st_mode))
    assert stat.S_IMODE((tmp_path / "o").stat().st_mode) & 0o055 == 0o055


def test_ctrl_c_writes_what_ran_and_claims_nothing(capsys, tmp_path, monkeypatch) -> None:
    from kvcheck.checker import project_engines

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(project_engines, "run_reference_diff", ctrl_c)
    proj = tmp_path / "kvcheck.toml"
    proj.write_text('[systems.spec]\nengines = ["walk"]\nbudget = 3000\n'
                    '[systems.reference]\nengines = ["diff"]\n')
    code, out, err = run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "o"), "--json")
    assert code == 130, err
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rep["interrupted"].startswith("reference diff") and rep["exit_code"] == 130
    assert {c["engine"] for c in rep["checks"]} == {"walk"}          # what ran is kept
