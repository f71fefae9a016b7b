"""The timeline of steps (vllm_timeline.py) and the scheduler-like driving (vllm_sched.py) on
vLLM's real KV cache manager: blocks are published at schedule time and written by the forward."""
import json

import pytest

pytest.importorskip("vllm")

from known_ack import ACK_ALL
from kvcheck.engines.vllm import drivers as V  # noqa: E402
from kvcheck.engines.vllm.adapter import VllmAdapter  # noqa: E402
from kvcheck.fuzz.lockstep import Act, Finding, FreeModel, Lockstep  # noqa: E402
from kvcheck.spec.sut import ActionRejected  # noqa: E402

A, B = list(range(1, 21)), [30, 31, 32, 33]      # 20 and 4 tokens, block 4 (layout "full")


def _run(program, layout="full", num_blocks=6, fault=None, sched_policy="fcfs"):
    ad = VllmAdapter(layout, num_blocks, fault)
    ad.sched_policy = sched_policy
    core = Lockstep(FreeModel(), ad)
    for a, p in program:
        core.step(Act(a, p))
    return ad


def _two_running():
    """Step 1 admits A (8 of 20 tokens) and B (4 tokens) together; B then decodes."""
    return [("submit", {"r": "A", "tokens": A}), ("submit", {"r": "B", "tokens": B}),
            ("begin_step", {}), ("lookup", {"r": "A", "chunk": 8}), ("lookup", {"r": "B", "chunk": 4}),
            ("forward", {})]


def test_priority_preemption_of_a_scheduled_request_reads_unwritten_blocks():
    """vLLM's PRIORITY path (scheduler.py: `preempted_req in scheduled_running_reqs`): A is
    scheduled (allocate_slots publishes its blocks 8..15), B's decode finds no free block, the
    victim is A, already scheduled: it is taken out of the step and freed, its published blocks
    are never written. Its re-admission hits them and its forward reads no bytes."""
    prog = _two_running() + [
        ("begin_step", {}), ("prefill", {"r": "A", "chunk": 8}), ("decode", {"r": "B", "tok": 5}),
        ("preempt", {"r": "A"}), ("decode", {"r": "B", "tok": 5}), ("forward", {}),
        ("finish", {"r": "B"}),
        ("begin_step", {}), ("lookup", {"r": "A", "chunk": 8})]
    ad = _run(prog, sched_policy="priority")
    assert ad.coverage["state:alloc_refused"] == 1 and ad.coverage["state:preempt_scheduled"] == 1
    assert ad.reqs["A"].obj.num_computed_tokens == 20 and ad.coverage["state:hit"] == 1
    with pytest.raises(Finding) as e:
        Lockstep(FreeModel(), ad).step(Act("forward", {}))
    assert e.value.kind == "safety" and e.value.checks == ["read_before_write"]
    assert "block #4 (tokens 8..11)" in e.value.message
    # the content model alone (what a block will hold once its forward runs) sees nothing
    assert ad.written[4] == ad._content(ad.reqs["A"], 12)


def test_fcfs_preemption_and_same_step_hits_are_clean():
    """FCFS preempts the last running request, never one already scheduled in the step; a
    sibling admitted in the same step as the prefill that publishes its prefix reads it in the
    same forward (each layer writes the batch's KV before it attends): both clean."""
    prog = _two_running() + [
        ("begin_step", {}), ("prefill", {"r": "A", "chunk": 8}), ("preempt", {"r": "B"}), ("forward", {}),
        ("submit", {"r": "C", "tokens": A[:16] + [99, 98]}),
        ("begin_step", {}), ("prefill", {"r": "A", "chunk": 4}), ("lookup", {"r": "C", "chunk": 8}),
        ("forward", {}),
        ("begin_step", {}), ("lookup", {"r": "B", "chunk": 4}), ("forward", {})]
    ad = _run(prog, num_blocks=12)
    assert ad.coverage["state:hit"] >= 1 and ad.broken is None
    assert ad.timeline.stats["forwards"] >= 4 and ad.timeline.stats["writes_cancelled"] == 0


def test_same_step_hit_is_caught_when_the_reader_runs_first():
    """The planted early_reader_forward: the admitted reader's forward runs before the
    writer's; the same program as above (a same-step sibling hit) is then a finding."""
    prog = [("submit", {"r": "A", "tokens": A}), ("begin_step", {}), ("lookup", {"r": "A", "chunk": 8}),
            ("forward", {}), ("submit", {"r": "C", "tokens": A[:16] + [99, 98]}),
            ("begin_step", {}), ("prefill", {"r": "A", "chunk": 8}), ("lookup", {"r": "C", "chunk": 8})]
    clean = _run(prog + [("forward", {})], num_blocks=12)
    assert clean.coverage["state:same_step_hit"] == 1 and clean.coverage["state:hit"] == 1
    with pytest.raises(Finding) as e:
        _run(prog + [("forward", {})], num_blocks=12, fault="early_reader_forward")
    assert e.value.checks == ["read_before_write"]


def test_a_step_keeps_the_schedulers_order():
    """Inside a step: no finish/reset/evict, no admission after a preemption, no running
    request scheduled after an admission or twice (refused: the core skips such a step)."""
    ad = _run(_two_running() + [("begin_step", {})], num_blocks=12)
    for a, p in (("finish", {"r": "A"}), ("reset_prefix_cache", {}), ("evict_blocks", {"block_ids": [1]}),
                 ("begin_step", {})):
        with pytest.raises(ActionRejected):
            getattr(ad, f"_a_{a}")(**p)
    ad._a_prefill("A", 4)
    with pytest.raises(ActionRejected):
        ad._a_prefill("A", 4)                      # once per step
    ad._a_submit([7, 8, 9], r="C")
    ad._a_lookup("C", 3)
    with pytest.raises(ActionRejected):
        ad._a_decode("B", 1)                       # running loop after the waiting loop
    with pytest.raises(ActionRejected):
        ad._a_preempt("B")


def test_scheduler_drive_runs_clean_and_reaches_the_cases(tmp_path):
    r = V.run_campaign("full+swa", budget_s=None, steps=1500, seed=2, out_dir=str(tmp_path), drive="scheduler", acknowledged=ACK_ALL)
    json.dumps(r)
    assert r["exit_code"] == 0, r["findings"]
    c = r["coverage"]
    assert r["scheduler_episodes"] == r["episodes"] and c["begin_step"] and c["forward"]
    assert c["state:multi_request_step"] > 0 and c["state:same_step_hit"] > 0
    assert c["preempt"] > 0 and c["state:alloc_refused"] > 0 and c["state:hit"] > 0


def test_planted_timeline_fault_shrinks_and_replays(tmp_path):
    r = V.run_campaign("full+swa", budget_s=60, steps=50_000, seed=0, fault="early_reader_forward",
                       out_dir=str(tmp_path), drive="scheduler")
    assert r["caught"] and r["exit_code"] == 10
    f = r["findings"][-1]
    assert f["check"] == "read_before_write" and f["steps"] <= 10
    out = V.replay(f["trace"])
    assert out["reproduced"] and out["exit_code"] == 10


def test_bad_drive_and_policy_are_one_line():
    with pytest.raises(ValueError, match="unknown drive"):
        V.run_campaign("full", steps=1, drive="batch")
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        V.run_campaign("full", steps=1, sched_policy="lifo")


def test_priority_finding_has_a_standalone_reproducer(tmp_path, run_script, monkeypatch):
    """The PRIORITY finding's script (vLLM only) exits 1; the same steps with the victim not yet
    scheduled when it is preempted (FCFS's case) exit 0."""

    from kvcheck.engines.vllm.drivers import _save, execute
    prog = _two_running() + [
        ("begin_step", {}), ("prefill", {"r": "A", "chunk": 8}), ("decode", {"r": "B", "tok": 5}),
        ("preempt", {"r": "A"}), ("decode", {"r": "B", "tok": 5}), ("forward", {}), ("finish", {"r": "B"}),
        ("begin_step", {}), ("lookup", {"r": "A", "chunk": 8}), ("forward", {})]
    from kvcheck.engines.vllm import known as vllm_known
    monkeypatch.setattr(vllm_known, "STRICT", True)     # the finding itself, not its known:NAME count
    _, f = execute("full", 6, None, [Act(a, p) for a, p in prog], sched_policy="priority")
    assert f is not None and f.checks == ["read_before_write"]
    info = _save("full", 6, None, 0, f, False, str(tmp_path), "rbw", sched_policy="priority")
    code, out = run_script(info["reproducer"])
    assert code == 1 and "never written" in out, out
    src = open(info["reproducer"]).read()
    line = next(x for x in src.splitlines() if x.startswith("STEPS = "))
    steps = eval(line[len("STEPS = "):])                       # noqa: S307 (the script's own repr)
    i = next(k for k, s in enumerate(steps) if s[0] == "preempt")
    del steps[i + 1], steps[i - 2]      # A not scheduled in that step when it is preempted (FCFS)
    ctrl = tmp_path / "ctrl.py"
    ctrl.write_text(src.replace(line, f"STEPS = {steps!r}"))
    code, text = run_script(ctrl)
    assert code == 0, text


def test_a_failed_copy_says_whether_its_source_was_published_in_the_step():
    """state_copy_sound's message names the step that published the copy's source: the open
    one (its writer is scheduled in it, and the forward that writes it runs after the copy:
    the same-step copy-on-write, known as fine_cow_same_step) or an earlier one (never
    written, or last written with another prefix). Copies injected into the timeline on the
    real manager's blocks: step 1 wrote A's blocks 0..1; step 2 schedules A's tokens 8..15."""
    ad = _run(_two_running() + [("begin_step", {}), ("prefill", {"r": "A", "chunk": 8})], num_blocks=10)
    a = ad.reqs["A"]
    t = [b.block_id for b in ad._table(0, "A")]
    free = next(i for i in range(1, ad.num_blocks) if i not in ad.timeline.ready and i not in t)
    cases = [(t[2], ad._content(a, 12), "not written yet (published in this step: A's allocation"),
             (free, ad._content(a, 4), "not written yet (published before this step: no forward has written it)"),
             (t[0], ad._content(ad.reqs["B"], 4), "not what the copy claims (published before this step: "
                                                  "the last forward that wrote it wrote another prefix)")]
    for src, claim, want in cases:
        tl = ad.timeline
        saved = (dict(tl.sched), dict(tl.ready))
        tl.copy(src, 99, claim, False)
        with pytest.raises(Finding) as e:
            Lockstep(FreeModel(), ad).step(Act("forward", {}))
        assert e.value.checks == ["state_copy_sound"] and want in e.value.message, e.value.message
        tl.open, tl.sched, tl.ready = True, *saved       # the same open step again, for the next case
