"""vLLM layouts at real size (realsize.py): the kept derivations are what the installed release's
own rules derive from the model's config, the presets carry them in vLLM's group order, the
ratio variants keep every ratio, and planted faults are caught on them through vLLM's scheduler."""
from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")
from kvcheck.engines.vllm import drivers as V  # noqa: E402
from kvcheck.engines.vllm import realsize as R  # noqa: E402
from kvcheck.engines.vllm.layouts import LAYOUT_DATA, layout_scale, supported_layouts  # noqa: E402
from kvcheck.engines.vllm.presets import REAL  # noqa: E402


def test_the_kept_derivations_are_what_the_installed_release_derives(capsys):
    """One attention model with its drafter and one Mamba hybrid (each derivation builds vLLM's
    ModelConfig for the architecture: 15-30 s). A release whose rules differ prints the
    difference and exits 1; one that cannot run the hybrid alignment rule says so in one line."""
    names = ["gpt-oss+eagle", "gemma3"]
    if hasattr(__import__("vllm.platforms.interface", fromlist=["Platform"]).Platform, "_align_hybrid_block_size"):
        names.append("qwen3-next")
    assert R.main(names) == 0, capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        R.derive("nope")


def test_the_presets_carry_vllms_groups_in_its_order():
    kept = R.table()["models"]
    assert {f"{m}@real" for m in kept} == set(REAL) - {n for n in REAL if n.endswith("@ratios")}
    # Gemma 3: the first layer is a sliding-window layer, so vLLM's groups start with SWA
    groups = LAYOUT_DATA["gemma3@real"][1]
    assert groups[0] == ("swa", 16, 4096) and groups[-1] == ("full", 16, None) and len(groups) == 7
    # its drafter's layer joins the full group and changes vLLM's group size (22 SWA : 5 full)
    assert len(LAYOUT_DATA["gemma3+eagle@real"][1]) == 6
    # Qwen3-Next: the attention block is sized so one page holds a Gated-DeltaNet state
    assert {bs for _, bs, _ in LAYOUT_DATA["qwen3-next@real"][1]} == {544}
    assert layout_scale("qwen3-next@real")[0] == 544
    assert LAYOUT_DATA["llama4-unified@real"][1] == [("full", 16, None)]


@pytest.mark.parametrize("name", [n.removesuffix("@real") for n in REAL if n.endswith("@real")])
def test_the_ratio_variants_keep_every_ratio(name):
    real, small = f"{name}@real", f"{name}@ratios"
    assert small in LAYOUT_DATA, f"{real} has no ratio variant (no power of two divides its sizes)"
    (_, g1, s1), (_, g2, s2) = LAYOUT_DATA[real], LAYOUT_DATA[small]
    f = s1 // s2
    assert f > 1 and s1 == s2 * f and len(g1) == len(g2)
    assert [(k, bs * f, p and p * f) for k, bs, p in g2] == g1
    assert [x * f for x in layout_scale(small)] == list(layout_scale(real))


@pytest.mark.parametrize("layout, fault", [("gemma3@real", "swa_hit_unchecked"),
                                           ("gpt-oss+eagle@real", "worker_table_stale"),
                                           ("llama4@ratios", "drop_ref_on_free"),
                                           ("qwen3-next@ratios", "mamba_state_freed_early")])
def test_a_planted_fault_is_caught_at_real_size_through_vllms_scheduler(layout, fault, tmp_path):
    if supported_layouts().get(layout):
        pytest.skip(f"vLLM {vllm.__version__}: {supported_layouts()[layout]}")
    r = V.run_campaign(layout, budget_s=120, seed=0, fault=fault, drive="engine", out_dir=str(tmp_path))
    assert r["exit_code"] == 10 and r["caught"], r["findings"]
    assert any(f["check"] == V.FAULTS[fault][0] for f in r["findings"])


def test_a_third_of_the_generated_layouts_draw_real_ratios():
    """The layout generator draws ratios (block : hash block up to 16, windows and chunks of up to
    64 blocks, max_model_len crossing the largest three times), not only small fixed numbers."""
    from kvcheck.engines.vllm import generator as G
    from kvcheck.engines.vllm.layout_file import parse_layout
    defs = [G.sample_definition(s) for s in range(300)]
    for d in defs:
        parse_layout(d, "gen", 4, 64)
    wide = [d for d in defs if any(g.get("window", g.get("chunk", 0)) >= 16 * g["block_size"] for g in d["groups"])]
    assert 20 <= len(wide) and max(d["max_model_len"] for d in defs) > 1024
    assert any(max(g["block_size"] for g in d["groups"]) >= 8 * d["hash_block_size"] for d in defs)
    for d in wide:
        units = [g.get("window", g.get("chunk", 0)) for g in d["groups"]]
        assert d["max_model_len"] >= min(3 * max(units), G.MAX_WIDE)


@pytest.mark.parametrize("layout", ["gemma3@ratios", "llama4", "deepseek-v3+mtp"])
def test_the_usable_hit_search_cut_at_the_full_groups_reach_agrees_with_the_whole_search(layout, tmp_path, monkeypatch):
    """spec_usable starts below the first block a full-attention group lacks (checks.full_reach:
    one pass at real size instead of one per candidate length). At every lookup of a campaign on
    both drives it must give what the search over every candidate gives."""
    from kvcheck.engines.vllm import checks
    fast_search = checks.ShadowChecks.spec_usable
    seen = []

    def both(self, req):
        fast = fast_search(self, req)
        self.full_reach = lambda r: 1 << 62          # (the instance's: the whole search)
        try:
            slow = fast_search(self, req)
        finally:
            del self.full_reach
        seen.append(fast)
        assert fast == slow
        return fast
    monkeypatch.setattr(checks.ShadowChecks, "spec_usable", both)
    for drive in ("engine", "mixed"):
        V.run_campaign(layout, budget_s=None, steps=800, seed=5, drive=drive, out_dir=str(tmp_path))
    assert len(seen) > 100 and sum(x > 0 for x in seen) > 20
