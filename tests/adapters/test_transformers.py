"""Differential reuse-vs-recompute on Hugging Face transformers hybrid models (tiny, CPU)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from kvcheck.fuzz.adapters.transformers import (  # noqa: E402
    SUPPORTED_MODEL_TYPES,
    AdapterError,
    run_diff,
)

REQUIRED = ["mistral", "gemma3_text", "gpt_oss", "deepseek_v3", "qwen3_next"]
SLIDING = ["mistral", "gemma3_text", "gpt_oss"]
SCENARIO_KEYS = {"prefix_len", "suffix_mode", "max_abs_diff", "first_divergent_position", "argmax_flips",
                 "verdict", "first_divergent_layer", "generation"}


def _check_shape(res, n):
    json.dumps(res, allow_nan=False)
    for k in ("transformers_version", "model_type", "dtype", "seed", "tolerance", "scenarios", "verdict", "counts"):
        assert k in res
    assert len(res["scenarios"]) == n
    assert sum(res["counts"].values()) == n
    assert res["tolerance"] > 0
    for s in res["scenarios"]:
        assert SCENARIO_KEYS <= set(s)


@pytest.mark.parametrize("model_type", REQUIRED)
def test_clean_model_reuse_matches_recompute(model_type):
    res = run_diff(model_type, scenarios=4, seed=1)
    _check_shape(res, 4)
    assert res["model_type"] == model_type
    assert {s["suffix_mode"] for s in res["scenarios"]} == {"one_chunk", "token_by_token", "chunks"}
    assert res["verdict"] in ("exact", "within-tolerance"), [
        (s["prefix_len"], s["suffix_mode"], s["max_abs_diff"]) for s in res["scenarios"]]
    assert res["counts"]["divergent"] == 0
    assert res["recompute_causality"]["causal"]
    for s in res["scenarios"]:
        assert s["generation"]["match"]
        assert s["first_divergent_layer"] is None


def test_prefix_lengths_hit_window_boundaries():
    res = run_diff("mistral", scenarios=6, seed=0)
    assert res["boundaries"]["window"] == 8
    tags = {s["prefix_boundary"] for s in res["scenarios"]}
    assert any(t.startswith("on:") for t in tags) and any(t.startswith("off:") for t in tags)


def test_gemma3_alias_and_layer_pattern():
    res = run_diff("gemma3", scenarios=1)
    assert res["model_type"] == "gemma3_text"
    assert res["layer_types"].count("sliding_attention") == 5 and res["layer_types"][-1] == "full_attention"


def test_deterministic_from_seed():
    a = run_diff("gpt_oss", scenarios=3, seed=7)
    b = run_diff("gpt_oss", scenarios=3, seed=7)
    assert a == b


def test_deepseek_v4_extra_runs():
    res = run_diff("deepseek_v4", scenarios=3)
    _check_shape(res, 3)
    assert "DeepseekV4CSACache" in res["cache_layer_classes"]


def _assert_fault_localized(res):
    assert res["verdict"] == "divergent"
    assert res["counts"]["divergent"] == len(res["scenarios"])
    for s in res["scenarios"]:
        assert s["fault"]["applied"]
        assert s["first_divergent_layer"] == s["fault_layer"] == res["fault_layer"]
        assert s["explained_by"]["layer"] == res["fault_layer"]
        assert s["explained_by"]["stage"] == "restored_snapshot"
    assert res["first_divergent_layer"] == res["fault_layer"]


@pytest.mark.parametrize("model_type", SLIDING)
def test_fault_drop_window_position(model_type):
    res = run_diff(model_type, scenarios=3, seed=2, fault="drop_window_position")
    _assert_fault_localized(res)
    for s in res["scenarios"]:
        assert s["explained_by"]["kind"] == "swa_window"


@pytest.mark.parametrize("model_type", REQUIRED)
def test_fault_perturb_key(model_type):
    res = run_diff(model_type, scenarios=3, seed=3, fault="perturb_key")
    _assert_fault_localized(res)
    assert res["scenarios"][0]["explained_by"]["object"] == "keys"


def test_fault_at_chosen_layer():
    res = run_diff("gpt_oss", scenarios=2, fault="perturb_key@1")
    assert res["fault_layer"] == 1
    _assert_fault_localized(res)


def test_unknown_model_type_raises():
    with pytest.raises(AdapterError, match="unknown model_type"):
        run_diff("no_such_model_xyz", scenarios=1)


def test_drop_window_on_model_without_window_raises():
    with pytest.raises(AdapterError, match="sliding window"):
        run_diff("deepseek_v3", scenarios=1, fault="drop_window_position")


@pytest.mark.parametrize("kwargs,match", [
    (dict(fault="nonsense"), "unknown fault"),
    (dict(dtype="float7"), "unknown dtype"),
    (dict(scenarios=0), "scenarios"),
])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(AdapterError, match=match):
        run_diff("mistral", **{"scenarios": 1, **kwargs})


def test_bad_config_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        run_diff("mistral", config_json=str(bad), scenarios=1)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(AdapterError, match="JSON object"):
        run_diff("mistral", config_json=str(arr), scenarios=1)
    with pytest.raises(AdapterError, match="cannot read"):
        run_diff("mistral", config_json=str(tmp_path / "missing.json"), scenarios=1)
    other = tmp_path / "other.json"
    other.write_text('{"model_type": "llama"}')
    with pytest.raises(AdapterError, match="does not match"):
        run_diff("mistral", config_json=str(other), scenarios=1)


def test_config_file_overrides_defaults(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"sliding_window": 5, "num_hidden_layers": 2}))
    res = run_diff("mistral", config_json=str(cfg), scenarios=2)
    assert res["boundaries"]["window"] == 5
    assert len(res["cache_layer_classes"]) == 2
    assert res["verdict"] in ("exact", "within-tolerance")


def test_error_messages_are_one_line():
    try:
        run_diff("no_such_model_xyz", scenarios=1)
    except AdapterError as exc:
        assert "\n" not in str(exc)


def test_supported_list():
    assert set(REQUIRED) <= set(SUPPORTED_MODEL_TYPES)


def test_import_does_not_import_transformers():
    code = ("import sys, kvcheck.fuzz.adapters.transformers as t; "
            "assert 'transformers' not in sys.modules; print(t.AdapterError.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
