"""`kvcheck matrix`: release selection, the verdict of each cell, the outputs, bad input, and one
real run on the vLLM release installed in kvcheck's own environment.

Everything but the last test is fast: no environment is built and the package index is never
asked (its listing is a fixture); drivers are fabricated JSON lines (matrix_driver's format)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcheck.checker import matrix as mx
from kvcheck.checker import matrix_envs as me
from kvcheck.checker.matrix_report import matrix_data, render_html, render_md, render_text, write_outputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from badinput import assert_bad_input, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
INDEX = ["0.34.0", "0.33.0.post1", "0.33.0", "0.32.0", "0.27.1", "0.27.0", "0.20.0rc1", "0.14.1", "0.14.0",
         "0.8.5.post1", "not-a-version"]
CLAIMED = ("0.14.1", "0.33.0")


def select(selector: str, allow: bool = False, listing=lambda: INDEX) -> list[str]:
    return me.select_releases(selector, "vllm", CLAIMED, listing, allow)


# ---- releases ----------------------------------------------------------------------------------
def test_all_is_every_release_in_the_claimed_range_without_pre_releases() -> None:
    assert select("all") == ["0.14.1", "0.27.0", "0.27.1", "0.32.0", "0.33.0", "0.33.0.post1"]


def test_minors_is_the_newest_patch_or_post_release_of_each_minor() -> None:
    assert select("minors") == ["0.14.1", "0.27.1", "0.32.0", "0.33.0.post1"]


def test_a_range_and_an_explicit_list() -> None:
    assert select("0.27.0..0.32.0") == ["0.27.0", "0.27.1", "0.32.0"]
    assert select("0.33.0.post1..0.33.0.post1") == ["0.33.0.post1"]       # a range from a post release
    assert select("0.32.0..0.33.0") == ["0.32.0", "0.33.0", "0.33.0.post1"]
    assert select(" 0.33.0, 0.14.1,0.33 ", listing=lambda: pytest.fail("explicit releases need no index")) \
        == ["0.14.1", "0.33.0"]


def test_outside_the_claimed_range_is_refused_unless_allowed() -> None:
    for sel in ("0.34.0", "0.14.0,0.20.0", "0.10.0..0.20.0", "0.20.0..0.40.0"):
        with pytest.raises(me.ReleaseError, match="outside the releases kvcheck claims"):
            select(sel)
    assert select("0.34.0", allow=True) == ["0.34.0"]
    assert select("0.14.0..0.14.1", allow=True) == ["0.14.0", "0.14.1"]


@pytest.mark.parametrize("sel", ["", " ", "abc", "0.1..", "..0.2", "0.1..0.2..0.3", "0.30.0..0.20.0", "0.2,,0.3",
                                 "minors,all"])
def test_malformed_selectors_are_one_line_errors(sel) -> None:
    with pytest.raises(me.ReleaseError) as e:
        select(sel)
    assert "\n" not in str(e.value)


def test_the_index_listing_is_parsed_and_its_failure_is_one_line(monkeypatch) -> None:
    def fake(stdout: str, rc: int = 0, stderr: str = ""):
        return lambda *a, **k: subprocess.CompletedProcess(a, rc, stdout, stderr)
    monkeypatch.setattr(me.subprocess, "run", fake("vllm (0.34.0)\nAvailable versions: 0.34.0, 0.33.0, 0.9.0\n"))
    assert me.index_versions("vllm") == ["0.34.0", "0.33.0", "0.9.0"]
    monkeypatch.setattr(me.subprocess, "run", fake("", 1, "WARNING: x\nERROR: No matching distribution found for vllm\n"))
    with pytest.raises(me.ReleaseError, match="cannot list the releases of vllm.*No matching distribution") as e:
        me.index_versions("vllm")
    assert "\n" not in str(e.value)


# ---- cells ---------------------------------------------------------------------------------------
def plan(tmp_path: Path, layouts=("full", "full+swa", "dsv4"), columns=None) -> mx.Plan:
    return mx.Plan(engine="vllm", budget="300", seed=7, out=tmp_path, columns=list(columns or layouts or ["full"]),
                   layouts=list(layouts) if layouts is not None else None)


def release_line(unsupported=None, release="0.33.0", layouts=("full", "full+swa", "dsv4", "gemma3")) -> dict:
    return {"type": "release", "python": "/py", "release": release, "layouts": {k: k for k in layouts},
            "unsupported": unsupported or {}, "out_dir": "/o/vllm-" + release}


def cell(layout: str, code, result=None, traceback=None, stderr="") -> dict:
    return {"type": "cell", "layout": layout, "code": code, "result": result, "traceback": traceback,
            "stderr": stderr, "elapsed_s": 1.0}


def lines(*objs) -> str:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs)


FINDING = {"kind": "safety", "check": "read_before_write", "message": "block 3 read before written",
           "replay": "kvcheck replay /o/t.json --sut vllm", "trace": "/o/t.json", "reproducer": "/o/r.py"}
KNOWN = {"name": "fine_cow_same_step", "status": "finding", "check": "state_copy_sound", "kind": "safety",
         "upstream": "vllm#40000", "reproducer": "/o/k.py"}
CANNOT = {"engine": "vllm", "release": "0.33.0", "what": "KVCacheBlock has no 'block_hash'",
          "where": "kvcheck/engines/vllm/adapter.py:10", "line": "kvcheck cannot drive vllm 0.33.0: ..."}


@pytest.mark.parametrize("c, verdict, short", [
    (cell("full", 0, {"exit_code": 0, "steps": 300}), "clean", "clean"),
    (cell("full", 10, {"exit_code": 10, "findings": [FINDING]}), "finding", "finding: read_before_write"),
    (cell("full", 10, {"exit_code": 10, "findings": [], "known": [KNOWN, dict(KNOWN, status="acknowledged")]}),
     "finding", "finding: fine_cow_same_step (known, vllm#40000)"),
    (cell("full", 3, {"exit_code": 3, "findings": [], "cannot_drive": CANNOT}), "cannot drive", "cannot drive"),
    (cell("full", 3, {"exit_code": 3, "missing_actions": ["preempt"]}), "undecided", "undecided"),
    (cell("full", None, traceback={"line": "KeyError: 'x'", "where": "kvcheck/a.py:3 (f)"}), "error", "error"),
    (cell("full", 2, None, stderr="kvcheck fuzz: error: unknown vLLM layout\n"), "error", "error"),
    # the run itself says the release cannot build it this way (--fuzz-option drive=engine)
    (cell("mixed_block", 2, {"cannot_express": "vLLM 0.16.0's engine derives 4 and 4", "exit_code": 2}),
     "cannot express", "cannot express"),
    (cell("full", 2, {"cannot_express": 7}), "error", "error"),      # (not a line: still an error)
    (cell("full", 1, None, stderr="boom\n"), "error", "error"),
])
def test_each_verdict_from_a_fabricated_result(c, verdict, short) -> None:
    got = mx.classify(c, rerun="RERUN")
    assert (got["verdict"], got["short"]) == (verdict, short)
    assert got["line"] and "\n" not in got["line"]
    if verdict == "finding":
        assert got["finding"]["check"] in ("read_before_write", "state_copy_sound")
    if verdict == "cannot drive":
        assert got["line"] == CANNOT["line"]
    if verdict == "undecided":
        assert "preempt" in got["line"]
    if c["traceback"]:
        assert "KeyError: 'x'" in got["line"] and "kvcheck/a.py:3" in got["line"]


def test_a_row_judges_every_layout_once_and_cannot_express_is_not_run(tmp_path) -> None:
    text = lines(release_line({"dsv4": "vLLM 0.33.0 has no DeepSeek-V4 groups"}), {"type": "start", "layout": "full"},
                 cell("full", 0, {"steps": 300}), {"type": "start", "layout": "full+swa"},
                 cell("full+swa", 11, {"findings": [dict(FINDING, kind="differential", check="reuse_equals_recompute")]}),
                 {"type": "done"})
    row = mx.build_row(text, 0, plan(tmp_path), "/py", "0.33.0")
    assert [c["verdict"] for c in row["cells"].values()] == ["clean", "finding", "cannot express"]
    assert row["cells"]["dsv4"]["line"] == "vLLM 0.33.0 has no DeepSeek-V4 groups"
    assert "--layout full+swa --budget 300 --seed 7 --out /o/vllm-0.33.0" in row["cells"]["full+swa"]["rerun"]
    assert mx.exit_code([row]) == 11


def test_a_cells_rerun_names_the_drive_its_run_resolved(tmp_path) -> None:
    """vLLM's --drive auto resolves per layout: the rerun names the drive that ran (once: a
    --fuzz-option drive=... already does)."""
    text = lines(release_line(), cell("full", 10, {"findings": [FINDING], "drive": "engine",
                                                   "drive_reason": "auto: vLLM's own scheduler"}),
                 cell("full+swa", 0, {"steps": 300, "drive": "mixed"}), cell("dsv4", 0, {"steps": 300}),
                 {"type": "done"})
    cells = mx.build_row(text, 0, plan(tmp_path), "/py", "0.33.0")["cells"]
    assert "--seed 7 --drive engine --out" in cells["full"]["rerun"]
    assert "--seed 7 --drive mixed --out" in cells["full+swa"]["rerun"]
    assert "--drive" not in cells["dsv4"]["rerun"]          # (an engine without drives)
    pinned = mx.Plan(**{**plan(tmp_path).__dict__, "fuzz_args": ["--drive", "engine"]})
    rerun = mx.build_row(text, 0, pinned, "/py", "0.33.0")["cells"]["full"]["rerun"]
    assert rerun.count("--drive") == 1 and "--seed 7 --drive engine --out" in rerun


def test_a_driver_that_dies_mid_way_keeps_the_earlier_cells(tmp_path) -> None:
    text = lines(release_line(), {"type": "start", "layout": "full"}, cell("full", 0, {"steps": 300}),
                 {"type": "start", "layout": "full+swa"})
    row = mx.build_row(text, -9, plan(tmp_path), "/py", "0.33.0", stderr="Killed\n")
    v = {k: (c["verdict"], c["line"]) for k, c in row["cells"].items()}
    assert v["full"][0] == "clean"
    assert v["full+swa"] == ("error", "the driver died (exit -9) while running full+swa: Killed")
    assert v["dsv4"] == ("error", "the driver died (exit -9): Killed")
    assert mx.exit_code([row]) == 3
    cut = text + '{"type": "cell", "layout": "full+sw'          # killed while writing a line
    row = mx.build_row(cut, -9, plan(tmp_path), "/py", "0.33.0")
    assert row["cells"]["full+swa"]["verdict"] == "error" and "unreadable driver output" in row["cells"]["full+swa"]["line"]


def test_a_driver_that_fails_before_listing_and_a_wrong_release(tmp_path) -> None:
    row = mx.build_row("", 1, plan(tmp_path), "/py", "0.20.0", stderr="ModuleNotFoundError: No module named 'kvcheck'\n")
    assert {c["verdict"] for c in row["cells"].values()} == {"error"} and "No module named" in row["error"]
    bad = dict(release_line(release="0.32.0"), error="the environment has vllm 0.32.0, not 0.33.0 as asked")
    row = mx.build_row(lines(bad), 1, plan(tmp_path), "/py", "0.33.0")
    assert row["error"] == bad["error"] and len(row["cells"]) == 3


def test_exit_code_rules(tmp_path) -> None:
    def row(*verdicts_codes):
        return {"cells": {str(i): {"verdict": v, "exit_code": c} for i, (v, c) in enumerate(verdicts_codes)}}
    assert mx.exit_code([row(("clean", 0), ("cannot express", None))]) == 0
    assert mx.exit_code([row(("clean", 0), ("finding", 13)), row(("finding", 10))]) == 13
    for v in ("cannot drive", "undecided", "error"):
        assert mx.exit_code([row(("finding", 10), (v, 3))]) == 3
    assert mx.exit_code([row(("cannot express", None))]) == 3          # nothing ran: nothing proven


# garbage from a driver (or a process writing into its file) is an error cell, never a traceback
JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                       lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                       max_leaves=8)
RECORD = st.fixed_dictionaries(
    {"type": st.sampled_from(["release", "start", "cell", "done", "other"])},
    optional={"layout": st.sampled_from(["full", "full+swa", "dsv4", "x"]) | JSONISH, "code": JSONISH,
              "result": st.dictionaries(st.sampled_from(["findings", "known", "cannot_drive", "missing_actions",
                                                         "steps", "undecided"]), JSONISH, max_size=4) | JSONISH,
              "traceback": st.dictionaries(st.sampled_from(["line", "where"]), JSONISH) | JSONISH,
              "release": JSONISH, "layouts": st.dictionaries(st.sampled_from(["full", "full+swa"]), JSONISH) | JSONISH,
              "unsupported": JSONISH, "error": JSONISH, "out_dir": JSONISH, "stderr": JSONISH})
LINE = st.one_of(st.text(max_size=60), RECORD.map(json.dumps), st.binary(max_size=40).map(lambda b: b.decode("latin-1")))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=st.lists(LINE, max_size=4), after=st.lists(LINE, max_size=4), code=st.sampled_from([0, 1, -9, None]),
       good=st.booleans(), every=st.booleans())
def test_garbage_driver_lines_give_error_cells_never_a_traceback(tmp_path_factory, before, after, code, good,
                                                                  every) -> None:
    p = plan(tmp_path_factory.getbasetemp(), **({"layouts": None, "columns": ["full", "gemma3"]} if every else {}))
    middle = [release_line(), cell("full", 0, {"steps": 1}), {"type": "done"}] if good else []
    text = lines(*before, *middle, *after)
    row = mx.build_row(text, code, p, "/py", "0.33.0")
    if p.layouts is not None:
        assert list(row["cells"]) == p.layouts
    for c in row["cells"].values():
        assert c["verdict"] in mx.VERDICTS and isinstance(c["line"], str) and isinstance(c["short"], str)
    data = matrix_data("vllm", [row], p.columns, command="kvcheck matrix", seed=7, budget="300",
                       code=mx.exit_code([row]))
    json.dumps(data)
    render_text(data), render_md(data), render_html(data)
    records = [r for x in before + after for r in mx.read_lines(x)[0]]
    if not good and not any(r["type"] == "release" for r in records):
        assert {c["verdict"] for c in row["cells"].values()} == {"error"}
    if good and not records and mx.read_lines(text)[1] and p.layouts is not None:
        # garbage around a good driver: the cell it wrote stands, the others are errors naming it
        assert row["cells"]["full"]["verdict"] == "clean"
        assert row["cells"]["full+swa"]["verdict"] == "error"
        assert "unreadable driver output" in row["cells"]["full+swa"]["line"]


# ---- outputs -----------------------------------------------------------------------------------
def _rows(tmp_path):
    p = plan(tmp_path)
    good = mx.build_row(lines(release_line({"dsv4": "no DeepSeek-V4 groups in 0.33.0"}),
                              cell("full", 10, {"findings": [], "known": [KNOWN]}),
                              cell("full+swa", 3, {"cannot_drive": CANNOT}), {"type": "done"}), 0, p, "/py", "0.33.0")
    broken = mx.error_row(p, "0.20.0", None, "environment build failed: install-vllm: no vllm==0.20.0 on the index")
    return p, [broken, good]


def test_markdown_json_and_html_outputs(tmp_path) -> None:
    p, rows = _rows(tmp_path)
    data = matrix_data("vllm", rows, p.columns, command="kvcheck matrix --sut vllm", seed=7, budget="300",
                       code=mx.exit_code(rows))
    paths = write_outputs(data, tmp_path)
    assert [x.name for x in paths] == ["matrix-vllm.json", "matrix-vllm.md", "matrix-vllm.html"]
    back = json.loads(paths[0].read_text())
    assert back["format"] == "kvcheck-matrix/1" and back["seed"] == 7 and back["exit_code"] == 3
    assert [r["release"] for r in back["rows"]] == ["0.20.0", "0.33.0"]
    md = paths[1].read_text()
    assert "| release | `full` | `full+swa` | `dsv4` |" in md
    assert "| 0.20.0 | error [1] | error [1] | error [1] |" in md          # one note for the release
    assert "| 0.33.0 | finding: fine_cow_same_step (known, vllm#40000) [2] | cannot drive [3] | cannot express |" in md
    assert "- [1] 0.20.0 full, full+swa, dsv4: error: environment build failed" in md
    assert "## Legend" in md and "## Findings" in md and "reproducer: `/o/k.py`" in md
    assert CANNOT["line"] in md and "no vllm==0.20.0" in md and "no DeepSeek-V4 groups" in md
    html = paths[2].read_text()
    for cls in ("v-finding", "v-cannot-drive", "v-cannot-express", "v-error"):
        assert f"class='v {cls}'" in html
    text = render_text(data)
    assert "fine_cow_same_step" in text and "seed 7" in text and "rerun the cell: PYTHONPATH=" in text


# ---- environments and drivers (fake interpreters and install scripts) -------------------------
def script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_an_environment_is_reused_built_or_its_build_failure_is_one_line(tmp_path) -> None:
    envs = tmp_path / "envs"
    install = script(tmp_path / "install.sh", 'mkdir -p "$2/bin"; printf \'#!/bin/sh\\necho %s\\n\' "$1" > "$2/bin/python"; '
                     'chmod +x "$2/bin/python"; echo "install: vllm $1 in $2 (PYTHON=$PYTHON)"\n')
    env = me.ensure_env("vllm", "vllm", str(install), "0.33.0", envs)
    assert env.built and env.error is None and env.python == str(envs / "vllm-0.33.0" / "bin" / "python")
    assert env.summary.startswith("install: vllm 0.33.0") and f"PYTHON={sys.executable}" in env.summary
    again = me.ensure_env("vllm", "vllm", str(tmp_path / "missing.sh"), "0.33.0", envs)
    assert not again.built and again.python == env.python          # reused: the script is not even run
    bad = script(tmp_path / "bad.sh", 'echo "pip noise"; echo "install-vllm: no vllm==$1 on the package index" >&2; exit 2\n')
    env = me.ensure_env("vllm", "vllm", str(bad), "0.20.0", envs)
    assert env.python is None and env.error == "environment build failed: install-vllm: no vllm==0.20.0 on the package index"


def test_the_install_scripts_retry_pip_and_quote_its_last_words(tmp_path) -> None:
    """scripts/pip-lib.sh, which every install-*.sh sources: a failed pip try is retried (a 500 MB
    wheel's download that drops), and a failure quotes pip's log, which ensure_env keeps."""
    lib = Path(me.ROOT) / "scripts" / "pip-lib.sh"
    fake = script(tmp_path / "python", 'n=$(cat "$0.n" 2>/dev/null || echo 0); echo $((n+1)) > "$0.n"\n'
                  '[ "$n" -ge 1 ] && exit 0; echo "ERROR: HTTP error 503"; exit 1\n')
    body = f'NAME=install-x; log={tmp_path}/log; . "{lib}"; sleep() {{ :; }}\n'
    ok = subprocess.run(["bash", "-c", body + f'pip_install "{fake}" x==1 && echo installed'],
                        capture_output=True, text=True)
    assert ok.stdout.strip() == "installed" and (tmp_path / "python.n").read_text().strip() == "2"
    (tmp_path / "python.n").write_text("-5\n")                    # fails three times: gives up
    bad = subprocess.run(["bash", "-c", body + f'pip_install "{fake}" x==1 || fail "cannot install x==1"'],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and (tmp_path / "python.n").read_text().strip() == "-2"
    assert me.script_error(bad.stderr) == "install-x: cannot install x==1 (pip log: " + f"{tmp_path}/log); pip: ERROR: HTTP error 503"
    assert "(try 3 of 3)" in bad.stderr


def test_a_driver_that_hangs_is_stopped_and_one_that_is_interrupted_says_so(tmp_path, monkeypatch) -> None:
    import threading
    hang = script(tmp_path / "py", "sleep 60\n")
    monkeypatch.setattr(mx, "FIRST_LINE_TIMEOUT_S", 1.0)
    text, code, note, _ = mx.run_driver(str(hang), plan(tmp_path), "vllm-x", None, threading.Event())
    assert (text, code) == ("", None) and note == "the driver timed out (no result in 1s)"
    row = mx.build_row(text, code, plan(tmp_path), str(hang), "0.33.0", note=note)
    assert {c["line"] for c in row["cells"].values()} == {"the driver timed out (no result in 1s)"}
    stop = threading.Event()
    stop.set()
    assert mx.run_driver(str(hang), plan(tmp_path), "vllm-x", None, stop)[2] == "interrupted"
    garbage = script(tmp_path / "py2", f'echo "not json" >> {tmp_path}/drivers/vllm-y.jsonl; '
                     'echo "Segmentation fault" >&2; exit 139\n')
    text, code, note, err = mx.run_driver(str(garbage), plan(tmp_path), "vllm-y", None, threading.Event())
    row = mx.build_row(text, code, plan(tmp_path), str(garbage), "0.33.0", note=note, stderr=err)
    assert code == 139 and {c["verdict"] for c in row["cells"].values()} == {"error"}
    assert "unreadable driver output (line 1: 'not json')" in row["error"]


def test_the_driver_records_each_cell_and_a_traceback_in_one_process(tmp_path, monkeypatch) -> None:
    """matrix_driver in this process, kvcheck's command line faked: a layout the release cannot
    express is not run, a cannot-drive result and a raised exception are each one cell."""
    from kvcheck.checker import cli, matrix_driver
    calls = []

    def main(argv):
        calls.append(argv[:4])
        if argv[0] == "engines":
            print(json.dumps({"engines": [{"name": "vllm", "release": "0.33.0", "layouts": {"full": "", "full+swa": "",
                                                                                          "dsv4": ""},
                                           "unsupported": {"dsv4": "no DeepSeek-V4 groups"}}]}))
            return 0
        if argv[4] == "full":
            print("a stray line from the engine")
            print(json.dumps({"exit_code": 3, "findings": [], "cannot_drive": CANNOT, "coverage": {"x": 1}}, indent=1))
            return 3
        raise KeyError("slot")
    monkeypatch.setattr(cli, "main", main)
    spec = {"lines": str(tmp_path / "l.jsonl"), "sut": "vllm", "budget": "300", "seed": 7, "out": str(tmp_path),
            "layouts": None, "expected": "0.33"}
    assert matrix_driver.run(spec) == 0
    assert [c[:2] for c in calls] == [["engines", "vllm"], ["fuzz", "--sut"], ["fuzz", "--sut"]]
    row = mx.build_row((tmp_path / "l.jsonl").read_text(), 0, plan(tmp_path, layouts=None), "/py", "0.33.0")
    v = {k: c["verdict"] for k, c in row["cells"].items()}
    assert v == {"full": "cannot drive", "full+swa": "error", "dsv4": "cannot express"}
    assert row["out_dir"] == str(tmp_path / "vllm-0.33.0")
    assert row["cells"]["full+swa"]["line"].startswith("KeyError: 'slot' (at ") and "test_matrix.py" in row["cells"]["full+swa"]["line"]
    spec["expected"] = "0.32.0"                       # an environment holding another release
    assert matrix_driver.run(dict(spec, lines=str(tmp_path / "m.jsonl"))) == 1
    row = mx.build_row((tmp_path / "m.jsonl").read_text(), 1, plan(tmp_path), "/py", "0.32.0")
    assert row["error"] == "the environment has vllm 0.33.0, not 0.32.0 as asked"


# ---- the command line ---------------------------------------------------------------------------
@pytest.fixture
def fake_engine_runs(monkeypatch, tmp_path):
    """Builds and drivers faked: 0.20.0 fails to build, 0.33.0 runs the fabricated lines."""
    def build(engine, dist, script, release, envs, **_):
        if release == "0.20.0":
            return me.Env(release, str(envs / "x"), None, error="environment build failed: install-vllm: no vllm==0.20.0")
        return me.Env(release, str(envs / "y"), sys.executable, built=True)
    seen = []

    def drive(python, plan, label, expected, stop):
        seen.append((python, label, expected, plan.layouts))
        return lines(release_line(release=expected), cell("full", 0, {"steps": 300}),
                     cell("full+swa", 13, {"findings": [dict(FINDING, kind="conformance")]}), {"type": "done"}), 0, None, ""
    monkeypatch.setattr(mx, "ensure_env", build)
    monkeypatch.setattr(mx, "run_driver", drive)
    return seen


def test_the_command_with_faked_builds_and_drivers(capsys, tmp_path, fake_engine_runs) -> None:
    out = tmp_path / "m"
    code, stdout, _ = run(capsys, "matrix", "--sut", "vllm", "--releases", "0.33.0,0.20.0", "--layouts",
                          "full,full+swa", "--budget-per-cell", "300", "--envs", str(tmp_path / "envs"),
                          "--out", str(out), "--json")
    assert code == 3                                   # 0.20.0 did not build: not proven
    data = json.loads(stdout)
    assert [(r["release"], {k: c["verdict"] for k, c in r["cells"].items()}) for r in data["rows"]] == [
        ("0.20.0", {"full": "error", "full+swa": "error"}), ("0.33.0", {"full": "clean", "full+swa": "finding"})]
    assert fake_engine_runs == [(sys.executable, "vllm-0.33.0", "0.33.0", ["full", "full+swa"])]
    assert (out / "matrix-vllm.md").is_file() and (out / "matrix-vllm.html").is_file()
    code, stdout, _ = run(capsys, "matrix", "--sut", "vllm", "--releases", "0.33.0", "--layouts", "full,full+swa",
                          "--envs", str(tmp_path / "envs"), "--out", str(out))
    assert code == 13 and "finding: read_before_write [1]" in stdout and "replay: kvcheck replay" in stdout


@pytest.mark.parametrize("argv, needle", [
    (["--sut", "nosuch"], "unknown engine 'nosuch'"),
    (["--sut", "reference"], "declares no distribution"),
    (["--sut", "vllm", "--releases", "0.3x"], "not a release number"),
    (["--sut", "vllm", "--releases", "0.40.0"], "outside the releases kvcheck claims"),
    (["--sut", "vllm", "--releases", "0.33.0..0.20.0"], "is newer than"),
    (["--sut", "vllm", "--budget-per-cell", "abc"], "--budget-per-cell"),
    (["--sut", "vllm", "--budget-per-cell", "0.0001s"], "shorter than one step"),
    (["--sut", "vllm", "--layouts", "full,nosuch"], "unknown vllm layout 'nosuch'"),
    (["--sut", "vllm", "--layouts", "full,"], "empty entry"),
    (["--sut", "vllm", "--releases", "minors", "--python", sys.executable], "--releases and --python"),
    (["--sut", "vllm", "--python", "/no/such/python"], "no such interpreter"),
    (["--sut", "vllm", "--python", sys.executable, "--envs", "/tmp"], "nothing is built"),
    (["--sut", "vllm", "--workers", "0"], "positive integer"),
    (["--releases", "all"], "required: --sut"),
    (["--sut", "vllm", "--fuzz-option", "drive"], "expected NAME=VALUE"),
    (["--sut", "vllm", "--fuzz-option", "layout=full"], "takes acknowledge, drive"),
    (["--sut", "vllm", "--fuzz-option", "nosuch=1"], "'nosuch'"),
    (["--sut", "vllm", "--fuzz-option", "strict_reuse=maybe"], "expected true or false"),
])
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, argv, needle) -> None:
    code, _, err = run(capsys, "matrix", *argv, "--out", str(tmp_path / "o"), *(
        ["--envs", str(tmp_path / "e")] if "--python" not in argv and "--envs" not in argv else []))
    assert_bad_input(code, err, needle)
    assert not (tmp_path / "e").exists() or not any((tmp_path / "e").iterdir())


def test_unwritable_out_envs_and_an_unreachable_index(capsys, tmp_path, monkeypatch) -> None:
    f = tmp_path / "file"
    f.write_text("")
    code, _, err = run(capsys, "matrix", "--sut", "vllm", "--releases", "0.33.0", "--out", str(f), "--envs", str(tmp_path))
    assert_bad_input(code, err, "is a file")
    code, _, err = run(capsys, "matrix", "--sut", "vllm", "--releases", "0.33.0", "--out", str(tmp_path / "o"),
                       "--envs", str(f / "sub"))
    assert_bad_input(code, err, "--envs")

    def down(*a, **k):
        raise me.ReleaseError("cannot list the releases of vllm on the package index (ERROR: network down)")
    monkeypatch.setattr(me, "index_versions", down)
    code, _, err = run(capsys, "matrix", "--sut", "vllm", "--out", str(tmp_path / "o"), "--envs", str(tmp_path / "e"))
    assert_bad_input(code, err, "cannot list the releases of vllm")


# ---- the real thing: vLLM as installed in kvcheck's environment -------------------------------
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed in this environment")
def test_a_real_matrix_on_the_installed_vllm(capsys, tmp_path) -> None:
    out = tmp_path / "m"
    py = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
    code, stdout, err = run(capsys, "matrix", "--sut", "vllm", "--python", py, "--layouts", "full,full+swa,generated",
                            "--budget-per-cell", "1500", "--out", str(out), "--json", "--fuzz-option", "drive=engine")
    data = json.loads(stdout)
    (row,) = data["rows"]
    assert row["release"] and list(row["cells"]) == ["full", "full+swa", "generated"], (row, err)
    assert data["fuzz_args"] == ["--drive", "engine"] and "--fuzz-option drive=engine" in data["command"]
    gen = row["cells"]["generated"]            # the grammar's layouts too, through vLLM's own scheduler
    assert gen["verdict"] in ("clean", "finding"), gen
    for c in row["cells"].values():
        assert c["verdict"] in ("clean", "finding"), (c, err)
        assert f"--layout {c['layout']} --budget 1500 --seed 0 --drive engine" in c["rerun"]
    # every cell ran through vLLM's own scheduler: its traces and results say so
    lines = [json.loads(x) for x in next((out / "drivers").glob("*.jsonl")).read_text().splitlines()]
    cell = next(x for x in lines if x["type"] == "cell" and x["layout"] == "full")
    assert cell["code"] in (0, 10, 11, 12, 13) and cell["result"]["steps"] == 1500
    assert code == mx.exit_code(data["rows"]) and code in (0, 10, 11, 12, 13)
    for name in ("matrix-vllm.json", "matrix-vllm.md", "matrix-vllm.html"):
        assert (out / name).stat().st_size > 0
    assert (out / "drivers").is_dir() and (out / f"vllm-{row['release']}").is_dir()


def test_patches_and_rotate_pick_releases_by_x_y_z():
    from kvcheck.checker.matrix_envs import ReleaseError, select_releases
    index = ["0.4.10", "0.4.10.post2", "0.5.1", "0.5.1.post3", "0.5.2", "0.5.3rc1", "0.5.14", "0.5.23", "0.6.0"]
    pick = lambda sel: select_releases(sel, "sglang", ("0.4.10", "0.5.23"), lambda: index)  # noqa: E731
    assert pick("patches") == ["0.4.10.post2", "0.5.1.post3", "0.5.2", "0.5.14", "0.5.23"]
    assert pick("minors") == ["0.4.10.post2", "0.5.23"]
    inner = ["0.5.1.post3", "0.5.2", "0.5.14"]             # never the range's own ends
    assert {pick(f"rotate:{k:x}")[0] for k in range(12)} == set(inner)
    assert pick("rotate:c04379e") == pick("rotate:c04379e") and len(pick("rotate:c04379e")) == 1
    with pytest.raises(ReleaseError, match="hex key"):
        pick("rotate:zz")


def test_ci_matrix_gate_fails_on_cannot_drive_and_error_only(tmp_path):
    """scripts/matrix_gate.py (.ci/run): a cannot-drive or error cell fails CI; findings and
    undecided cells are reported; no result at all fails."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]

    def gate(rows) -> int:
        p = tmp_path / "m.json"
        p.write_text(json.dumps({"engine": "sglang", "rows": rows}))
        return subprocess.run([sys.executable, str(root / "scripts/matrix_gate.py"), str(p)],
                              capture_output=True, text=True).returncode
    cell = lambda v: {"verdict": v, "line": f"a {v} line"}  # noqa: E731
    ok = {"release": "0.5.14", "cells": {"radix": cell("clean"), "swa": cell("finding"), "chunk": cell("undecided")}}
    assert gate([ok]) == 0
    assert gate([ok, {"release": "0.5.9", "cells": {"radix": cell("cannot drive")}}]) == 1
    assert gate([{"release": "0.5.9", "cells": {"radix": cell("error")}}]) == 1
    assert gate([{"release": "0.5.9", "error": "the environment did not build", "cells": {}}]) == 1
    assert gate([]) == 1
    assert subprocess.run([sys.executable, str(root / "scripts/matrix_gate.py"), str(tmp_path / "none.json")],
                          capture_output=True).returncode == 1


def test_resume_keeps_only_cells_finished_under_the_same_key_on_the_same_release(tmp_path, monkeypatch) -> None:
    from kvcheck.checker import cli, matrix_driver
    p = mx.Plan(**{**plan(tmp_path, layouts=None).__dict__, "resume": True})
    spec = {"budget": p.budget, "seed": p.seed, "cell": p.cell_args, "fuzz_args": p.fuzz_args}
    key = mx.cell_key(spec)
    old = tmp_path / "old.jsonl"
    old.write_text(lines(release_line(), dict(cell("full", 0, {"exit_code": 0, "steps": 300}), release="0.33.0", key=key),
                         dict(cell("full+swa", 0, {"exit_code": 0}), release="0.33.0",
                              key=mx.cell_key(dict(spec, budget="999"))),          # another budget
                         dict(cell("dsv4", None, traceback={"line": "KeyError", "where": "x"}), release="0.33.0", key=key),
                         "garbage"))
    kept = mx.kept_cells(old, spec)
    assert [c["layout"] for c in kept] == ["full"]
    assert mx.kept_cells(tmp_path / "missing.jsonl", spec) == []
    calls = []

    def main(argv):
        calls.append(argv[:5])
        if argv[0] == "engines":
            print(json.dumps({"engines": [{"name": "vllm", "release": "0.33.0", "unsupported": {},
                                           "layouts": {"full": "", "full+swa": ""}}]}))
            return 0
        print(json.dumps({"exit_code": 0, "steps": 300}))
        return 0
    monkeypatch.setattr(cli, "main", main)
    out = tmp_path / "l.jsonl"
    out.write_text(lines(*kept))
    assert matrix_driver.run(dict(spec, lines=str(out), sut="vllm", out=str(tmp_path), layouts=None,
                                  kept={"full": "0.33.0"})) == 0
    assert [c[4] for c in calls[1:]] == ["full+swa"]                 # full was kept, not run again
    row = mx.build_row(out.read_text(), 0, p, "/py", "0.33.0")
    assert {k: c["verdict"] for k, c in row["cells"].items()} == {"full": "clean", "full+swa": "clean"}
    calls.clear()                                                    # kept on another release: run again
    assert matrix_driver.run(dict(spec, lines=str(tmp_path / "m.jsonl"), sut="vllm", out=str(tmp_path),
                                  layouts=None, kept={"full": "0.32.0"})) == 0
    assert [c[4] for c in calls[1:]] == ["full", "full+swa"]


def test_run_driver_with_resume_hands_the_kept_cells_to_the_driver_and_keeps_them_in_the_file(tmp_path) -> None:
    import threading
    from kvcheck.checker import matrix_driver
    p = mx.Plan(**{**plan(tmp_path, layouts=None).__dict__, "resume": True})
    key = mx.cell_key({"budget": p.budget, "seed": p.seed, "cell": p.cell_args, "fuzz_args": p.fuzz_args})
    (tmp_path / "drivers").mkdir()
    (tmp_path / "drivers" / "vllm-r.jsonl").write_text(
        lines(dict(cell("full", 0, {"exit_code": 0, "steps": 300}), release="0.33.0", key=key)))
    fake = script(tmp_path / "py", f'echo "$3" > {tmp_path}/spec.json\n')     # records the spec it was given
    text, code, _, _ = mx.run_driver(str(fake), p, "vllm-r", "0.33.0", threading.Event())
    assert json.loads((tmp_path / "spec.json").read_text())["kept"] == {"full": "0.33.0"}
    assert code == 0 and '"layout": "full"' in text
    p.resume = False                                                  # without --resume: a fresh file
    text, _, _, _ = mx.run_driver(str(fake), p, "vllm-r", "0.33.0", threading.Event())
    assert text == "" and json.loads((tmp_path / "spec.json").read_text())["kept"] == {}


def test_the_markdown_reads_each_layout_across_releases_as_runs(tmp_path) -> None:
    from kvcheck.checker.matrix_report import runs
    p = plan(tmp_path, layouts=("full", "dsv4", "gemma3"))
    rows = []
    for rel, full in (("0.20.0", 10), ("0.21.0", 10), ("0.22.0", 0), ("0.23.0", 10)):
        text = lines(release_line({"dsv4": "no V4 groups"}, release=rel), cell("full", full, {"exit_code": full, "steps": 300, "findings":
                                                                   [FINDING] if full else []}),
                     cell("gemma3", 0, {"exit_code": 0, "steps": 300}), {"type": "done"})
        rows.append(mx.build_row(text, 0, p, "/py", rel))
    data = matrix_data("vllm", rows, p.columns, command="kvcheck matrix", seed=0, budget="300", code=10)
    varied, clean = runs(data)
    assert clean == ["gemma3"]
    assert dict(varied)["full"] == [("0.20.0", "0.21.0", "finding: read_before_write"), ("0.22.0", "0.22.0", "clean"),
                                   ("0.23.0", "0.23.0", "finding: read_before_write")]
    assert dict(varied)["dsv4"] == [("0.20.0", "0.23.0", "cannot express")]
    md = render_md(data)
    assert "| `full` | 0.20.0–0.21.0: finding: read_before_write; 0.22.0: clean; 0.23.0: finding" in md
    assert "Clean on every release that has it (1): `gemma3`." in md


def test_the_runs_across_releases_name_a_known_defect_by_its_name_alone() -> None:
    """The upstream text of a known defect may be worded anew between two releases' runs (a long
    matrix over several sittings): the runs compare verdicts by the defect's name, so one verdict
    stays one run; an unexplained finding beside it stays visible."""
    from kvcheck.checker import matrix_report as rep
    old, new = "finding: m (known, x#1, #2 (PR #3))", "finding: m (known, x#1 (fixed 5.7), #2)"
    rows = [{"release": r, "cells": {"mamba": {"short": s}}} for r, s in
            (("5.0.0", old), ("5.1.0", new), ("5.2.0", new + " (+1 known)"), ("5.3.0", new + " +1"),
             ("5.4.0", "clean"))]
    varied, clean = rep.runs({"layouts": ["mamba"], "rows": rows})
    assert clean == [] and [v for _, _, v in varied[0][1]] == [
        "finding: m (known)", "finding: m (known) (+1 known)", "finding: m (known) +1", "clean"]
    assert varied[0][1][0][:2] == ("5.0.0", "5.1.0")
