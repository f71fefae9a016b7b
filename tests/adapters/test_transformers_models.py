"""Hybrid model types are found from the installed transformers, and any of them gets a tiny
config whose granularities short sequences cross."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from kvcheck.engines.transformers import build  # noqa: E402
from kvcheck.engines.transformers import models  # noqa: E402
from kvcheck.engines.transformers.oracle import list_models, record_verdict  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def listed():
    return {m["model_type"]: m for m in list_models()}


def test_discovery_finds_hybrids_and_skips_uniform_full_attention(listed):
    for mt in ("mistral", "gemma3_text", "gpt_oss", "qwen3_next", "deepseek_v32", "deepseek_v4", "llama4_text",
               "mamba", "recurrent_gemma"):
        assert mt in listed, mt
    for mt in ("llama", "gpt2", "deepseek_v3"):  # uniform full attention (MLA is still full)
        assert mt not in listed, mt
    assert "chunked_attention" in listed["llama4_text"]["layer_kinds"]
    assert "DynamicIndexedLayer" in listed["deepseek_v32"]["cache_classes"]
    assert listed["gemma3"]["runs_as"] == "gemma3_text"


def test_discovery_is_not_a_hand_list(listed):
    # the evidence is what the config class declares
    assert "index_topk" in listed["deepseek_v32"]["fields"]
    assert "attention_chunk_size" in listed["llama4_text"]["fields"]
    assert set(listed["deepseek_v4"]["fields"]) >= {"compress_rates", "sliding_window", "index_topk"}


@pytest.mark.parametrize("mt,expect", [
    ("deepseek_v4", {"sliding_window": 8, "index_topk": 3, "compress_rates[compressed_sparse_attention]": 4,
                     "compress_rates[heavily_compressed_attention]": 16}),
    ("llama4_text", {"attention_chunk_size": 6}),
    ("qwen3_next", {"linear_conv_kernel_dim": 4}),
    ("nemotron_h", {"sliding_window": 8, "conv_kernel": 4, "chunk_size": 8}),
])
def test_derived_config_has_small_consistent_boundaries(mt, expect):
    model, cfg, _, params = build.build_model(mt)
    assert models.boundaries_of(cfg.get_text_config(decoder=True)) == expect
    assert params["hidden_size"] <= 128 and params.get("num_hidden_layers", 0) <= 12
    assert sum(p.numel() for p in model.parameters()) < models.MAX_PARAMS


def test_derived_layers_show_every_layer_kind():
    p = models.derive_config("gemma3_text")
    assert p["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    p = models.derive_config("deepseek_v4")
    assert {"compressed_sparse_attention", "heavily_compressed_attention"} <= set(p["layer_types"])


def test_verdict_store_and_cli_listing(tmp_path, capsys):
    from kvcheck.checker.cli import main

    record_verdict(str(tmp_path), dict(model_type="mistral", dtype="float32", verdict="within-tolerance"))
    assert main(["diff", "--sut", "transformers", "--list-models", "--json", "--out", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out)
    by = {m["model_type"]: m for m in data["models"]}
    assert by["mistral"]["last_verdicts"]["float32"]["verdict"] == "within-tolerance"
    assert by["gpt_oss"]["last_verdicts"] == {}
    assert data["verdicts_file"] == str(tmp_path / "transformers-verdicts.json")


def test_cli_unsupported_is_exit_2_without_traceback(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"num_key_value_heads": 3}))
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "kvcheck", "diff", "--sut", "transformers", "--model-type",
                          "mistral", "--config-json", str(cfg), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 2
    assert "Traceback" not in out.stdout + out.stderr
    assert "unsupported: cannot build a tiny mistral" in out.stdout


def test_sweep_shares_a_composite_types_decoder_run(tmp_path):
    from kvcheck.engines.transformers.oracle import sweep

    rows = sweep(["gemma3", "gemma3_text"], dtypes=("float32",), scenarios=1, out_dir=str(tmp_path))
    assert [r["model_type"] for r in rows] == ["gemma3", "gemma3_text"]
    assert rows[0]["runs_as"] == rows[1]["runs_as"] == "gemma3_text"
    assert rows[0]["verdict"] == rows[1]["verdict"] in ("exact", "within-tolerance")
    stored = json.loads((tmp_path / "transformers-verdicts.json").read_text())
    assert set(stored) == {"gemma3|float32", "gemma3_text|float32"}


def test_sweep_with_patterns_keeps_each_patterns_verdict_per_reuse_path(tmp_path, monkeypatch):
    """scripts/findings-transformers.py --patterns: every pattern's row names its verdict per scenario
    kind, and the rendered table has one row per pattern run, a divergent path shown in its column.
    The patterns are gemma3_text's own (patterns.py); each run is stood in by a canned result (the runs
    themselves are tested in test_transformers_patterns.py)."""
    import importlib.util

    from kvcheck.engines.transformers import oracle

    def fake_run(model_type, dtype="float32", scenarios=1, seed=0, out_dir=None, cover=False, pattern=None, **kw):
        bad = pattern is not None and pattern[0] != pattern[-1]
        modes = {"one_chunk": ["exact"], "chunks": ["exact", "divergent"] if bad else ["within-tolerance"]}
        return dict(model_type=model_type, dtype=dtype, verdict="divergent" if bad else "within-tolerance",
                    suffix_modes=modes, layer_types=list(pattern) if pattern else None, counts={})

    monkeypatch.setattr(oracle, "run_diff", fake_run)
    listed = [dict(model_type="gemma3_text", layer_kinds=["full_attention", "sliding_attention"])]
    rows = oracle.sweep(None, dtypes=("float32",), scenarios=3, out_dir=None, patterns="orderings", listed=listed)
    pats = rows[0]["patterns"]
    ran = [p for p in pats if p.get("pattern")]
    assert len(ran) >= 3 and {p["set"] for p in ran} == {"default", "orderings"}
    assert rows[0]["verdict"] == "divergent" and rows[0]["default_verdict"] == "within-tolerance"
    spec = importlib.util.spec_from_file_location("ft", os.path.join(ROOT, "scripts", "findings-transformers.py"))
    ft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ft)
    table = [line for line in ft.render_patterns(rows, {"patterns": "orderings"}) if line.startswith("| gemma3_text")]
    assert len(table) == len([p for p in pats if p["verdict"] != "skipped"])
    for line, p in zip(table, [p for p in pats if p["verdict"] != "skipped"]):
        cells = line.split(" | ")
        bad = p["set"] != "default" and p["pattern"][0] != p["pattern"][-1]   # the default run is given none
        assert cells[5:8] == ["ok", "—", "**div**" if bad else "ok"], line
