"""The scheduler drive (`--drive engine`): vLLM's own v1 Scheduler decides every step; kvcheck's
checks see what it does. Needs vllm (skipped otherwise, but the trace-meta validation)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvcheck.engines.vllm.sched_build import SchedKnobs

ROOT = Path(__file__).resolve().parents[2]
GOOD = SchedKnobs().as_dict()


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)   # (no test depends on speed)
@given(st.dictionaries(st.sampled_from(sorted(GOOD) + ["extra"]),
                       st.none() | st.booleans() | st.integers(-3, 99) | st.text(max_size=5), max_size=8))
def test_any_scheduler_meta_is_knobs_or_one_line(got):
    from kvcheck.engines.vllm.engine_gen import knobs_of
    try:
        k = knobs_of({"drive": "engine", "scheduler": got})
    except ValueError as e:
        assert "\n" not in str(e) and str(e).startswith("trace meta.scheduler")
    else:
        assert k is not None and set(k.as_dict()) == set(GOOD)


def test_drawn_long_prefill_thresholds_are_off_or_at_least_a_block():
    """VllmConfig asserts it in Mamba align mode (0.16-0.17): a drawn configuration the release
    refuses would be kvcheck's error, not the release's."""
    import random
    from kvcheck.engines.vllm.engine_gen import draw_knobs
    got = {draw_knobs(random.Random(s), "qwen3-next").long_prefill_token_threshold for s in range(200)}
    assert 0 in got and len(got) > 1 and all(t == 0 or t >= 64 for t in got), got


@pytest.mark.parametrize("layout", ["qwen3-next", "qwen3-next@real", "qwen3-next@ratios", "nemotron-h@real",
                                    "nemotron-h@ratios", "jamba@real", "jamba@ratios"])
def test_drawn_token_budgets_are_never_below_the_mamba_block(layout):
    """VllmConfig asserts block_size <= max_num_batched_tokens in Mamba align mode (0.16-0.17): the
    CI matrix met it on 0.17.1's real-size layouts (budget 512 against a 544-token Mamba block)."""
    import random
    from kvcheck.engines.vllm.engine_gen import draw_knobs
    from kvcheck.engines.vllm.layouts import LAYOUT_DATA
    block = max(bs for k, bs, _ in LAYOUT_DATA[layout][1] if k == "mamba")
    got = {draw_knobs(random.Random(s), layout).max_num_batched_tokens for s in range(200)}
    assert len(got) > 1 and min(got) >= block, (block, sorted(got))


vllm = pytest.importorskip("vllm")
from kvcheck.engines.vllm import drivers as V  # noqa: E402
from kvcheck.engines.vllm.build import make_adapter  # noqa: E402


def _run(layout: str, tmp_path, **kw):
    return V.run_campaign(layout, budget_s=None, drive="engine", out_dir=str(tmp_path), **kw)


def test_the_scheduler_is_vllms_own_and_decides_batching_and_preemption(tmp_path):
    ad = make_adapter("full+swa", 0, None, False, False, SchedKnobs(max_num_batched_tokens=8, max_num_seqs=3,
                                                                     num_blocks=13))
    assert type(ad.sched).__module__ == "vllm.v1.core.sched.scheduler"
    assert ad.mgr is ad.sched.kv_cache_manager
    res = _run("full+swa", tmp_path, steps=3000, seed=3, sched_policy="fcfs")
    cov = res["coverage"]
    assert res["exit_code"] == 0, res["findings"]
    # what vLLM decided, seen through its own SchedulerOutputs
    assert cov["state:multi_request_step"] > 0 and cov["state:preempted"] > 0 and cov["state:hit"] > 0
    assert res["scheduler"]["driver"].startswith("vllm.v1.core.sched.scheduler.Scheduler")
    assert res["scheduler"]["knobs"]["policy"] == {"fcfs": res["episodes"]}
    assert not res["missing_actions"]


@pytest.mark.parametrize("layout,fault", [("full+swa", "swa_hit_unchecked"), ("full", "drop_ref_on_free"),
                                          ("full+swa", "evict_keeps_hash"), ("full", "early_reader_forward")])
def test_planted_faults_are_caught_through_the_scheduler_and_replay(layout, fault, tmp_path):
    res = _run(layout, tmp_path, steps=4000, seed=1, fault=fault)
    assert res["caught"], res["findings"]
    f = next(x for x in res["findings"] if x["check"] == res["expected_check"])
    assert f["steps"] <= 20 and f["reproducer"] is not None
    meta = json.loads(Path(f["trace"]).read_text())["meta"]
    assert meta["drive"] == "engine" and meta["scheduler"]["num_blocks"] == meta["num_blocks"]
    rep = V.replay(f["trace"])
    assert rep["reproduced"] and rep["exit_code"] == 10


def test_a_campaign_under_fcfs_never_preempts_a_scheduled_request(tmp_path):
    res = _run("full", tmp_path, steps=6000, seed=2, sched_policy="fcfs")
    assert res["coverage"]["state:preempted"] > 0
    assert res["coverage"].get("state:preempt_scheduled", 0) == 0
    assert not any(k.startswith("known:priority") for k in res["coverage"])


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcheck", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_the_cli_refuses_what_the_drive_cannot_do_in_one_line(tmp_path):
    for extra, want in ((["--drive", "nope"], "--drive: unknown drive"),
                        (["--drive", "engine", "--workload", "chat"], "--workload")):
        argv = ["fuzz", "--sut", "vllm", "--budget", "5", "--out", str(tmp_path)]
        if "--layout" not in extra:
            argv += ["--layout", "full"]
        r = _cli(*argv, *extra)
        assert r.returncode == 2 and want in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    # (what the drive cannot express says so in its JSON: tests/cli/test_vllm_drive.py)


def test_a_trace_with_a_bad_scheduler_meta_is_one_line_exit_2(tmp_path):
    res = _run("full", tmp_path, steps=4000, seed=1, fault="drop_ref_on_free")
    path = Path(res["findings"][0]["trace"])
    d = json.loads(path.read_text())
    d["meta"]["scheduler"]["max_num_seqs"] = "four"
    path.write_text(json.dumps(d))
    r = _cli("replay", str(path), "--sut", "vllm")
    assert r.returncode == 2 and "meta.scheduler" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_eagle_drafts_are_proposed_accepted_and_rejected_under_both_hash_modes(tmp_path):
    """vLLM 0.33 proves the EAGLE boundary with lookahead block hashes (no block drop) unless
    disable_lookahead_block_hashes; the ground truth follows what the scheduler built."""
    res = _run("gpt-oss+eagle", tmp_path, steps=3000, seed=1)
    assert res["exit_code"] == 0, res["findings"]
    cov = res["coverage"]
    assert cov["state:drafts_proposed"] > cov["state:drafts_accepted"] > 0     # some rejected
    assert set(res["scheduler"]["knobs"]["eagle_drop"]) == {"False", "True"}


def test_mamba_groups_run_through_the_schedulers_own_split_and_copies(tmp_path):
    res = _run("full+mamba-fine", tmp_path, steps=3000, seed=1)
    assert res["exit_code"] == 0, res["findings"]
    assert res["coverage"]["state:mamba_state_copy"] > 0 and res["coverage"]["state:cow_copy"] > 0
    caught = _run("full+mamba", tmp_path / "f", steps=3000, seed=1, fault="mamba_state_freed_early")
    assert caught["caught"], caught["findings"]


PRIORITY_TRACE = ROOT / "tests" / "data" / "vllm-engine-priority-preempt-unwritten.json"


def test_the_priority_read_before_write_found_by_a_campaign_replays_and_is_recognised(tmp_path):
    """vLLM's PRIORITY path preempts a request it already scheduled in the step; the blocks its
    allocation published are never written (docs/findings-vllm.md, priority_preempt_unwritten).
    The manager drive needed a targeted script; this 11-step trace is the shrunk finding of a plain
    scheduler-drive campaign (`kvcheck fuzz --sut vllm --layout full --drive engine --sched-policy
    priority --budget 30000 --seed 13`, known-defect recognition off): vLLM's own scheduler made
    the move (r2, more urgent, arrives; the running loop takes back r1 after scheduling it)."""
    from kvcheck.engines.vllm import known
    from kvcheck.engines.vllm.engine_gen import knobs_of
    from kvcheck.engines.vllm.layouts import vllm_version
    from kvcheck.spec.trace import Trace
    if not known._ver("0.14.1") <= known._ver(vllm_version()) <= known._ver("0.34.0"):
        pytest.skip(f"vLLM {vllm_version()} is outside the defect's known range")
    rep = V.replay(str(PRIORITY_TRACE))
    assert rep["reproduced"] and rep["violation"]["check"] == "read_before_write", rep
    t = Trace.load(PRIORITY_TRACE)
    prog = [V.Act(s.action, dict(s.params)) for s in t.steps]
    _, f = V.execute("full", 25, None, prog, sched_policy=knobs_of(t.meta))
    assert f is not None and f.checks == ["known:priority_preempt_unwritten"]
