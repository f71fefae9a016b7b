"""Mamba (MambaSpec, align mode) groups in the vLLM adapter: the presets and a toy layout run
clean with hits that reuse a state, the spec's recurrent-state rule is what keeps them clean,
each planted Mamba fault is caught by its own check and replays (in scheduler steps too), the
scheduler's chunk rule is vLLM's, steps of several requests follow vLLM's same-step rule,
fine-grained (partial) hits take a private copy of the exact state, and a drafter's groups keep
vLLM's EAGLE rule. Release-aware: what a release lacks is skipped (run it with a side env's
python to check that release)."""
from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")
from known_ack import ACK_ALL
from kvcheck.engines.vllm import drivers as V  # noqa: E402
from kvcheck.engines.vllm import checks as vllm_checks
from kvcheck.engines.vllm import mamba as vllm_mamba  # noqa: E402
from kvcheck.engines.vllm.adapter import VllmAdapter  # noqa: E402
from kvcheck.engines.vllm.layouts import vllm_modules  # noqa: E402
from kvcheck.fuzz.lockstep import Act, Finding, FreeModel, Lockstep  # noqa: E402

FEATS = vllm_modules()["features"]
align = pytest.mark.skipif("MambaSpec.mamba_cache_mode" not in FEATS, reason="no align mode in this release")
fine = pytest.mark.skipif("mamba_partial_hits" not in FEATS, reason="no fine-grained Mamba hits in this release")
pytestmark = align


def _run(layout, program, num_blocks=40, fault=None):
    ad = VllmAdapter(layout, num_blocks, fault)
    core = Lockstep(FreeModel(), ad)
    for a, kw in program:
        core.step(Act(a, kw))
    return ad, core


def test_the_presets_build_vllms_mamba_groups():
    ad = VllmAdapter("qwen3-next", 80)
    kinds = [type(m).__name__ for m in ad.coord.single_type_managers]
    assert kinds == ["FullAttentionManager"] + ["MambaManager"] * 3
    assert all(m.mamba_cache_mode == "align" for m in ad.coord.single_type_managers[1:])
    assert (ad.hb, ad.max_len, ad.align) == (64, 512, 64)
    assert len(VllmAdapter("nemotron-h", 80).groups) == 7


@pytest.mark.parametrize("layout", ["full+mamba", "qwen3-next"])
def test_mamba_layouts_run_clean_and_hit_a_state(layout, tmp_path):
    r = V.run_campaign(layout, budget_s=None, steps=1500, seed=3, out_dir=str(tmp_path), acknowledged=ACK_ALL)
    assert r["exit_code"] == 0 and not r["findings"], r["findings"]
    assert not r["missing_actions"] and r["lookups_with_hit"] > 10


def _hit_at_a_state(layout: str = "full+mamba") -> tuple[VllmAdapter, dict]:
    """r0 computes 12 tokens in chunks ending on block boundaries (states at 4, 8, 12), finishes;
    r1 shares its first 10 tokens: a hit of 8, whose Mamba blocks are the null block, state@8."""
    ad = VllmAdapter(layout, 40)
    core = Lockstep(FreeModel(), ad)
    p = list(range(1, 13))
    for a, kw in [("submit", {"r": "r0", "tokens": p + [30]}), ("lookup", {"r": "r0", "chunk": 4}),
                  ("prefill", {"r": "r0", "chunk": 4}), ("prefill", {"r": "r0", "chunk": 9}),
                  ("finish", {"r": "r0"}), ("submit", {"r": "r1", "tokens": p[:10] + [31, 32]})]:
        core.step(Act(a, kw))
    obs = ad.apply("lookup", {"r": "r1", "chunk": 4})     # (a chunk every release's split schedules)
    return ad, obs


def test_a_hit_reads_the_state_at_its_boundary_and_nothing_older():
    ad, obs = _hit_at_a_state()
    assert obs["hit"] == obs["usable"] == 8 and ad.broken is None
    table = ad._table(1, "r1")
    assert table[0].is_null and not table[1].is_null
    assert ad.written[table[1].block_id][1] == tuple(range(1, 9))      # the state after 8 tokens
    assert ad.needed_hit(1, 8) == [1] and ad.needed_hit(0, 8) == [0, 1]


def test_without_the_recurrent_state_rule_the_checks_disagree_with_vllm(monkeypatch):
    """Judged by the full-attention rule (every block of the prefix), vLLM's align-mode hit,
    whose interior Mamba blocks are null, reads as unsafe: the spec's rule is load-bearing."""
    real = vllm_checks.ShadowChecks.needed_hit
    monkeypatch.setattr(vllm_checks.ShadowChecks, "needed_hit",
                        lambda self, g, L: list(range(L // self.groups[g][1])) if vllm_mamba.is_mamba(self.groups, g)
                        else real(self, g, L))
    ad, obs = _hit_at_a_state()
    assert ad.broken is not None and ad.broken.check in ("hit_sound_recurrent_state", "hit_exceeds_spec")


@pytest.mark.parametrize("layout", ["full+mamba", "qwen3-next"])
@pytest.mark.parametrize("fault", ["mamba_hit_older_state", "mamba_state_freed_early"])
def test_a_planted_mamba_fault_is_caught_by_its_check_and_replays(layout, fault, tmp_path):
    r = V.run_campaign(layout, budget_s=60, seed=0, fault=fault, out_dir=str(tmp_path))
    assert r["exit_code"] == 10 and r["caught"], r["findings"]
    f = r["findings"][-1]
    # shrunk from a campaign of hundreds to thousands of steps; qwen3-next's trace does not reach
    # the shrinker's fixpoint within its 30 s CPU budget (33 steps on an idle machine, 51 under a
    # loaded CI run), so the bound says "shrunk", not how far a given machine got
    assert f["check"] == V.FAULTS[fault][0] and f["steps"] <= 64
    rep = V.replay(f["trace"])
    assert rep["reproduced"] and rep["fault"] == fault


def test_a_mamba_fault_needs_a_mamba_group():
    with pytest.raises(ValueError, match="needs a layout with a mamba group"):
        VllmAdapter("full+swa", 24, "mamba_state_freed_early")


@pytest.mark.parametrize("start, chunk, want", [
    (0, 10, 8),         # not the prompt's end: ends on a block boundary
    (8, 5, 4),          # the last chunk stops at the last cacheable boundary (12) first
    (12, 1, 1),         # then the prompt's last token
    (4, 8, 8),          # an aligned chunk stays
])
def test_the_chunk_split_is_the_schedulers(start, chunk, want):
    """The adapter splits with the installed release's own Scheduler._mamba_block_aligned_split
    (rows every align-mode release agrees on); a layout without Mamba is not split."""
    from vllm.v1.core.sched.scheduler import Scheduler
    ad = VllmAdapter("full+mamba", 40)
    ad.apply("submit", {"r": "r0", "tokens": list(range(1, 14))})
    o = ad.reqs["r0"].obj
    o.num_computed_tokens = start
    assert vllm_mamba.split(ad, o, 0, chunk) == want
    assert ad._mamba_split[0] is Scheduler._mamba_block_aligned_split
    o.num_computed_tokens = 0
    assert vllm_mamba.split(ad, o, start, chunk) == want       # the same from a hit at `start`
    plain = VllmAdapter("full", 40)
    plain.apply("submit", {"r": "r0", "tokens": list(range(1, 14))})
    assert vllm_mamba.split(plain, plain.reqs["r0"].obj, 0, 3) == 3


def test_the_hypothesis_machine_drives_a_mamba_layout_and_catches_a_fault():
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvcheck.engines.vllm.machine import VllmMachine
    from kvcheck.fuzz.lockstep import Finding

    cfg = settings(max_examples=3, stateful_step_count=30, deadline=None, database=None, derandomize=True,
                   suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    run_state_machine_as_test(VllmMachine.for_layout("full+mamba"), settings=cfg)
    with pytest.raises(Finding) as e:      # a pool of 40 blocks: room for a state to be read after it is freed
        run_state_machine_as_test(VllmMachine.for_layout("full+mamba", "mamba_state_freed_early", 40),
                                  settings=settings(cfg, max_examples=300, phases=[Phase.generate]))
    # The fault swaps the running request's state block for the null block. Which check sees it
    # first depends on the drawn steps: the next step's state copy reading it (state_copy_sound,
    # the declared check) or the window check of what the request's next token reads, which for a
    # Mamba group is exactly that state block (toctou_bound_stable). Both are the fault; nothing else is.
    assert e.value.checks[0] in ("state_copy_sound", "toctou_bound_stable"), e.value.checks


# ---- steps of several requests (vllm_timeline.py, vllm_sched.py) ---------------------------
P = list(range(1, 13))
SAME_STEP = [("submit", {"r": "A", "tokens": P + [30]}), ("submit", {"r": "B", "tokens": P[:8] + [31, 32]}),
             ("begin_step", {}), ("lookup", {"r": "A", "chunk": 8}), ("lookup", {"r": "B", "chunk": 4})]


def test_a_same_step_hit_on_a_state_is_refused_and_taken_in_the_next_step():
    """A's first chunk publishes the state after 8 tokens at schedule time; B, admitted in the
    same step, would hit it before the forward writes it: vLLM refuses (cached_blocks_this_step).
    In the next step B hits 8 and its state copy reads bytes A's forward wrote: clean."""
    ad, core = _run("full+mamba", SAME_STEP)
    assert ad.coverage["state:mamba_same_step_refused"] == 1 and ad.reqs["B"].state == "waiting"
    for a, kw in [("forward", {}), ("begin_step", {}), ("prefill", {"r": "A", "chunk": 4}),
                  ("lookup", {"r": "B", "chunk": 4}), ("forward", {})]:
        core.step(Act(a, kw))
    assert ad.reqs["B"].resumed_at == 8 and ad.coverage["state:multi_request_step"] == 1
    assert ad.coverage["state:mamba_state_copy"] >= 2 and ad.broken is None


def test_without_the_same_step_rule_the_timeline_catches_the_unwritten_state():
    """mamba_same_step_hit: B is admitted in A's step; the step's state copy (before the forward)
    reads A's state block, which only this step's forward writes: state_copy_sound at the
    forward. The content model alone (what blocks will hold) sees nothing."""
    ad, core = _run("full+mamba", SAME_STEP, fault="mamba_same_step_hit")
    assert ad.reqs["B"].state == "running" and ad.reqs["B"].resumed_at == 8
    src = ad._table(1, "B")[1]
    assert ad.written[src.block_id] == ad._content(ad.reqs["B"], 8) and src.block_id not in ad.timeline.ready
    with pytest.raises(Finding) as e:
        core.step(Act("forward", {}))
    assert e.value.kind == "safety" and e.value.checks == ["state_copy_sound"] and "not written yet" in e.value.message


@pytest.mark.parametrize("fault", ["mamba_hit_older_state", "mamba_state_freed_early", "mamba_same_step_hit"])
def test_the_mamba_faults_are_caught_in_scheduler_steps(fault, tmp_path):
    r = V.run_campaign("qwen3-next", budget_s=60, seed=0, fault=fault, drive="scheduler", out_dir=str(tmp_path))
    assert r["exit_code"] == 10 and r["caught"] and r["scheduler_episodes"] == r["episodes"], r["findings"]
    f = r["findings"][-1]
    assert f["check"] == V.FAULTS[fault][0]
    assert V.replay(f["trace"])["reproduced"]


@pytest.mark.parametrize("layout", ["full+mamba", "nemotron-h"])
def test_scheduler_episodes_with_mamba_run_clean(layout, tmp_path):
    r = V.run_campaign(layout, budget_s=None, steps=2000, seed=4, drive="scheduler", out_dir=str(tmp_path), acknowledged=ACK_ALL)
    assert r["exit_code"] == 0 and not r["findings"], r["findings"]
    cov = r["coverage"]
    assert cov["state:multi_request_step"] > 20 and cov["state:mamba_state_copy"] > 20 and cov["state:hit"] > 5
    assert not r["missing_actions"]


# ---- fine-grained (partial) hits, copy-on-write ------------------------------------------
FINE_A = [("submit", {"r": "A", "tokens": list(range(1, 15))}), ("lookup", {"r": "A", "chunk": 14}),
          ("prefill", {"r": "A", "chunk": 14})]


@fine
def test_a_partial_hit_takes_a_private_copy_of_the_exact_state():
    """Block 8, hash block 4: A's prefill stops at its prompt's last hash boundary (12, inside
    block 1) and publishes the state there; B shares 12 tokens and hits 12 (inside the block):
    its table gets a fresh block, vLLM queues a copy of A's block into it (copy-on-write), the
    copy claims the state after 12 tokens, and the source holds it."""
    ad, core = _run("full+mamba-fine", FINE_A + [("finish", {"r": "A"}),
                                                 ("submit", {"r": "B", "tokens": list(range(1, 13)) + [40, 41, 42]})])
    assert ad.align == 4 and vllm_mamba.partial(ad)
    obs = ad.apply("lookup", {"r": "B", "chunk": 1})
    assert obs["hit"] == obs["usable"] == 12 and ad.broken is None, ad.broken
    assert ad.coverage["state:mamba_partial_hit"] == 1 and ad.coverage["state:cow_copy"] == 2   # full + mamba
    cow = ad._table(1, "B")[1]
    assert ad.written[cow.block_id] == ad._content(ad.reqs["B"], 13)          # then B's own forward
    assert ad.timeline.ready[cow.block_id] == ad._content(ad.reqs["B"], 13)


@fine
def test_a_running_producer_moves_its_partial_entry_before_overwriting_the_state():
    """A's state at 12 is published inside block 1; A's next step writes the state at 14 into
    that very block, so vLLM moves the entry to a fresh block filled by a copy first. A sibling
    that hits 12 afterwards resumes from the moved entry: the state after exactly 12 tokens."""
    ad, core = _run("full+mamba-fine", FINE_A + [("prefill", {"r": "A", "chunk": 2})])
    assert ad.coverage["state:mamba_entry_moved"] == 1
    core.step(Act("submit", {"r": "B", "tokens": list(range(1, 13)) + [40, 41]}))
    obs = ad.apply("lookup", {"r": "B", "chunk": 1})
    assert obs["hit"] == 12 and ad.broken is None, ad.broken


@fine
@pytest.mark.parametrize("fault", ["mamba_partial_move_uncopied", "mamba_partial_hit_off_by_one",
                                   "mamba_same_step_hit"])
def test_the_fine_grained_faults_are_caught_and_replay(fault, tmp_path):
    r = V.run_campaign("full+mamba-fine", budget_s=60, seed=0, fault=fault, out_dir=str(tmp_path))
    assert r["exit_code"] == 10 and r["caught"], r["findings"]
    f = r["findings"][-1]
    assert f["check"] == V.FAULTS[fault][0] and f["steps"] <= 20
    assert V.replay(f["trace"])["reproduced"]


def test_a_fine_grained_fault_needs_a_mamba_block_larger_than_the_hash_block():
    with pytest.raises(ValueError, match="larger than its hash block"):
        VllmAdapter("full+mamba", 24, "mamba_partial_hit_off_by_one")


def test_fine_grained_layouts_need_the_release_to_have_them(monkeypatch):
    """A release without fine-grained Mamba hits refuses a Mamba block larger than the hash
    block in one line (detected from its MambaManager, not its version)."""
    monkeypatch.setitem(vllm_modules(), "features", FEATS - {"mamba_partial_hits"})
    for name in ("full+mamba-fine", "qwen3-next-fine"):
        with pytest.raises(ValueError) as e:
            VllmAdapter(name, 40)
        assert "\n" not in str(e.value) and "supports_fine_grained_hash_lookup" in str(e.value)
    VllmAdapter("full+mamba", 40)                 # block = hash block: still runs


# ---- a drafter ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["qwen3-next+mtp", "nemotron-h+mtp"])
def test_mtp_presets_reserve_speculative_state_blocks_and_run_clean(layout, tmp_path):
    ad = VllmAdapter(layout, 200)
    specs = [m.kv_cache_spec for m in ad.coord.single_type_managers]
    assert ad.drafter and ad.eagle_groups == {0}              # the Mamba groups never take the drop
    assert all(s.num_speculative_blocks == vllm_mamba.SPEC_TOKENS for s in specs[1:])
    r = V.run_campaign(layout, budget_s=None, steps=1500, seed=3, out_dir=str(tmp_path), acknowledged=ACK_ALL)
    if r["findings"]:       # 0.18.1/0.23.0: vLLM #43559 (docs/repro/vllm_mamba_eagle_unaligned_chunk.py)
        assert "mamba_partial_hits" not in FEATS and r["findings"][-1]["check"] == "hash_map_sound"
        return
    assert r["exit_code"] == 0 and not r["missing_actions"] and r["lookups_with_hit"] > 5


def test_a_mamba_group_taking_the_eagle_drop_would_disagree_with_vllm(tmp_path, monkeypatch):
    """vLLM's Mamba finder never drops the EAGLE block (draft models have no Mamba layers;
    0.33's coordinator gives Mamba no margin): judged as if the Mamba groups took the drop,
    vLLM's hits on qwen3-next+mtp exceed what the spec allows."""
    monkeypatch.setattr(VllmAdapter, "_eagle_groups", lambda self, *a: set(range(len(self.groups))))
    r = V.run_campaign("qwen3-next+mtp", budget_s=60, seed=3, out_dir=str(tmp_path), acknowledged=ACK_ALL)
    assert r["findings"] and r["findings"][-1]["check"] == "hit_exceeds_spec", r["findings"]


def test_the_generator_samples_fine_grained_mamba_and_drafters():
    from kvcheck.engines.vllm import generator as G
    defs = [G.sample_definition(s) for s in range(400)]
    mamba = [d for d in defs if any(g["kind"] == "mamba" for g in d["groups"])]
    assert any(d.get("use_eagle") for d in mamba)
    assert any(g["block_size"] > d["hash_block_size"] for d in mamba for g in d["groups"]
               if g["kind"] == "mamba") == ("mamba_partial_hits" in FEATS)


@fine
@pytest.mark.parametrize("nb", [8, 5])     # B's prompt: its checkpoint lands at 4 on 0.33.0 / 0.28.0
def test_a_copy_on_write_of_a_block_published_in_the_same_step_reads_no_kv(nb):
    """vLLM 0.28.0 and 0.33.0 (docs/repro/vllm_fine_cow_same_step.py): with fine-grained hits and
    EAGLE, D matches C's full-attention block 0, published in this very step, but resumes at
    token 4 inside it (the Mamba state there is B's, from an earlier step, so the Mamba same-step
    rule does not refuse): the copy-on-write of C's block runs before the forward that writes it."""
    from kvcheck.engines.vllm.layouts import register_layout
    name = register_layout({"groups": [{"kind": "full", "block_size": 8}, {"kind": "mamba", "block_size": 8}],
                            "hash_block_size": 4, "use_eagle": True, "eagle_groups": [0]}, "cow-same-step")
    X = list(range(1, 25))
    ad, core = _run(name, [("submit", {"r": "B", "tokens": X[:nb]}), ("lookup", {"r": "B", "chunk": 100}),
                           ("submit", {"r": "C", "tokens": X[:24]}), ("submit", {"r": "D", "tokens": X[:12] + [30, 31]}),
                           ("begin_step", {}), ("lookup", {"r": "C", "chunk": 8, "mp": 2048}),
                           ("lookup", {"r": "D", "chunk": 100, "mp": 2048})])
    if ad.reqs["B"].obj.num_computed_tokens != 4:
        pytest.skip(f"B's checkpoint is not at 4 with {nb} tokens on this release")
    assert ad.reqs["D"].resumed_at == 4 and ad.coverage["state:cow_copy"] == 2
    with pytest.raises(Finding) as e:
        core.step(Act("forward", {}))
    assert e.value.checks == ["state_copy_sound"] and "not written yet" in e.value.message
    assert "(published in this step: C's allocation" in e.value.message
