"""The command line: JSON shapes, exit codes, reports, and bad input as one line + exit 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcheck.checker.cli import main
from kvcheck.spec import faults


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_spec_json(capsys) -> None:
    code, out, _ = run(capsys, "spec", "--json")
    data = json.loads(out)
    assert code == 0
    assert [o["name"] for o in data["objects"]] == ["compressed_kv", "tail", "swa_window", "indexer", "on_disk"]
    assert all({"name", "layers", "states", "recovery_condition"} <= set(o) for o in data["objects"])
    assert [f["layer"] for f in data["funnel"]] == [1, 2, 3, 4]
    assert {i["kind"] for i in data["invariants"]} == {"consistency", "safety"}
    names = {i["name"] for i in data["invariants"]}
    assert {"admission_cap", "five_state_routing", "toctou_bound_stable", "graph_topology",
            "refcount_equals_holders", "hit_sound_swa_window"} <= names
    assert data["decisions"] == ["REUSE", "PARTIAL", "PREFETCH", "RECOMPUTE"]
    assert {"lookup", "bind", "use", "append", "compress", "slide", "indexer_sync", "evict",
            "offload_start", "offload_ack", "prefetch_start", "prefetch_complete", "checksum_fail",
            "corrupt", "bump_model", "bump_abi", "capture", "release_graph", "finish", "preempt",
            "resume"} <= {a["name"] for a in data["actions"]}
    assert data["config"]["block_size"] == 4


def test_faults_json(capsys) -> None:
    code, out, _ = run(capsys, "faults", "--json")
    data = json.loads(out)["faults"]
    assert code == 0 and len(data) >= 12
    assert all({"name", "layer", "bug_class", "mirrors", "expected"} <= set(f) for f in data)
    inv = {i for i in json.loads(run(capsys, "spec", "--json")[1])["invariants"] for i in [i["name"]]}
    assert {f["expected"] for f in data if f["layer"] == "spec" and not f["needs"]} <= inv
    from kvcheck.spec.invariants import INVARIANTS     # a semantic's own: listed where it is on
    assert {f["expected"] for f in data if f["layer"] == "spec" and f["needs"]} <= set(INVARIANTS)


def test_gate_clean_writes_reports(capsys, tmp_path) -> None:
    code, out, _ = run(capsys, "gate", "--out", str(tmp_path), "--json")
    rep = json.loads(out)
    assert code == 0 and rep["verdict"] == "holds"
    walk = rep["engines"]["walk"]
    assert walk["steps"] >= 10_000
    assert all(v > 0 for v in walk["coverage"]["decisions"].values())
    assert json.loads((tmp_path / "report.json").read_text())["exit_code"] == 0
    md = (tmp_path / "report.md").read_text()
    assert "# kvcheck gate: holds" in md and "| REUSE |" in md
    x = rep["engines"]["exhaustive_reference"]          # every reference program up to 4 steps
    assert x["exit_code"] == 0 and x["exhaustive"]["complete"] and x["exhaustive"]["depth"] == 4, x
    assert "## Exhaustive small scope of the reference engine" in md and "holds: exhaustive to depth 4" in md
    (c,) = [c for c in rep["checks"] if c["engine"] == "exhaustive"]
    assert c["check"] == "depth_4" and c["verdict"] == "passed" and c["counts"]["programs"] > 1000, c


def test_gate_below_minimum_coverage_is_undecided(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVCHECK_GATE_CHECKERS", "0")     # the walk's own minimum; prove/explore tested elsewhere
    code, out, _ = run(capsys, "gate", "--out", str(tmp_path), "--steps", "50")
    assert code == 3 and "coverage below the minimum" in out


def test_gate_with_fault_fails_prints_trace_and_replays(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVCHECK_GATE_CHECKERS", "0")
    code, out, _ = run(capsys, "gate", "--out", str(tmp_path), "--fault", "eviction_ignores_pins")
    assert code == 10
    assert "expected toctou_bound_stable -> caught" in out
    assert "replay: kvcheck replay" in out
    rep = json.loads((tmp_path / "report.json").read_text())
    trace = rep["violation"]["trace"]
    code, out, _ = run(capsys, "replay", trace)
    assert code == 10 and "toctou_bound_stable" in out
    code, out, _ = run(capsys, "replay", trace, "--sut", "spec", "--json")
    assert code == 10 and json.loads(out)["violation"]["invariants"]


@pytest.mark.parametrize("argv, msg", [
    (["gate", "--fault", "no_such_fault"], "unknown fault 'no_such_fault'"),
    (["gate", "--config", "/nonexistent/cfg.json"], "cannot read"),
    (["spec", "--config", "BAD_JSON"], "not valid JSON"),
    (["spec", "--config", "UNKNOWN_KEY"], "unknown key"),
    (["spec", "--config", "WINDOW0"], "window must be >= 1"),
    (["replay", "/nonexistent/trace.json"], "cannot read trace"),
    (["replay", "BAD_JSON"], "not valid JSON"),
    (["replay", "NOT_A_TRACE"], "not a kvcheck trace"),
])
def test_bad_input_is_one_line_exit_2(argv, msg, tmp_path) -> None:
    files = {"BAD_JSON": "{oops", "UNKNOWN_KEY": '{"blockz": 3}',
             "WINDOW0": '{"layers": [{"kind": "swa", "window": 0}]}', "NOT_A_TRACE": '{"steps": []}'}
    argv = list(argv)
    for i, a in enumerate(argv):
        if a in files:
            p = tmp_path / f"{a}.json"
            p.write_text(files[a])
            argv[i] = str(p)
    proc = subprocess.run([sys.executable, "-m", "kvcheck", *argv], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert msg in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_unwritable_out_dir_is_exit_2(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("keep me")
    proc = subprocess.run([sys.executable, "-m", "kvcheck", "gate", "--out", str(blocker / "sub")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "cannot write to output directory" in proc.stderr
    assert blocker.read_text() == "keep me"


def test_every_spec_fault_is_listed_with_an_existing_expected_check() -> None:
    from kvcheck.spec.invariants import INVARIANTS
    for f in faults.spec_faults():
        assert f.expected in INVARIANTS, f.name
