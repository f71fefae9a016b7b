"""Random walks: the clean spec holds with full coverage; every spec fault is caught by its
expected invariant; shrunk traces replay; incremental checking equals full checking."""
from __future__ import annotations

import pytest

from kvcheck.checker.replay import replay_trace
from kvcheck.fuzz.walk import Walker, shrink, to_trace
from kvcheck.spec import faults
from kvcheck.spec.objects import DECISION_KINDS
from kvcheck.spec.config import Config
from kvcheck.spec.system import Spec
from kvcheck.spec.trace import Trace


def test_clean_walk_holds_with_full_coverage() -> None:
    spec = Spec()
    res = Walker(spec, seed=0).run(10_000)
    assert res.violation is None
    assert set(res.coverage.actions) == set(spec.actions)
    assert all(res.coverage.decisions[d] > 0 for d in DECISION_KINDS)
    m = res.metrics.to_dict()
    assert 0 < m["usable_hit_rate"] < m["logical_hit_rate"] <= 1
    assert m["degradations"]


def test_incremental_check_equals_full_check() -> None:
    spec = Spec()
    a = Walker(spec, seed=5, full_check=True).run(3000)
    b = Walker(spec, seed=5, full_check=False).run(3000)
    assert a.coverage.to_dict() == b.coverage.to_dict()
    faulty = Spec(fault="window_off_by_one")
    fa = Walker(faulty, seed=1, full_check=True).run(50_000).violation
    fb = Walker(faulty, seed=1, full_check=False).run(50_000).violation
    assert fa is not None and fb is not None
    assert (fa.step, sorted(fa.violations)) == (fb.step, sorted(fb.violations))


@pytest.mark.parametrize("fault", [f.name for f in faults.spec_faults()])
def test_every_spec_fault_is_caught_by_its_expected_invariant(fault: str, tmp_path) -> None:
    spec = Spec(faults.get(fault).config_for(Config()), fault)    # its semantic on, if it needs one
    res = Walker(spec, seed=0).run(200_000, seconds=60)
    v = res.violation
    assert v is not None, f"{fault} survived {res.coverage.steps} steps"
    expected = faults.get(fault).expected
    assert expected in v.invariants, (fault, v.invariants)
    short = shrink(spec, v.trace, set(v.invariants), budget_s=3)
    assert len(short) <= len(v.trace)
    path = to_trace(spec, short, seed=0).save(tmp_path / "t.json")
    code, out = replay_trace(Trace.load(path))
    assert code == 10 and out["violation"]["step"] == len(short) - 1
    # the same trace on the clean spec: no violation (the fault, not the trace, is the bug)
    clean = Trace.load(path)
    clean.fault = None
    code, out = replay_trace(clean)
    assert code != 10
