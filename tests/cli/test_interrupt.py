"""Ctrl-C never reports a pass it did not earn: exit 130, with what was done so far written.

Real processes and real SIGINTs. Each test waits for a sign that the run is under way (the
observability file filling, a mutants row on stderr), interrupts it, and bounds the wait for
the exit (no timing asserts: the bounds only keep a hung run from hanging the suite).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _start(argv: list[str], cwd: Path, group: bool = False) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "kvcheck", *argv], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=group)


def _wait_for(proc: subprocess.Popen, ready: Callable[[], bool], limit_s: float = 120.0) -> None:
    end = time.monotonic() + limit_s
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode} before it was interrupted: {proc.stderr.read()}")
        if time.monotonic() > end:
            proc.kill()
            pytest.fail("never got under way")
        time.sleep(0.2)


def _filled(path: Path) -> Callable[[], bool]:
    return lambda: path.exists() and path.stat().st_size > 0


def _interrupt(proc: subprocess.Popen, group: bool = False, limit_s: float = 60.0) -> tuple[int, str, str]:
    if group:
        os.killpg(proc.pid, signal.SIGINT)      # what a terminal's Ctrl-C does
    else:
        proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # its workers too, when it leads a group
        except OSError:
            proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"did not stop on SIGINT: {err[-2000:]}")
    return proc.returncode, out, err


def test_fuzz_interrupted_before_its_coverage_minimum_is_130_not_holds(tmp_path) -> None:
    obs = tmp_path / "obs.jsonl"
    proc = _start(["fuzz", "--budget", "10m", "--json", "--out", str(tmp_path / "o"),
                   "--observability", str(obs)], tmp_path)
    _wait_for(proc, _filled(obs))
    code, out, err = _interrupt(proc)
    assert code == 130, err
    res = json.loads(out)                         # the partial result is written
    assert res["interrupted"] and res["exit_code"] == 130 and "holds" not in res["verdict"]
    assert res["steps"] > 0 and "Traceback" not in err


@pytest.mark.parametrize("group", [True, False], ids=["ctrl-c to the group", "kill -INT the parent"])
def test_fuzz_workers_interrupted_keep_a_summary_and_stay_quiet(tmp_path, group) -> None:
    """A terminal's Ctrl-C reaches every worker; a `kill -INT` reaches the parent, which forwards it."""
    obs = tmp_path / "obs.jsonl"
    proc = _start(["fuzz", "--budget", "10m", "--workers", "2", "--json", "--out", str(tmp_path / "o"),
                   "--observability", str(obs)], tmp_path, group=True)
    _wait_for(proc, lambda: all(_filled(obs.with_suffix(f".w{w}.jsonl"))() for w in range(2)))
    code, out, err = _interrupt(proc, group=group)
    assert code == 130, err
    res = json.loads(out)
    assert res["interrupted"] and res["exit_code"] == 130 and res["steps"] > 0
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_mutants_stops_on_sigint_and_keeps_its_json(tmp_path) -> None:
    """It used to ignore SIGINT after its first rows, record the cut cell as a miss, and lose
    the --json result."""
    proc = _start(["mutants", "--fault", "shared_free_list", "eviction_ignores_pins",
                   "--budget-per-fault", "120s", "--json"], tmp_path)
    lines: list[str] = []

    def first_row() -> bool:
        line = proc.stderr.readline()
        if line:
            lines.append(line)
        return any(": killed" in l or ": survived" in l or ": mis-attributed" in l for l in lines)
    _wait_for(proc, first_row, limit_s=240)
    code, out, err = _interrupt(proc)
    assert code == 130, "".join(lines) + err
    res = json.loads(out)
    assert res["interrupted"] and res["exit_code"] == 130
    assert [r["fault"] for r in res["faults"]][:1] == ["shared_free_list"]
    assert all(r["status"] != "survived" for r in res["faults"])     # no cut cell counted as a miss


def test_cap_workers_at_the_cores() -> None:
    from kvcheck.fuzz.pool import cap_workers, cores
    n, note = cap_workers(100_000)
    assert n == cores() and "capped" in note
    assert cap_workers(1) == (1, None)


@pytest.mark.parametrize("phase", ["walk", "checkers"])
def test_gate_interrupted_writes_its_report_and_claims_nothing(capsys, tmp_path, monkeypatch, phase) -> None:
    """Ctrl-C (as the KeyboardInterrupt Python raises for SIGINT) in the walk or in the checkers:
    report.json / report.md say "interrupted", exit 130."""
    from badinput import run
    from kvcheck.checker import gate
    from kvcheck.fuzz import walk

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt
    if phase == "walk":
        monkeypatch.setattr(walk.Walker, "run", ctrl_c)
    else:
        monkeypatch.setattr(gate, "run_checkers", ctrl_c)
    code, out, err = run(capsys, "gate", "--out", str(tmp_path), "--steps", "200", "--json")
    assert code == 130, err
    res = json.loads(out)
    rep = json.loads((tmp_path / "report.json").read_text())
    assert res["exit_code"] == rep["exit_code"] == 130 and rep["verdict"].startswith("interrupted")
    assert "interrupted" in (tmp_path / "report.md").read_text()
    assert ("walk" in rep["engines"]) == (phase != "walk")


def test_gate_interrupted_after_a_violation_keeps_exit_10(capsys, tmp_path, monkeypatch) -> None:
    from badinput import run
    from kvcheck.checker import gate

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(gate, "run_checkers", ctrl_c)
    code, out, err = run(capsys, "gate", "--out", str(tmp_path), "--fault", "eviction_ignores_pins", "--json")
    rep = json.loads((tmp_path / "report.json").read_text())
    assert code == rep["exit_code"] == 10, err           # the walk's violation was earned
    assert "interrupted" in rep["verdict"] and rep["violation"]["invariants"]
