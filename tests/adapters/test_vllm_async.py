"""Async scheduling on the scheduler drive (engine_async.py): vLLM's AsyncScheduler under the
engine core's two-deep batch queue, opt-in (KVCHECK_VLLM_ASYNC_SCHEDULING=1)."""
from __future__ import annotations

import dataclasses
import random

import pytest

from kvcheck.engines.vllm.engine_async import ASYNC_ENV
from kvcheck.engines.vllm.engine_gen import draw_knobs, knobs_of
from kvcheck.engines.vllm.sched_build import SchedKnobs

vllm = pytest.importorskip("vllm")
from kvcheck.engines.vllm import drivers as V  # noqa: E402

TRACE = "docs/repro/traces/vllm_async_reset_drops_token.trace.json"


def test_async_scheduling_is_drawn_by_default_not_with_a_drafter_on_mamba(monkeypatch):
    """vLLM enables async scheduling by default (VllmConfig: async_scheduling None -> True, with an
    EAGLE/MTP drafter too): so do kvcheck's episodes, in half of them (with the KV connector too,
    unless its sync loads fail: opt-in), not a drafter's on Mamba groups (not modelled); =0 turns it off."""
    monkeypatch.setenv(ASYNC_ENV, "0")
    plain = [draw_knobs(random.Random(i), "full") for i in range(40)]
    plain_rngs = [random.Random(i) for i in range(40)]
    for r in plain_rngs:
        draw_knobs(r, "full")
    assert not any(k.async_sched for k in plain)
    monkeypatch.delenv(ASYNC_ENV, raising=False)
    rngs = [random.Random(i) for i in range(40)]
    drawn = [draw_knobs(r, "full") for r in rngs]
    assert any(k.async_sched for k in drawn) and not all(k.async_sched for k in drawn)
    assert any(k.async_sched and k.connector for k in drawn) and any(k.connector for k in drawn)
    # its own stream: every other knob, and the episode's later draws, are what they were without it
    assert [dataclasses.replace(k, async_sched=False) for k in drawn] == plain
    assert [r.random() for r in rngs] == [r.random() for r in plain_rngs]
    eagle = [draw_knobs(random.Random(i), "gemma3+eagle").async_sched for i in range(20)]
    assert any(eagle) and not all(eagle)
    assert not any(draw_knobs(random.Random(i), "qwen3-next+mtp").async_sched for i in range(20))
    from kvcheck.engines.vllm.connector import SYNC_FAILURES_ENV
    monkeypatch.setenv(SYNC_FAILURES_ENV, "1")
    failing = [draw_knobs(random.Random(i), "full") for i in range(40)]
    assert not any(k.async_sched and k.connector for k in failing) and any(k.async_sched for k in failing)
    assert all(k.async_sched == d.async_sched for k, d in zip(failing, drawn) if not k.connector)
    old = {k: v for k, v in SchedKnobs().as_dict().items() if k != "async_sched"}
    assert knobs_of({"drive": "engine", "scheduler": old}).async_sched is False


@pytest.fixture
def all_async(monkeypatch):
    """Every episode async (layouts without a drafter), the connector off."""
    from kvcheck.engines.vllm import engine_gen
    draw = engine_gen.draw_knobs
    monkeypatch.setattr(engine_gen, "draw_knobs", lambda rng, layout, policy=None: dataclasses.replace(
        draw(rng, layout, policy), async_sched=True, connector=False, sync_fail=False))


def test_async_is_drawn_only_where_the_releases_own_config_turns_it_on(monkeypatch):
    """vLLM 0.16.0's VllmConfig turns async scheduling off for Mamba prefix caching (and refuses it
    when asked for): the draw asks the release's own VllmConfig (async_scheduling=None), so an
    episode never runs a configuration vLLM would not; a planted "off" decision draws none."""
    from kvcheck.engines.vllm import sched_build
    assert sched_build.async_by_default("full", SchedKnobs()) is True      # (0.34: on for every layout)
    assert sched_build.async_by_default("full+mamba", SchedKnobs()) is True
    monkeypatch.setitem(sched_build._CACHE, ("async", "full+mamba", False), False)
    monkeypatch.setitem(sched_build._CACHE, ("async", "full+mamba", True), False)
    assert not any(draw_knobs(random.Random(i), "full+mamba").async_sched for i in range(40))
    assert any(draw_knobs(random.Random(i), "full").async_sched for i in range(40))


def test_the_scheduler_config_says_what_the_episode_runs():
    """The CPU platform turns async scheduling off after VllmConfig decided ("not required on CPU"),
    and 0.34's scheduler reads the flag (it publishes Mamba states at output time only without it):
    an async episode's config says async, a synchronous one's says not, as on a GPU engine."""
    from kvcheck.engines.vllm.sched_build import build
    for layout in ("full", "full+mamba"):
        for on in (False, True):
            sched = build(layout, SchedKnobs(num_blocks=64, async_sched=on)).scheduler
            assert sched.vllm_config.scheduler_config.async_scheduling is on
            assert (type(sched).__name__ == "AsyncScheduler") is on


def test_a_campaign_overlaps_steps_and_holds(tmp_path, all_async):
    res = V.run_campaign("full+swa", budget_s=None, steps=3000, seed=1, drive="engine", out_dir=str(tmp_path))
    assert res["scheduler"]["knobs"]["async_sched"].get("True", 0) > 0
    assert res["coverage"]["state:async_overlap"] > 100       # N's output taken after N+1 was scheduled
    # forced resets drop the stale outputs in flight (vLLM's rule), checked frame by frame
    assert res["coverage"]["state:async_token_discarded"] > 0
    assert not [f for f in res["findings"] if not f.get("known")], res["findings"]


def test_a_planted_fault_is_caught_under_async_scheduling(tmp_path, all_async):
    res = V.run_campaign("full", budget_s=None, steps=3000, seed=1, drive="engine",
                         fault="early_reader_forward", out_dir=str(tmp_path))
    assert res["caught"]
    f = res["findings"][-1]
    import json
    assert json.load(open(f["trace"]))["meta"]["scheduler"]["async_sched"] is True
    assert f["check"] == "read_before_write" and V.replay(f["trace"])["reproduced"]
    # its standalone script steps vLLM's AsyncScheduler as the batch queue does: 1, and 0 without the plant
    import subprocess
    import sys
    script = f["reproducer"]
    assert script and "ASYNC = True" in open(script).read()
    assert subprocess.run([sys.executable, script], capture_output=True, timeout=600).returncode == 1
    assert subprocess.run([sys.executable, script, "--clean"], capture_output=True, timeout=600).returncode == 0


def test_the_dropped_token_after_a_forced_reset_replays_where_vllm_has_it():
    """vLLM 0.14-0.21: reset_prefix_cache(reset_running_requests=True) marks every running request
    to drop its next async output frame; when the frame in flight was a prefill chunk (no token),
    the request's first real token is dropped instead while the next forward already wrote its KV
    (vllm#42043, fixed by PR #42117): the request computes a position whose token it lost."""
    from kvcheck.engines.vllm.known import _ver
    from kvcheck.engines.vllm.layouts import vllm_version
    got = V.replay(TRACE)
    buggy = _ver(vllm_version()) <= _ver("0.21.0")
    assert got["reproduced"] == buggy, got
    import subprocess
    import sys
    # the standalone script (vLLM's AsyncScheduler under a batch queue of its own): 1 where vLLM has it
    code = subprocess.run([sys.executable, "docs/repro/vllm_async_reset_drops_token.py"], capture_output=True,
                          timeout=600).returncode
    assert code == (1 if buggy else 0)
    if buggy:
        assert got["violation"]["check"] == "toctou_bound_stable"
        # caught where vLLM drops the token, and named as the known defect by its signature
        assert "sampled by a forward scheduled after its forced preemption" in got["violation"]["message"]
        from kvcheck.engines.vllm.known import KNOWN
        import re
        k = next(k for k in KNOWN if k.name == "async_reset_drops_token")
        assert re.search(k.message, got["violation"]["message"]) and k.first == "0.14.1"


@pytest.mark.parametrize("trace", ["docs/repro/traces/vllm_async_connector_sched_preempt_stale.trace.json",
                                   "docs/repro/traces/vllm_async_connector_abort_reported_load.trace.json",
                                   "docs/repro/traces/vllm_async_drafts_connector_stores_inflight.trace.json"])
def test_async_with_the_connector_no_longer_reports_what_was_kvchecks_own(trace):
    """Two findings of the first async + connector campaigns (0.34.0) were kvcheck's model, not vLLM:
    0.34 drops the stale output of a request the scheduler preempts when a connector needs its KV
    delivered (drop_stale_output=requires_kv_delivery: every preemption marks the frames before it
    stale, not only a forced reset's); and a load's report still on its way when its request is
    aborted frees the blocks on arrival (the store must not also store them: finished_sending for a
    request vLLM deleted raised AssertionError in _update_from_kv_xfer_finished). A third, of the
    first async + drafter campaign: the store kept a finished request's last block on
    num_computed_tokens, which counts the frame still in flight (its drafts and the token whose KV
    that frame computes): a connector stores what the worker has computed, num_computed_tokens -
    num_output_placeholders (vLLM's own safe frontier). Every step replays."""
    got = V.replay(trace)
    assert got["violation"] is None and got["exit_code"] == 0, got


def test_async_with_a_drafter_runs_the_gpus_drafts_and_holds(tmp_path, all_async):
    """EAGLE under async scheduling (vLLM's default): the scheduler holds placeholders only, the GPU's
    drafts (proposed after frame N's accepted tokens) are fed to frame N+1, whose positions start where
    N's rejections put them; accepted drafts are written once N+1's output is taken."""
    res = V.run_campaign("gemma3+eagle", budget_s=None, steps=3000, seed=1, drive="engine", out_dir=str(tmp_path))
    assert res["scheduler"]["knobs"]["async_sched"].get("True", 0) > 0
    cov = res["coverage"]
    assert cov["state:async_overlap"] > 100 and cov["state:async_drafts_proposed"] > 100
    assert 0 < cov["state:async_drafts_accepted"] < cov["state:async_drafts_proposed"]   # some rejected
    assert not [f for f in res["findings"] if not f.get("known")], res["findings"]


def test_the_forced_reset_overdiscard_with_drafts_is_named_where_vllm_has_it():
    """async_reset_spec_overdiscard (0.22.1-0.26.0): the forced reset's discard counter counts draft
    placeholders, drained by frames, and drops the outputs of forwards scheduled after the reset. The
    trace of the first async + drafter campaign (0.26.0) and the script: on 0.34, neither."""
    from kvcheck.engines.vllm.known import KNOWN, _ver
    from kvcheck.engines.vllm.layouts import vllm_version
    k = next(k for k in KNOWN if k.name == "async_reset_spec_overdiscard")
    buggy = _ver(k.first) <= _ver(vllm_version()) <= _ver(k.last)
    got = V.replay("docs/repro/traces/vllm_async_reset_spec_overdiscard.trace.json")
    assert got["reproduced"] == buggy, got
    import subprocess
    import sys
    code = subprocess.run([sys.executable, k.repro], capture_output=True, timeout=600).returncode
    assert code == (1 if buggy else 0)
    assert subprocess.run([sys.executable, k.repro, "--no-drafts"], capture_output=True, timeout=600).returncode == 0


def test_the_gpu_places_a_frame_after_the_previous_frames_rejections_not_after_a_resume():
    """Frame N+1's positions, as the GPU computes them: a continuing request starts where N's rejected
    drafts put it (the scheduler planned N+1 as if all were accepted); a request new or resumed in
    N+1 starts where its SchedulerOutput says, whatever N's output did (vLLM 0.22-0.24 applied a
    stale frame's rejections to the resumed request's count, PR #46066: the GPU does not follow)."""
    from types import SimpleNamespace
    from kvcheck.engines.vllm.engine_async import _gpu_sampled, _spans
    so = SimpleNamespace(num_scheduled_tokens={"a": 3, "b": 41, "c": 1})
    opt = {"a": 46, "b": 41, "c": 10}               # num_computed_tokens right after N+1's schedule
    got = _spans(so, opt, new={"b"}, rejected={"a": 2, "b": 2})
    assert got == {"a": (41, 44), "b": (0, 41), "c": (9, 10)}
    o = SimpleNamespace(num_tokens=41, all_token_ids=list(range(41)))
    assert _gpu_sampled(o, 40, []) == []                    # short of the known tokens: no sample
    assert len(_gpu_sampled(o, 41, [])) == 1 and 1 <= len(_gpu_sampled(o, 41, [5, 6])) <= 3
    assert _gpu_sampled(None, 3, []) == [1]                 # finished by N's output: vLLM drops it
