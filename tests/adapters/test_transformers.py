"""Differential reuse-vs-recompute on Hugging Face transformers hybrid models (tiny, CPU)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from kvcheck.engines.transformers.oracle import AdapterError, run_diff  # noqa: E402

CLEAN = ["mistral", "gemma3_text", "gpt_oss", "qwen3_next"]
SCENARIO_KEYS = {"prefix_len", "suffix_mode", "max_abs_diff", "first_divergent_position", "argmax_flips",
                 "verdict", "first_divergent_layer", "generation"}


pytestmark = pytest.mark.usefixtures("one_thread")     # tests/conftest.py


def _check_shape(res, n):
    json.dumps(res, allow_nan=False)
    for k in ("transformers_version", "model_type", "dtype", "seed", "tolerance", "scenarios", "verdict", "counts",
              "derived_config", "boundaries", "cache_objects"):
        assert k in res
    assert len(res["scenarios"]) == n
    assert sum(res["counts"].values()) == n
    assert res["tolerance"] > 0
    for s in res["scenarios"]:
        assert SCENARIO_KEYS <= set(s)


@pytest.mark.parametrize("model_type", CLEAN)
def test_clean_model_reuse_matches_recompute(model_type):
    res = run_diff(model_type, scenarios=3, seed=1)
    _check_shape(res, 3)
    assert {s["suffix_mode"] for s in res["scenarios"]} == {"one_chunk", "token_by_token", "chunks"}
    assert res["verdict"] in ("exact", "within-tolerance"), [
        (s["prefix_len"], s["suffix_mode"], s["max_abs_diff"]) for s in res["scenarios"]]
    assert res["recompute_causality"]["causal"]
    assert res["first_divergent_operation"] is None
    for s in res["scenarios"]:
        assert s["generation"]["match"]


def test_prefixes_on_and_around_every_boundary():
    res = run_diff("mistral", scenarios=6, seed=0)
    assert res["boundaries"] == {"sliding_window": 8}
    assert [s["prefix_len"] for s in res["scenarios"]] == [8, 7, 9, 16, 15, 17]
    assert all(s["prefix_len"] + s["suffix_len"] > 16 or s["suffix_len"] > 8 for s in res["scenarios"])


def test_gemma3_alias_and_layer_pattern():
    res = run_diff("gemma3", scenarios=1)
    assert res["runs_as"] == "gemma3_text"
    assert res["layer_types"].count("sliding_attention") == 5 and res["layer_types"][-1] == "full_attention"


def test_deterministic_from_seed():
    a = run_diff("gpt_oss", scenarios=2, seed=7)
    b = run_diff("gpt_oss", scenarios=2, seed=7)
    assert a == b


def test_cache_objects_use_kvchecks_kind_names():
    res = run_diff("deepseek_v4", scenarios=1)
    kinds = {k for layer in res["cache_objects"] for k in layer["objects"].values()}
    assert kinds == {"swa_window", "compressed_kv", "tail", "indexer"}
    res = run_diff("qwen3_next", scenarios=1)
    kinds = {k for layer in res["cache_objects"] for k in layer["objects"].values()}
    assert kinds == {"swa_window", "recurrent_state"}


def _assert_fault_localized(res):
    assert res["verdict"] == "divergent"
    for s in res["scenarios"]:
        assert s["fault"]["applied"]
        assert s["first_divergent_layer"] == s["fault_layer"] == res["fault_layer"]
        assert s["explained_by"]["layer"] == res["fault_layer"]
        assert s["explained_by"]["stage"] == "restored_snapshot"
        assert s["explained_by"]["kind"] == "swa_window"


@pytest.mark.parametrize("model_type,fault", [("mistral", "drop_window_position"), ("gemma3_text", "perturb_key"),
                                              ("qwen3_next", "perturb_key")])
def test_planted_cache_fault_is_localized(model_type, fault):
    res = run_diff(model_type, scenarios=2, seed=2, fault=fault)
    _assert_fault_localized(res)
    # the trace names the cached keys the attention reads
    assert res["first_divergent_operation"] == f"layers.{res['fault_layer']}.self_attn.attention.key"


def test_fault_at_chosen_layer():
    res = run_diff("gpt_oss", scenarios=1, fault="perturb_key@1")
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


def test_config_file_overrides_derived_config(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"sliding_window": 5, "num_hidden_layers": 2}))
    res = run_diff("mistral", config_json=str(cfg), scenarios=2)
    assert res["boundaries"]["sliding_window"] == 5
    assert len(res["cache_layer_classes"]) == 2
    assert res["verdict"] in ("exact", "within-tolerance")


def test_unbuildable_config_is_unsupported_with_one_line_reason(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"num_key_value_heads": 3}))  # 4 heads cannot share 3 kv heads
    res = run_diff("mistral", config_json=str(cfg), scenarios=1, out_dir=str(tmp_path / "rep"))
    assert res["verdict"] == "unsupported"
    assert "\n" not in res["reason"] and "mistral" in res["reason"]
    stored = json.loads((tmp_path / "rep" / "transformers-verdicts.json").read_text())
    assert stored["mistral|float32"]["verdict"] == "unsupported"


def test_import_does_not_import_transformers():
    code = ("import sys, kvcheck.engines.transformers.oracle as t; "
            "assert 'transformers' not in sys.modules; print(t.AdapterError.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
