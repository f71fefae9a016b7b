"""Drafts with Mamba groups on vLLM's own scheduler (mamba_worker.py): the worker's state per draft
position, the accepted column the next step resumes from, the boundary copy of the postprocess.
Needs vllm (skipped otherwise, but the pure helpers)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcheck.engines.vllm.mamba import Cols, holds

TRACE = Path(__file__).resolve().parents[1] / "data" / "vllm-qwen3-next-fine_mtp-priority-copy.json"

MAMBA_DRAFTERS = ("qwen3-next+mtp", "nemotron-h+mtp", "qwen3-next-fine+mtp")


def test_a_block_written_with_drafts_reads_as_its_first_column_alone():
    from kvcheck.engines.vllm.mamba_worker import REJECTED, column
    a, b = ("s", (1, 2)), ("s", (1, 2, 3))
    w = Cols((a, b, REJECTED))
    assert column(w, 0) == a and column(w, 1) == b and column(w, 2) == REJECTED and column(w, 3) is None
    assert column(a, 0) == a and column(a, 1) is None          # no drafts: column 0 only
    assert holds(w, a, True) and not holds(w, b, True)            # a copy or a hit reads column 0


vllm = pytest.importorskip("vllm")
from kvcheck.engines.vllm import drivers as V  # noqa: E402


def _run(layout: str, tmp_path, **kw):
    return V.run_campaign(layout, budget_s=None, drive="engine", out_dir=str(tmp_path), **kw)


@pytest.mark.parametrize("layout", MAMBA_DRAFTERS)
def test_drafts_with_mamba_run_clean_through_vllms_scheduler(layout, tmp_path):
    """The drafts are proposed, scheduled by vLLM, accepted or rejected, and the states the
    worker resumes from are the right ones: no finding of the state checks on 0.33's own
    scheduler (any known defect it meets is named, never a state_copy_sound of kvcheck's making)."""
    res = _run(layout, tmp_path, steps=2500, seed=4, sched_policy="fcfs")
    cov = res["coverage"]
    assert res["drive"] == "engine"
    assert [f for f in res["findings"] if not str(f.get("check", "")).startswith("known:")] == [], res["findings"]
    assert cov["state:drafts_proposed"] > 0 and cov["state:drafts_accepted"] > 0
    assert cov["state:mamba_drafts_settled"] > 0 and cov["state:mamba_spec_boundary_copy"] > 0
    assert cov["state:mamba_state_copy"] > 0


@pytest.mark.parametrize("layout", ("qwen3-next+mtp", "nemotron-h+mtp"))
def test_a_worker_that_ignores_the_accepted_drafts_is_caught(layout, tmp_path):
    res = _run(layout, tmp_path, steps=3000, seed=1, fault="mamba_accept_ignored")
    assert res["exit_code"] == 10
    f = res["findings"][0]
    assert f["check"] == "state_copy_sound" and "resumes the state at" in f["message"], f


def test_the_fault_needs_the_engine_drive_and_a_drafter(tmp_path):
    from kvcheck.engines.vllm.drive_plan import plan
    with pytest.raises(ValueError, match="--drive engine"):
        plan("qwen3-next+mtp", "mamba_accept_ignored", None, "random", "mixed", None, 1)
    with pytest.raises(ValueError, match="a drafter"):
        plan("qwen3-next", "mamba_accept_ignored", None, "random", "engine", None, 1)


def test_auto_keeps_mamba_drafters_on_the_engine_drive():
    from kvcheck.engines.vllm.drive_plan import ENGINE_WHY, static_choice
    for layout in MAMBA_DRAFTERS:
        assert static_choice(layout, None, None, "random") == ("engine", ENGINE_WHY)


def test_an_unwritten_block_met_by_a_copy_is_the_priority_defect(tmp_path):
    """PRIORITY preempts a request after its allocation published a block; a later fine-grained
    partial hit copies that block (copy-on-write) before any forward wrote it. The finding names
    the cancelled write, and the known-defect signature takes it (vLLM PR #43569's family)."""
    from kvcheck.engines.vllm import known
    from kvcheck.engines.vllm.build import make_adapter
    from kvcheck.engines.vllm.layouts import vllm_version
    from kvcheck.engines.vllm.engine_gen import knobs_of
    from kvcheck.spec.trace import Trace
    t = Trace.load(str(TRACE))
    ad = make_adapter(t.meta["layout"], 0, None, False, False, knobs_of(t.meta))
    got = None
    for s in t.steps:
        ad.apply(s.action, dict(s.params))
        got = ad.extra_checks(s.action, s.params)
        if got:
            break
    assert got is not None and got[1] == "state_copy_sound"
    assert "was preempted in the step whose allocation published it" in got[2]
    assert known.by_signature(ad, vllm_version(), got[1], got[2]) == "priority_preempt_unwritten"
    # the same message without the cause is not taken (no blanket match on the check)
    assert known.by_signature(ad, vllm_version(), got[1], got[2].split(" (its writer")[0]) is None




def test_an_eagle_group_one_block_short_of_a_mamba_hit_is_named_and_recognised(tmp_path):
    """0.20.0-0.25.1 (found through the scheduler on generated layouts): the coordinator returns a
    hit the Mamba groups keep while the EAGLE group dropped its last block. The finding says so,
    and that is the known defect's signature (its trace: docs/repro/traces/)."""
    from types import SimpleNamespace
    from kvcheck.engines.vllm import known
    from kvcheck.engines.vllm.build import make_adapter
    from kvcheck.engines.vllm.violation import Violation
    ad = make_adapter("qwen3-next+mtp", 64, None, False, False, "fcfs")
    ad.apply("submit", {"r": "r0", "tokens": list(range(1, 200))})
    req, null = ad.reqs["r0"], ad.pool.null_block
    short = [[null] * 1] + [[null] * 2] * 3         # a 128-token hit: the full (EAGLE) group one block short
    with pytest.raises(Violation) as e:
        ad._check_hit(req, SimpleNamespace(blocks=short), 128)
    assert e.value.check == "hit_length_equal" and "EAGLE group dropped its last block" in e.value.message
    assert known.by_signature(ad, "0.24.0", e.value.check, e.value.message) == "eagle_mamba_hit_mismatch"
    assert known.by_signature(ad, "0.26.0", e.value.check, e.value.message) is None      # (fixed there)
    other = [[null] * 2, [null] * 1, [null] * 2, [null] * 2]     # a Mamba group short: another defect
    with pytest.raises(Violation) as e:
        ad._check_hit(req, SimpleNamespace(blocks=other), 128)
    assert known.by_signature(ad, "0.24.0", e.value.check, e.value.message) is None
