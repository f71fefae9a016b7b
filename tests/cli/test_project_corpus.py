"""The gate's corpus, like Hypothesis's example database: a finding of one gate run is saved
(once) and replayed first by the next; when the bug is fixed its trace replays clean and is
reported "fixed", a passing test case."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from badinput import run

ROOT = Path(__file__).resolve().parents[2]
# A user's adapter with a real bug (the toy's hash-only hit) while BUGGY_TOY=1: not planted,
# so a clean gate run finds it; "fixing" it is unsetting the variable.
ADAPTER = """
import os

from examples.toy_allocator import ToyAllocator


class BuggyToy(ToyAllocator):
    faults = {}

    def __init__(self, fault=None):
        super().__init__("hash_only_hit" if os.environ.get("BUGGY_TOY") == "1" else None)
"""


@pytest.fixture()
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    (tmp_path / "buggy_toy.py").write_text(ADAPTER)
    p = tmp_path / "kvcheck.toml"
    p.write_text(f'[systems."buggy_toy:BuggyToy"]\nconfig = "{ROOT / "examples" / "toy.json"}"\n'
                 'engines = ["fuzz", "replay-corpus"]\nbudget = 500\n')
    return p


def gate(capsys, tmp_path: Path) -> tuple[int, dict]:
    code, out, err = run(capsys, "gate", "--json", "--junit", str(tmp_path / "j.xml"))
    assert err == "" or code != 2, err
    return code, json.loads(out)


def test_a_finding_is_saved_replayed_first_and_reported_fixed(capsys, tmp_path, project, monkeypatch) -> None:
    monkeypatch.setenv("BUGGY_TOY", "1")
    code, rep = gate(capsys, tmp_path)
    assert code == 13, rep["verdict"]                    # conformance: the toy's decision differs
    assert rep["corpus_replayed"] == 0 and len(rep["corpus_saved"]) == 1
    saved = Path(rep["corpus_saved"][0])
    assert saved.parent == tmp_path / "kvcheck-corpus" and saved.is_file()
    assert json.loads(saved.read_text())["sut"] == "buggy_toy:BuggyToy"
    assert rep["findings"][0]["check"] == "decision_matches_spec" and rep["findings"][0]["replay"]

    # next run: the corpus is replayed first, still fails, and the same finding is not saved twice
    code, rep = gate(capsys, tmp_path)
    assert code == 13
    first = rep["checks"][0]
    assert (first["engine"], first["check"], first["verdict"]) == ("replay-corpus", saved.name, "failed")
    assert first["finding"]["replay"].startswith("kvcheck replay") and first["finding"]["trace_steps"]
    assert rep["corpus_replayed"] == 1 and rep["corpus_saved"] == []
    assert sorted(p.name for p in (tmp_path / "kvcheck-corpus").iterdir()) == [saved.name]

    # the bug is fixed: the trace replays clean, "fixed", a passing test case; the gate holds
    monkeypatch.delenv("BUGGY_TOY")
    project.write_text(project.read_text().replace('engines = ["fuzz", "replay-corpus"]', 'engines = ["replay-corpus"]'))
    code, rep = gate(capsys, tmp_path)
    assert code == 0, rep["verdict"]
    assert [(c["check"], c["verdict"]) for c in rep["checks"]] == [(saved.name, "fixed")]
    case = next(ET.parse(tmp_path / "j.xml").getroot().iter("testcase"))
    assert case.get("classname") == "kvcheck.buggy_toy:BuggyToy.replay-corpus" and case.get("name") == saved.name
    assert case.find("failure") is None and case.find("skipped") is None


def test_a_trace_of_a_system_not_in_the_project_is_skipped(capsys, tmp_path, project) -> None:
    from kvcheck.fuzz.walk import Walker, to_trace
    from kvcheck.spec.config import Config
    from kvcheck.spec.system import Spec
    spec = Spec(Config(), "eviction_ignores_pins")
    v = Walker(spec, seed=0).run(100_000, seconds=30).violation
    t = to_trace(Spec(Config()), v.trace, 0)
    t.violation = {"step": len(v.trace) - 1, "invariants": v.invariants}
    t.save(tmp_path / "kvcheck-corpus" / "spec-walk.json")
    project.write_text(project.read_text().replace('engines = ["fuzz", "replay-corpus"]', 'engines = ["replay-corpus"]'))
    code, rep = gate(capsys, tmp_path)
    assert code == 0
    [c] = rep["checks"]
    assert c["verdict"] == "skipped" and "not enabled for spec" in c["note"]
    assert next(ET.parse(tmp_path / "j.xml").getroot().iter("testcase")).find("skipped") is not None


def test_a_vllm_trace_replays_on_vllm_and_a_fixed_bug_is_reported_fixed(capsys, tmp_path, project) -> None:
    v = pytest.importorskip("kvcheck.engines.vllm.drivers")
    try:
        v.VllmAdapter("full+swa", 24, None)
    except v.VllmUnavailable as e:
        pytest.skip(str(e))
    # a stored vLLM finding (tests/fuzz/traces-*: the planted swa_hit_unchecked fault)
    d = json.loads((ROOT / "tests" / "fuzz" / "traces-78478e7" / "vllm-full_swa-swa_hit_unchecked.json").read_text())
    assert d["sut"] == "vllm" and d["fault"] == "swa_hit_unchecked"
    d["fault"] = None               # the same steps on vLLM without the planted bug: "fixed"
    (tmp_path / "kvcheck-corpus").mkdir()
    (tmp_path / "kvcheck-corpus" / "vllm-found.json").write_text(json.dumps(d))
    project.write_text('[systems.vllm]\nlayouts = ["full+swa"]\nengines = ["replay-corpus"]\n')
    code, rep = gate(capsys, tmp_path)
    assert code == 0, rep["verdict"]
    assert [(c["system"], c["check"], c["verdict"]) for c in rep["checks"]] == [("vllm", "vllm-found.json", "fixed")]
    d["fault"] = "swa_hit_unchecked"         # a planted fault is refused: the corpus keeps clean-run findings
    (tmp_path / "kvcheck-corpus" / "vllm-found.json").write_text(json.dumps(d))
    code, _, err = run(capsys, "gate")
    assert code == 2 and "vllm-found.json: plants fault 'swa_hit_unchecked'" in err
