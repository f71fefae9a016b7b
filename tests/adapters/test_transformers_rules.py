"""The derived tiny config keeps the relations its default config holds: the layer pattern's length
equals the layer count and keeps every kind, layer-role counts still partition the layers, head dims
follow the shrunk sizes (never 0), expert groups divide the experts, per-layer tables follow the kept
layers; each rule is shown on a synthetic config and on the library's own."""

import pytest

from kvcheck.engines.transformers import rules


def test_layer_counts_that_partition_the_layers_keep_partitioning_them():
    d = {"num_hidden_layers": 72, "n_input_layers": 16, "n_recurrent_layers": 40, "n_output_layers": 16}
    out = rules.scale_layer_counts(d, 72, 8)
    assert sum(out.values()) == 8 and min(out.values()) >= 1
    assert out["n_recurrent_layers"] > out["n_input_layers"]
    # a count that does not partition is scaled on its own and never drops to 0
    assert rules.scale_layer_counts({"num_dense_layers": 1}, 32, 4) == {"num_dense_layers": 1}
    assert rules.scale_layer_counts({"num_dense_layers": 1}, 32, 4, fixed={"num_dense_layers": 0}) == {}


def test_head_dims_follow_the_shrunk_sizes_and_groups_divide_experts():
    d = {"hidden_size": 2560, "num_attention_heads": 32, "attention_hidden_size": 5120, "attention_head_dim": 160,
         "kv_channels": 80, "num_query_groups": 32, "num_expert_group": 8, "qk_nope_head_dim": 192,
         "qk_rope_head_dim": 64, "head_dim": 256}
    p = {"hidden_size": 64, "num_attention_heads": 4, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "head_dim": 16}
    out = rules.relations(d, p)
    assert out["attention_hidden_size"] == 128 and out["attention_head_dim"] == 32
    assert out["kv_channels"] == 16 and out["num_query_groups"] == 4 and out["num_expert_group"] == 1
    assert out["head_dim"] == 24  # nope + rope, as in the default


def test_a_pattern_with_no_attention_layer_gets_one():
    d = {"num_attention_heads": 32, "layer_types": ["linear_attention"] * 32}
    assert rules.attention_kept(d, {"layer_types": ["linear_attention"] * 2}, 2) == {
        "layer_types": ["linear_attention", "full_attention"]}
    assert rules.attention_kept({"num_attention_heads": 4, "attn_layer_indices": None}, {}, 4) == {
        "attn_layer_indices": [3]}
    assert rules.attention_kept(d, {"layer_types": ["linear_attention", "full_attention"]}, 2) == {}


def test_per_layer_tables_follow_the_kept_layers():
    d = {"head_dim": 256, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
         "per_layer_config": {"02": {"qk_nope_head_dim": 192}, "07": {"qk_nope_head_dim": 192}}}
    p = {"head_dim": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8}
    out = rules.per_layer_tables(d, [0, 1, 2], lambda e: {"qk_nope_head_dim": 16}, p)
    assert out == {"per_layer_config": {"02": {"qk_nope_head_dim": 16, "head_dim": 24}}}


def test_flags_asking_for_cuda_kernels_are_switched_off_and_nothing_else():
    d = {"use_mamba_kernels": True, "use_cache": True, "use_fast_kernels": False, "use_kernel": True,
         "use_sliding_window": True}
    assert rules.cpu_paths(d) == {"use_mamba_kernels": False, "use_kernel": False}


def test_period_needs_two_repeats():
    assert rules.period(list("aab" * 4)) == 3
    assert rules.period(list("aabaaab")) == 7  # no repeat: its length


transformers = pytest.importorskip("transformers")
from kvcheck.engines.transformers import build  # noqa: E402
from kvcheck.engines.transformers import models  # noqa: E402


@pytest.mark.parametrize("mt", ["dory", "granitemoehybrid", "bailing_hybrid", "zamba2", "dots3_note_text"])
def test_library_configs_obey_the_rules_once_built(mt):
    mapping, _ = models.config_mapping()
    default = mapping[mt]()
    _, cfg, _, _ = build.build_model(mt)
    lt = getattr(cfg, "layer_types", None)
    if isinstance(lt, list):
        assert len(lt) == cfg.num_hidden_layers, mt
        assert set(default.layer_types) <= set(lt) or any("attention" in x for x in lt), mt
        assert any(x != "linear_attention" and ("attention" in x or x == "hybrid") for x in lt), mt
    for k, v in cfg.to_dict().items():
        if rules.HEAD_DIM.search(k) and isinstance(v, int):
            assert v > 0, (mt, k)
    n_exp = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None)
    groups = getattr(cfg, "num_expert_group", None) or getattr(cfg, "n_group", None)
    if isinstance(n_exp, int) and isinstance(groups, int):
        assert n_exp % groups == 0 and n_exp // groups >= 1, mt


def test_every_default_kind_survives_for_a_few_patterned_configs():
    mapping, _ = models.config_mapping()
    for mt in ("dory", "deepseek_v4", "lara_mini", "bailing_hybrid", "zamba"):
        default = mapping[mt]().to_dict()
        for periods in (0, 1, 2):
            p = models.derive_config(mt, periods=periods)
            key = "layer_types" if "layer_types" in p else "layers_block_type"
            assert len(p[key]) == p["num_hidden_layers"], (mt, periods)
            assert set(p[key]) == set(default[key]), (mt, periods)


def test_bf16_build_keeps_what_the_models_dtype_plan_keeps_in_fp32():
    import torch

    model, _, _, _ = build.build_model("inkling2_text", dtype="bfloat16")  # its router runs in fp32
    plan = model._get_dtype_plan(torch.bfloat16)
    assert plan
    kept = {n for n, t in model.named_parameters() if t.dtype == torch.float32}
    assert kept and all(any(k in n for k in plan) for n in kept)
    assert any(t.dtype == torch.bfloat16 for t in model.parameters())
