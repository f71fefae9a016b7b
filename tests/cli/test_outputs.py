"""Outputs are written atomically and with the mode the umask gives a plain `open()`: a temp
file + rename used to leave every report 0600, unreadable by a CI uploader or web server
running as another user."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from badinput import run


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_report_and_explore_outputs_honour_the_umask(capsys, tmp_path, umask) -> None:
    out = tmp_path / "out"
    code, _, err = run(capsys, "explore", "--fault", "window_off_by_one", "--out", str(out),
                       "--graph", str(out / "g.dot"))
    assert code == 10, err
    code, _, err = run(capsys, "report", "--in", str(out), "--html")
    assert code == 0, err
    files = [p for p in out.iterdir() if p.is_file() and p.suffix != ".png"]   # png: graphviz's own
    assert {"explore.json", "summary.md", "report.html", "g.dot"} <= {p.name for p in files}
    assert any(p.name.startswith("explore-counterexample") for p in files)
    for p in files:
        assert _mode(p) == 0o666 & ~umask, (p.name, oct(_mode(p)))
    assert not [p for p in out.iterdir() if p.name.startswith(".")]    # no temp file left


def test_trace_and_reproducer_honour_the_umask(tmp_path, umask) -> None:
    from kvcheck.spec.outputs import write_atomic
    from kvcheck.spec.trace import Trace
    from kvcheck.spec.config import Config
    p = Trace(Config(), []).save(tmp_path / "t.json")
    q = write_atomic(tmp_path / "r.py", "print(1)\n")
    assert _mode(p) == _mode(q) == 0o666 & ~umask


def test_a_failed_write_leaves_the_target_and_no_temp_file(tmp_path) -> None:
    from kvcheck.spec.outputs import write_atomic
    target = tmp_path / "report.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        write_atomic(target, object())          # type: ignore[arg-type]
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_rerun_and_reproducer_commands_are_shell_quoted(tmp_path) -> None:
    import shlex
    import sys
    from kvcheck.spec.outputs import kvcheck_command, python_command
    weird = tmp_path / "a dir" / "it's.json"
    assert shlex.split(kvcheck_command("replay", weird)) == ["kvcheck", "replay", str(weird)]
    assert shlex.split(python_command(weird)) == [sys.executable, str(weird)]


def test_runs_sharing_an_output_directory_never_race_on_the_write_probe(tmp_path):
    """Two kvcheck processes checking the same --out at once (CI runs side venvs in parallel):
    a shared probe name let one unlink the other's probe, which then read as 'cannot write'."""
    import threading

    from kvcheck.checker.common import check_writable

    errors: list[BaseException] = []

    def probe() -> None:
        try:
            for _ in range(300):
                check_writable(tmp_path / "out")
        except BaseException as e:          # the UsageError the race raised
            errors.append(e)

    threads = [threading.Thread(target=probe) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert list((tmp_path / "out").iterdir()) == []       # no probe left behind
