"""The default gate's exhaustive pass (checker/gate_profiles.py): every reference-engine program
up to a few steps. It must be able to fail (a planted reference fault reachable in a few steps
fails it with a shortest, replayable trace), and it never passes what it did not run (a step
budget spent before the depth is undecided, exit 3)."""
from __future__ import annotations

import json
from pathlib import Path

from kvcheck.checker.gate_profiles import CiProfiles, run_exhaustive_pass
from kvcheck.spec.config import Config


def test_the_clean_reference_holds_to_the_profile_depth_deterministically(tmp_path) -> None:
    p = CiProfiles()
    a = run_exhaustive_pass(Config(), tmp_path, 0, p.exhaustive_depth, p.exhaustive_steps)
    b = run_exhaustive_pass(Config(), tmp_path, 0, p.exhaustive_depth, p.exhaustive_steps)
    assert a["exit_code"] == 0 and a["exhaustive"]["complete"] and a["findings"] == [], a
    assert a["verdict"].startswith("holds: exhaustive to depth 4")
    keys = ("programs", "states", "steps")          # a count budget: the same search every time
    assert [a["exhaustive"][k] for k in keys] == [b["exhaustive"][k] for k in keys]
    assert a["exhaustive"]["steps"] < p.exhaustive_steps / 2     # headroom for slightly larger configs


def test_a_planted_reference_fault_fails_it_with_a_shortest_trace(tmp_path) -> None:
    r = run_exhaustive_pass(Config(), tmp_path, 0, 4, 40_000, fault="engine_hashes_published_early")
    assert r["exit_code"] not in (0, 3) and r["verdict"].startswith("failed: a shortest finding"), r
    (f,) = r["findings"]
    assert Path(f["trace"]).is_file() and "kvcheck replay" in f["replay"] and len(f["trace_steps"]) <= 4
    assert json.loads(Path(f["trace"]).read_text())["steps"]


def test_a_spent_budget_is_undecided_never_a_pass(tmp_path) -> None:
    r = run_exhaustive_pass(Config(), tmp_path, 0, 4, 200)
    assert r["exit_code"] == 3 and not r["exhaustive"]["complete"], r
    assert r["verdict"].startswith("undecided: exhaustive to depth") and "budget" in r["verdict"]


def test_a_project_runs_the_exhaustive_engine_on_its_systems(capsys, tmp_path) -> None:
    """`engines = ["exhaustive"]` on a reference or MODULE:CLASS system, with `depth`: one check
    `depth_K` per system; a budget spent first is undecided (exit 3); bad keys are one line."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
    from badinput import assert_bad_input, run
    root = Path(__file__).resolve().parents[2]
    proj = tmp_path / "kvcheck.toml"
    proj.write_text(f'[systems.reference]\nengines = ["exhaustive"]\ndepth = 3\n\n'
                    f'[systems."examples.seq_adapter:Adapter"]\nengines = ["exhaustive"]\n'
                    f'config = "{root / "examples" / "seq.json"}"\n')
    code, out, err = run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "a"), "--json")
    rep = json.loads(out)
    got = {(c["system"], c["check"]): c for c in rep["checks"] if c["engine"] == "exhaustive"}
    assert code == 0 and set(got) == {("reference", "depth_3"), ("examples.seq_adapter:Adapter", "depth_4")}, got
    assert all(c["verdict"] == "passed" and c["counts"]["complete"] for c in got.values())
    proj.write_text('[systems.reference]\nengines = ["exhaustive"]\nbudget = 100\n')
    code, out, err = run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "b"), "--json")
    (c,) = [c for c in json.loads(out)["checks"] if c["engine"] == "exhaustive"]
    assert code == 3 and c["verdict"] == "undecided" and "budget" in c["note"], c
    for body, needle in [('engines = ["exhaustive"]\ndepth = 0\n', "depth: must be an integer from 1 to 12"),
                         ('engines = ["exhaustive"]\ndepth = "4"\n', "depth: must be an integer from 1 to 12"),
                         ('engines = ["fuzz"]\ndepth = 4\n', "depth: applies to the exhaustive engine only")]:
        proj.write_text("[systems.reference]\n" + body)
        assert_bad_input(*run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "c"))[::2], needle)
