"""Mamba (MambaSpec, align mode) groups in the vLLM adapter: the presets and a toy layout run
clean with hits that reuse a state, the spec's recurrent-state rule is what keeps them clean,
each planted Mamba fault is caught by its own check and replays, and the scheduler's chunk rule
is vLLM's."""
from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")
from kvcheck.fuzz.adapters import vllm as V  # noqa: E402
from kvcheck.fuzz.adapters import vllm_checks, vllm_mamba  # noqa: E402
from kvcheck.fuzz.adapters.vllm_adapter import VllmAdapter  # noqa: E402
from kvcheck.fuzz.lockstep import Act, FreeModel, Lockstep  # noqa: E402


def test_the_presets_build_vllms_mamba_groups():
    ad = VllmAdapter("qwen3-next", 80)
    kinds = [type(m).__name__ for m in ad.coord.single_type_managers]
    assert kinds == ["FullAttentionManager"] + ["MambaManager"] * 3
    assert all(m.mamba_cache_mode == "align" for m in ad.coord.single_type_managers[1:])
    assert (ad.hb, ad.max_len, ad.align) == (64, 512, 64)
    assert len(VllmAdapter("nemotron-h", 80).groups) == 7


@pytest.mark.parametrize("layout", ["full+mamba", "qwen3-next"])
def test_mamba_layouts_run_clean_and_hit_a_state(layout, tmp_path):
    r = V.run_campaign(layout, budget_s=None, steps=1500, seed=3, out_dir=str(tmp_path))
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
    obs = ad.apply("lookup", {"r": "r1", "chunk": 1})
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
    assert f["check"] == V.FAULTS[fault][0] and f["steps"] <= 40
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

    from kvcheck.fuzz.adapters.vllm_machine import VllmMachine
    from kvcheck.fuzz.lockstep import Finding

    cfg = settings(max_examples=3, stateful_step_count=30, deadline=None, database=None, derandomize=True,
                   suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    run_state_machine_as_test(VllmMachine.for_layout("full+mamba"), settings=cfg)
    with pytest.raises(Finding) as e:
        run_state_machine_as_test(VllmMachine.for_layout("full+mamba", "mamba_state_freed_early"),
                                  settings=settings(cfg, max_examples=200, phases=[Phase.generate]))
    assert e.value.checks == ["state_copy_sound"]
