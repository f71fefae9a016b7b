"""Layer patterns: each model type is run not only in its derived miniature but with the order of
its layer kinds a checkpoint has and every short ordering, each set through the class's own
fields and checked on the built model."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from kvcheck.engines.transformers import build, models, patterns  # noqa: E402
from kvcheck.engines.transformers.oracle import run_diff  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.usefixtures("one_thread")     # tests/conftest.py
S, F, L = "sliding_attention", "full_attention", "linear_attention"


def default_of(mt):
    return patterns.effective(patterns.make_config(mt, models.derive_config(mt)))


def test_orderings_are_deterministic_capped_and_each_kind_leads():
    got = patterns.orderings([S, F])
    assert got == patterns.orderings([S, F]) and len(got) == patterns.MAX_ORDERINGS
    assert {p[0] for p in got} == {S, F} and {p[-1] for p in got} == {S, F}
    assert [S, F, S, F] not in got                      # a repetition of a shorter one
    assert [S, F] not in patterns.orderings([S, F], exclude=[[S, F]])
    assert patterns.orderings([F]) == []


def test_labels_are_short_and_distinct():
    assert patterns.label([S, F, L]) == "S F L"
    assert patterns.label(["moe", "mlp", F]) == "MO ML F"


@pytest.mark.parametrize("mt", ["cwm", "zamba2", "recurrent_gemma", "lfm2", "bamba", "nemotron_h", "deepseek_v4"])
def test_every_planned_pattern_reads_back_from_the_config(mt):
    """Types not tuned for: every pattern is set through some field of the class and its constructed
    config reads back exactly that pattern (or the pattern is unexpressible, never a crash)."""
    rows = [r for r in patterns.plan(mt, "all", default_of(mt)) if "pattern" in r]
    assert rows, mt
    for r in rows:
        params = patterns.express(mt, models.derive_config(mt), r["pattern"])
        assert patterns.effective(patterns.make_config(mt, params)) == r["pattern"], (mt, r["label"])


def test_checkpoint_patterns_come_from_the_class_fields():
    cp, how = patterns.checkpoint("cwm", default_of("cwm"))      # a list: one whole period
    assert cp == [F, S, S, S] and "period" in how
    cp, _ = patterns.checkpoint("jamba", default_of("jamba"))    # attn_layer_period 8 / offset 4
    assert cp == [L] * 4 + [F] + [L] * 3
    params = patterns.express("jamba", models.derive_config("jamba"), cp)
    assert (params["attn_layer_period"], params["attn_layer_offset"]) == (8, 4)
    assert patterns.checkpoint("qwen3_next", default_of("qwen3_next")) is None      # the same as the default


@pytest.mark.parametrize("mt,pattern", [("cwm", [S, F]), ("lfm2", ["conv", F])])
def test_built_model_follows_the_pattern_and_is_compared(mt, pattern):
    """A first layer that is sliding or a conv (recurrent-state) layer: the model is built with it (its
    cache layers checked) and reuse is compared with a recompute."""
    res = run_diff(mt, scenarios=2, seed=1, pattern=pattern)
    assert res["verdict"] in ("exact", "within-tolerance"), res.get("reason") or res.get("errors")
    assert res["layer_types"] == pattern and res["pattern"] == pattern
    mapping = patterns.cache_mapping()
    assert res["cache_layer_classes"] == [mapping[k].__name__ for k in pattern]
    assert res["scenarios_run"] >= 2


def test_unexpressible_pattern_is_unsupported_with_a_reason():
    res = run_diff("jamba", scenarios=1, pattern=[L, F, F])      # one attention layer per period only
    assert res["verdict"] == "unsupported"
    assert "cannot express the pattern L F F" in res["reason"] and "attn_layer_period" in res["reason"]
    with pytest.raises(patterns.Unexpressible):
        patterns.express("falcon_h1", models.derive_config("falcon_h1"), ["hybrid", F])


def test_check_built_rejects_a_cache_that_does_not_follow():
    model, cfg, _, _ = build.build_model("qwen3_next")
    from kvcheck.engines.transformers.interface import prefill
    import torch

    _, cache = prefill(model, torch.zeros((1, 3), dtype=torch.long))
    assert patterns.check_built(patterns.effective(cfg), cache) is None
    assert "does not follow" in patterns.check_built([F] * len(cache.layers), cache)


def test_layer_caches_name_recurrent_and_linear_states():
    qn = patterns.layer_caches("qwen3_next")
    assert qn[L]["cache_class"] == "LinearAttentionLayer"
    assert qn[L]["objects"] == {"conv_states": "swa_window", "recurrent_states": "recurrent_state"}
    assert qn[F]["objects"] == {"keys": "swa_window", "values": "swa_window"}
    lfm = patterns.layer_caches("lfm2")                 # its default config has no conv layer: found in its code
    assert lfm["conv"]["cache_class"] == "LinearAttentionLayer"
    v4 = patterns.layer_caches("deepseek_v4")           # classes the modeling file registers
    assert v4["compressed_sparse_attention"]["objects"]["compressed_kv"] == "compressed_kv"


def test_cli_json_names_every_patterns_verdict(tmp_path, capsys):
    from kvcheck.checker.cli import main

    code = main(["diff", "--sut", "transformers", "--model-type", "cwm", "--patterns", "checkpoint",
                 "--scenarios", "1", "--json", "--out", str(tmp_path)])
    data = json.loads(capsys.readouterr().out)
    rows = data["patterns"]
    assert [r["set"] for r in rows] == ["default", "checkpoint"]
    assert all(r["pattern"] and r["label"] and r["verdict"] for r in rows)
    assert rows[1]["label"] == "F S S S" and rows[0]["label"] == "F S"
    assert data["pattern_label"] == rows[0]["label"] and "--patterns checkpoint" in data["command"]
    assert code == data["exit_code"] and data["verdict"] in ("exact", "within-tolerance", "divergent", "error")
    stored = json.loads((tmp_path / "transformers-verdicts.json").read_text())
    assert list(stored) == ["cwm|float32"]          # only the default run is recorded


def test_cli_bad_patterns_value_is_exit_2_one_line():
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "kvcheck", "diff", "--sut", "transformers", "--model-type",
                          "mistral", "--patterns", "sideways"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "--patterns" in out.stderr and "Traceback" not in out.stderr
