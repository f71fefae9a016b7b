"""Whatever a SUT raises, wherever (a step, a negative probe, reset, while shrinking, while
replaying), is a finding or one line with exit 2, never a traceback; a state mismatch shows
both values."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvcheck.fuzz.campaign import Budget, run_campaign
from kvcheck.fuzz.machine import Tally, make_machine, run_program, shrink_finding
from kvcheck.fuzz.suts import resolve_sut
from kvcheck.fuzz.traces import replay
from kvcheck.spec.config import Config
from kvcheck.spec.system import Spec
from kvcheck.spec.trace import Trace

ROOT = Path(__file__).resolve().parents[2]
CFG = Config.load(ROOT / "examples" / "toy.json")
PROBE = "tests.fuzz.raising_sut:RaisesInProbe"


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))


def _steps(spec: Spec, *labels: tuple[str, dict]) -> list:
    return [spec.instance(a, p) for a, p in labels]


PINNED = (("submit", {"r": 0, "n": 1}), ("lookup", {"r": 0}), ("bind", {"r": 0}), ("use", {"r": 0}),
          ("append", {"r": 0, "j": 0}), ("evict", {"g": 0, "kind": "swa_window", "j": 0}))


def test_a_probe_that_raises_is_a_finding_that_shrinks() -> None:
    spec = Spec(CFG)
    machine = make_machine(spec, resolve_sut(PROBE), Tally())
    # padding the shrinker must remove; the last step is a probe (page 0 is pinned)
    pad = (("submit", {"r": 1, "n": 2}), ("lookup", {"r": 1}), ("preempt", {"r": 1}), ("resume", {"r": 1}))
    program = _steps(spec, *pad, *PINNED)
    f = run_program(machine, program)
    assert f is not None and f.checks == ["sut_raised"]
    assert "evict(g=0, kind=swa_window, j=0): the SUT raised RuntimeError: page 0 is pinned" in f.message
    assert f.program[-1].label() == "evict(g=0, kind=swa_window, j=0)"      # the probe is kept
    g = shrink_finding(machine, Tally(), f, seconds=5)          # every candidate's probe raises too
    assert g.checks == ["sut_raised"] and len(g.program) == len(PINNED)


def test_campaign_with_a_raising_probe_reports_and_replays(tmp_path) -> None:
    res = run_campaign(CFG, PROBE, Budget(seconds=60), seed=0, out=tmp_path, shrink_seconds=6)
    assert res["exit_code"] == 13
    f = res["findings"][0]
    assert f["checks"] == ["sut_raised"] and f["trace_steps"][-1].startswith("evict")
    code, out = replay(Trace.load(f["trace"]), resolve_sut(PROBE)())
    assert code == 13 and out["finding"]["checks"] == ["sut_raised"]
    proc = subprocess.run([sys.executable, "-m", "kvcheck", "replay", f["trace"], "--sut", PROBE],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 13 and "Traceback" not in proc.stderr + proc.stdout
    assert f["reproducer"].startswith(sys.executable)
    proc = subprocess.run(f["reproducer"].split(" ", 1), capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 13, proc.stderr       # runs from another directory too


def test_a_sut_that_cannot_reset_is_one_line_exit_2(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvcheck", "fuzz", "--sut", "tests.fuzz.raising_sut:RaisesInReset",
                           "--config", "examples/toy.json", "--budget", "200", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.returncode == 2 and "reset() raised OSError: no device" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_reset_that_fails_later_is_a_finding() -> None:
    spec = Spec(CFG)
    calls = []

    class Flaky(resolve_sut("tests.fuzz.raising_sut:RaisesInProbe").cls):
        def reset(self, cfg):
            calls.append(1)
            if len(calls) > 1:
                raise OSError("device lost")
            super().reset(cfg)
    machine = make_machine(spec, Flaky, Tally())
    run_program(machine, _steps(spec, ("submit", {"r": 0, "n": 1})))
    f = run_program(machine, _steps(spec, ("submit", {"r": 0, "n": 1})))
    assert f is not None and f.checks == ["sut_raised"] and "reset(): the SUT raised OSError" in f.message


def test_state_mismatch_shows_both_values() -> None:
    spec = Spec(CFG)
    machine = make_machine(spec, resolve_sut("tests.fuzz.raising_sut:WrongPageState"), Tally())
    prog = _steps(spec, ("submit", {"r": 0, "n": 2}), ("lookup", {"r": 0}), ("bind", {"r": 0}),
                  ("use", {"r": 0}), ("append", {"r": 0, "j": 0}), ("append", {"r": 0, "j": 1}))
    f = run_program(machine, prog)
    assert f is not None and f.checks == ["abstract_state_matches_spec"]
    assert "o.0.swa_window.1.st: spec=ready engine=evicted" in f.message


def test_cannot_drive_passes_the_guard_as_kvcheck_side_not_a_finding() -> None:
    """CannotDrive is kvcheck's side of the boundary (building the engine failed, an attribute
    kvcheck's stand-in lacks): the guard must not turn it into the engine's `sut_raised`; a plain
    exception from the same hook still is one."""
    from kvcheck.fuzz.boundary import CannotDrive
    from kvcheck.fuzz.guard import GuardedSUT
    from kvcheck.fuzz.lockstep import Finding

    class Sut:
        def __init__(self, exc: BaseException) -> None:
            self.exc = exc

        def apply(self, action: str, params: dict) -> dict:
            raise self.exc

    cd = CannotDrive("sglang", "0.5.20", "building SGLang's scheduler on CPU failed", "build.py:1")
    with pytest.raises(CannotDrive):
        GuardedSUT(Sut(cd)).apply("start", {})
    with pytest.raises(Finding) as f:
        GuardedSUT(Sut(RuntimeError("boom"))).apply("start", {})
    assert f.value.checks == ["sut_raised"]
