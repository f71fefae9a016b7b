"""Issue 19, "what was seen": each bad input a new user tried is exit 2 with one clear line.

Every case here failed before the fix (a traceback, a wrong exit code, a misleading message or a
silently accepted value); the message checks pin what the line must name.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from badinput import assert_bad_input, run, trace_dict, write

NON_UTF8 = b'{"blocks": 2, "x": "\xff\xfe"}'


# ---- tracebacks before ---------------------------------------------------------------------

def test_non_utf8_config_trace_and_report(capsys, tmp_path) -> None:
    bad = write(tmp_path / "bad.json", NON_UTF8)
    assert_bad_input(*run(capsys, "spec", "--config", str(bad))[::2], "not UTF-8")
    assert_bad_input(*run(capsys, "replay", str(bad))[::2], "not UTF-8")
    rep = tmp_path / "rep"
    rep.mkdir()
    write(rep / "report.json", NON_UTF8)
    assert_bad_input(*run(capsys, "report", "--in", str(rep))[::2], "not UTF-8")


@pytest.mark.parametrize("cfg, needle", [
    ({"tiers": 5}, "tiers must be a list"),
    ({"tiers": "device"}, "tiers must be a list"),          # was "unknown tier 'd'"
    ({"layers": [{"kind": "swa", "window": {"a": 1}}]}, "layers[0].window must be an integer"),
    ({"seed": "x"}, "seed must be an integer"),
    ({"block_size": 10 ** 12}, "block_size must be <= 4096"),
    ({"block_size": "4"}, "block_size must be an integer"),  # was "'<' not supported ..."
    ({"capacity": {"tail": "x"}}, "capacity[tail] must be an integer"),
    ({"max_inflight": 2.5}, "max_inflight must be an integer"),
    ({"layers": [{"kind": 5}]}, "layers[0].kind"),
])
def test_config_values_are_validated_by_name(capsys, tmp_path, cfg, needle) -> None:
    p = write(tmp_path / "c.json", cfg)
    assert_bad_input(*run(capsys, "spec", "--config", str(p))[::2], needle)


def test_seed_string_is_bad_input_not_a_finding(capsys, tmp_path) -> None:
    """`"seed": "x"` used to reach the reference engine and come back as a false finding (13)."""
    p = write(tmp_path / "c.json", {"seed": "x"})
    code, _, err = run(capsys, "fuzz", "--sut", "reference", "--config", str(p), "--budget", "5",
                       "--out", str(tmp_path / "o"))
    assert_bad_input(code, err, "seed must be an integer")
    assert not (tmp_path / "o").exists()        # refused before anything is written


def test_explore_graph_under_a_missing_directory_and_at_a_directory(capsys, tmp_path) -> None:
    graph = tmp_path / "missing" / "deeper" / "g.graphml"
    out = tmp_path / "out"
    for extra in ([], ["--max-states", "10"]):     # refused before any work, whatever the budget
        code, _, err = run(capsys, "explore", "--graph", str(graph), *extra)
        assert_bad_input(code, err, "does not exist")
        assert not (tmp_path / "missing").exists()  # nothing created
    graph = tmp_path / "g.graphml"                # an existing directory: the run goes ahead
    code, _, err = run(capsys, "explore", "--fault", "window_off_by_one", "--graph", str(graph),
                       "--out", str(out))
    assert code == 10, err                       # the planted fault is found, and
    assert graph.exists() and (out / "explore.json").exists()   # both files are written
    assert json.loads((out / "explore.json").read_text())["exit_code"] == 10
    (out / "explore.json").unlink()
    code, _, err = run(capsys, "explore", "--fault", "window_off_by_one", "--graph", str(tmp_path),
                       "--out", str(out))
    assert_bad_input(code, err, "is a directory")
    assert not (out / "explore.json").exists()   # refused before any work


def test_explore_graph_with_an_unknown_suffix(capsys, tmp_path) -> None:
    code, _, err = run(capsys, "explore", "--graph", str(tmp_path / "g.txt"))
    assert_bad_input(code, err, ".graphml or .dot")
    assert not (tmp_path / "g.txt").exists()     # it used to write GraphML there silently


@pytest.fixture
def user_suts(tmp_path, monkeypatch) -> str:
    mod = "kvcheck_badsut_" + tmp_path.name.replace("-", "_")
    (tmp_path / f"{mod}.py").write_text(
        "class Raises:\n"
        "    def __init__(self, fault=None):\n"
        "        raise RuntimeError('no device here')\n"
        "not_a_class = 42\n"
        "def a_function(fault=None):\n"
        "    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return mod


@pytest.mark.parametrize("attr, needle", [("Raises", "raised RuntimeError: no device here"),
                                          ("not_a_class", "not a class"),
                                          ("a_function", "not a class")])
def test_user_sut_that_cannot_be_built(capsys, tmp_path, user_suts, attr, needle) -> None:
    code, _, err = run(capsys, "fuzz", "--sut", f"{user_suts}:{attr}", "--budget", "20",
                       "--out", str(tmp_path / "o"))
    assert_bad_input(code, err, needle)
    trace = write(tmp_path / "t.json", trace_dict())
    code, _, err = run(capsys, "replay", str(trace), "--sut", f"{user_suts}:{attr}")
    assert_bad_input(code, err, needle)


@pytest.mark.parametrize("over, needle", [
    ({"steps": [{"action": "submit", "params": {"r": 0, "n": 1}, "expect": [1, 2]}]}, "expect must be an object"),
    ({"steps": [{"action": "no_such_action", "params": {}}]}, "unknown action 'no_such_action'"),
    ({"steps": [{"action": "submit", "params": {"r": 7, "n": 1}}]}, "not an instance of submit"),
    ({"steps": [{"action": "submit", "params": {"r": 0.5, "n": 1}}]}, "params.r must be an integer or a name"),
    ({"steps": [{"action": "submit", "params": {"r": 0, "n": 1},
                 "expect": {"violations": "x"}}]}, "expect.violations"),
    ({"fault": ["x"]}, "'fault' has the wrong type"),
    ({"meta": {"sut_fault": 3}}, "meta.sut_fault"),
])
def test_malformed_traces_are_bad_input_not_conformance(capsys, tmp_path, over, needle) -> None:
    """They used to exit 13 (a spec/SUT mismatch) or raise."""
    p = write(tmp_path / "t.json", trace_dict(**over))
    assert_bad_input(*run(capsys, "replay", str(p))[::2], needle)


def test_a_valid_trace_still_replays(capsys, tmp_path) -> None:
    p = write(tmp_path / "t.json", trace_dict())
    code, out, err = run(capsys, "replay", str(p), "--json")
    assert code == 0, err
    assert json.loads(out)["exit_code"] == 0


def _report_dir(tmp_path: Path, report) -> Path:
    d = tmp_path / "rep"
    d.mkdir(exist_ok=True)
    write(d / "report.json", report)
    return d


def test_report_json_that_is_a_list(capsys, tmp_path) -> None:
    d = _report_dir(tmp_path, [1, 2])
    assert_bad_input(*run(capsys, "report", "--in", str(d))[::2], "expected a JSON object")


def test_report_json_without_a_verdict(capsys, tmp_path) -> None:
    d = _report_dir(tmp_path, {"exit_code": 0})
    code, out, err = run(capsys, "report", "--in", str(d))
    assert_bad_input(code, err, "'verdict'")
    assert "verdict: None" not in out and not (d / "summary.md").exists()


def test_report_html_onto_a_directory(capsys, tmp_path) -> None:
    d = _report_dir(tmp_path, {"verdict": "holds", "exit_code": 0, "engines": {}})
    (d / "report.html").mkdir()
    code, _, err = run(capsys, "report", "--in", str(d), "--html")
    assert_bad_input(code, err, "report.html", "is a directory")
    assert sorted(p.name for p in d.iterdir()) == ["report.html", "report.json"]   # no temp file left


# ---- wrong or misleading before -------------------------------------------------------------

def test_prove_negative_depth(capsys) -> None:
    """--depth=-3 used to say "proved" (bound -1)."""
    assert_bad_input(*run(capsys, "prove", "--depth=-3")[::2], "--depth", "non-negative")


@pytest.mark.parametrize("argv", [["fuzz", "--budget", "10"], ["gate"], ["explore"], ["prove"]])
def test_engine_fault_names_the_sut_that_plants_it(capsys, tmp_path, argv) -> None:
    """`kvcheck faults` lists it, so "unknown fault" was wrong: say which SUT it needs."""
    code, _, err = run(capsys, *argv, "--fault", "engine_tail_check_skipped", *(
        ["--out", str(tmp_path)] if argv[0] in ("fuzz", "gate") else []))
    assert_bad_input(code, err, "engine fault", "--sut reference")
    assert "unknown fault" not in err


def test_out_that_cannot_hold_files(capsys, tmp_path) -> None:
    code, _, err = run(capsys, "fuzz", "--out", "/proc/self", "--budget", "10")
    assert_bad_input(code, err, "/proc/self", "cannot create files there")
    f = write(tmp_path / "f", "keep")
    code, _, err = run(capsys, "gate", "--out", str(f))
    assert_bad_input(code, err, "is a file, not a directory")
    assert f.read_text() == "keep"


def test_db_at_a_regular_file(capsys, tmp_path) -> None:
    f = write(tmp_path / "db", "keep")
    code, _, err = run(capsys, "fuzz", "--db", str(f), "--budget", "10", "--out", str(tmp_path / "o"))
    assert_bad_input(code, err, "--db", "is a file")
    assert f.read_text() == "keep"


def test_argparse_errors_are_one_line(capsys) -> None:
    assert_bad_input(*run(capsys, "fuzz", "--workers", "0")[::2], "--workers")
    assert_bad_input(*run(capsys, "no-such-command")[::2], "invalid choice")


def test_vllm_traces_keep_their_own_actions_and_token_lists() -> None:
    """The spec-step checks apply to traces replayed on the spec; a vLLM trace names the
    adapter's actions with token lists and must still load."""
    from kvcheck.spec.trace import Trace
    t = Trace.from_dict(trace_dict(sut="vllm", steps=[
        {"action": "alloc", "params": {"r": "r1", "tokens": [1, 2, 3], "salt": None}}]))
    assert t.steps[0].params["tokens"] == [1, 2, 3]


def test_replay_reproducer_into_an_unwritable_place_or_for_a_spec_trace_is_one_line(capsys, tmp_path) -> None:
    """`replay --reproducer DIR`: a DIR that cannot be made (here a file) is refused before the
    replay runs, naming the option; a trace that replays on the spec has no engine script."""
    blocker = write(tmp_path / "afile", b"x")
    engine_trace = Path(__file__).resolve().parents[2] / "docs/repro/traces/vllm_async_abort_double_finish.trace.json"
    assert_bad_input(*run(capsys, "replay", str(engine_trace), "--reproducer", str(blocker / "sub"))[::2],
                     "--reproducer", "cannot write there")
    assert blocker.read_bytes() == b"x"
    spec_trace = write(tmp_path / "t.json", json.dumps(trace_dict()).encode())
    assert_bad_input(*run(capsys, "replay", str(spec_trace), "--reproducer", str(tmp_path / "r"))[::2],
                     "--reproducer", "engine traces")
