"""Real ratios (``--sizes ratios``): the model's own granularities scaled together keep their ratios
and divisibility; the default (``fixed``) run is unchanged; MoE miniatures keep routing on."""

import json
import os
import subprocess
import sys
from fractions import Fraction

import pytest

pytest.importorskip("transformers")

from kvcheck.engines.transformers import models, ratios  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.usefixtures("one_thread")     # tests/conftest.py


def default_dict(mt):
    mapping, _ = models.config_mapping()
    return mapping[models.decoder_type(mt)]().get_text_config(decoder=True).to_dict()


# not tuned for: types with two or more distinct granularities in their default config
@pytest.mark.parametrize("mt", ["deepseek_v4", "dots3_note_text", "modernbert-decoder"])
def test_scaled_values_keep_the_defaults_ratios(mt):
    rep = ratios.report_for(mt, models.derive_config(mt))
    f = rep["fields"]
    assert len(f) >= 2 and rep["scale"] is not None
    s = Fraction(rep["scale"])
    default = {k: v["default"] for k, v in f.items()}
    scaled = {k: v["scaled"] for k, v in f.items()}
    assert default == ratios.own_sizes(default_dict(mt))
    for k, v in f.items():                      # one factor for all, except a documented cap
        if v.get("capped"):
            assert v["scaled"] == ratios.HIGH_WIDE and v["default"] * s > ratios.HIGH_WIDE
        else:
            assert v["scaled"] == v["default"] * s
    assert ratios.divisibility_kept(default, scaled)
    assert min(scaled.values()) >= ratios.LOW_WIDE and max(scaled.values()) <= ratios.HIGH_WIDE


def test_rounding_keeps_divisibility_and_spread_rules():
    own = {"a": 129, "b": 4096, "c": 4100}          # not powers of two: rounded, then made multiples again
    s, rule = ratios.choose_scale(list(own.values()))
    scaled = ratios.keep_divisibility(own, {k: max(1, round(v * s)) for k, v in own.items()})
    assert ratios.divisibility_kept(own, scaled)
    assert ratios.choose_scale([512, 2048]) == (Fraction(1, 128), "smallest >= 4, largest <= 64")
    s, rule = ratios.choose_scale([4, 512])
    assert 4 * s >= ratios.LOW_WIDE and "capped" in rule


def test_one_granularity_keeps_the_fixed_value():
    p = models.derive_config("mistral")
    rep = ratios.report_for("mistral", p)
    assert rep["scale"] is None and rep["fields"]["sliding_window"] == {"default": 4096, "scaled": p["sliding_window"]}
    assert ratios.apply(p, rep) == p


def test_ratios_config_is_applied_and_compress_rates_stay_a_dict():
    p = models.derive_config("deepseek_v4")
    q = ratios.apply(p, ratios.report_for("deepseek_v4", p))
    assert set(q["compress_rates"]) == set(p["compress_rates"]) and q["sliding_window"] != p["sliding_window"]
    assert q["compress_rates"]["heavily_compressed_attention"] == 64


EXPERTS = ("n_routed_experts", "num_local_experts", "num_experts")
TOPK = ("num_experts_per_tok", "num_experts_per_token", "moe_topk")


@pytest.mark.parametrize("mt", ["qwen3_moe", "qwen2_moe", "gpt_oss", "mixtral", "olmoe", "deepseek_v3"])
def test_moe_miniature_keeps_routing_on(mt):
    p = {**default_dict(mt), **models.derive_config(mt)}
    experts = [p[k] for k in EXPERTS if isinstance(p.get(k), int)]
    topk = [p[k] for k in TOPK if isinstance(p.get(k), int)]
    assert experts and topk, (mt, "no expert count / top-k field found")
    assert min(experts) > 1 and min(topk) > 1 and max(topk) < min(experts)


def test_plan_reaches_twice_the_largest_boundary_in_ratios_mode():
    from kvcheck.engines.transformers import plan

    bounds = {"sliding_window": 64, "compress": 2}
    fixed = [n for n, _ in plan.prefix_candidates(bounds, 1)]
    cap = ratios.multiple_cap(bounds, plan.MAX_MULTIPLE_LEN)
    wide = [n for n, _ in plan.prefix_candidates(bounds, 1, cap)]
    assert max(fixed) <= 65 and {128, 129} <= set(wide) and cap == 129
    assert plan.prefix_candidates({"w": 8}, 1, ratios.multiple_cap({"w": 8}, 40)) == plan.prefix_candidates({"w": 8}, 1)


def cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "kvcheck", "diff", "--sut", "transformers", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_cli_bad_sizes_value_is_exit_2_one_line():
    out = cli("--model-type", "mistral", "--sizes", "huge")
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "--sizes" in out.stderr and "Traceback" not in out.stderr


def test_default_json_has_no_new_keys(tmp_path, capsys):
    from kvcheck.checker.cli import main

    main(["diff", "--sut", "transformers", "--model-type", "mistral", "--scenarios", "2", "--json",
          "--out", str(tmp_path)])
    data = json.loads(capsys.readouterr().out)
    assert not {"sizes", "scale", "scale_rule", "size_fields"} & set(data) and "--sizes" not in data["command"]


@pytest.mark.slow
@pytest.mark.parametrize("mt", ["gemma3_text", "modernbert-decoder", "deepseek_v4"])
def test_cli_sizes_ratios_runs(mt, tmp_path):
    out = cli("--model-type", mt, "--sizes", "ratios", "--scenarios", "4", "--json", "--out", str(tmp_path))
    assert "Traceback" not in out.stderr and out.returncode in (0, 11), out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert data["sizes"] == "ratios" and "size_fields" in data and "--sizes ratios" in data["command"]
    assert data["scenarios_run"] >= 4
