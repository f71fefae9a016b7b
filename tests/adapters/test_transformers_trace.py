"""The operation-level trace names the one operation a planted reuse bug lives in, and a crash in
one path is an `error` verdict that names path, layer and module while the other scenarios run."""

import pytest

pytest.importorskip("transformers")

from kvcheck.engines.transformers.oracle import run_diff  # noqa: E402
from kvcheck.engines.transformers.scenarios import decoder_layers  # noqa: E402

LAYER = 2


pytestmark = pytest.mark.usefixtures("one_thread")     # tests/conftest.py


def _wrap_forward(module, before):
    orig = module.forward

    def forward(*args, **kw):
        args, kw = before(args, kw)
        return orig(*args, **kw)

    module.forward = forward


def hide_last_cached_position_on_extend(model):
    """The planted bug: on the extend path (several new tokens on a cached prefix), layer LAYER's
    attention mask hides the last cached position; prefill and decode are untouched."""
    import torch

    attn = decoder_layers(model)[LAYER].self_attn

    def before(args, kw):
        hs = kw.get("hidden_states", args[0] if args else None)
        mask = kw.get("attention_mask")
        n = hs.shape[1]
        if mask is not None and n > 1 and mask.shape[-1] > n:
            mask = mask.clone()
            col = mask.shape[-1] - n - 1
            mask[..., col] = torch.finfo(mask.dtype).min if mask.is_floating_point() else False
            kw = dict(kw, attention_mask=mask)
        return args, kw

    _wrap_forward(attn, before)


def test_planted_mask_bug_is_traced_to_the_mask():
    res = run_diff("mistral", scenarios=6, seed=0, model_hook=hide_last_cached_position_on_extend)
    assert res["verdict"] == "divergent"
    assert res["first_divergent_layer"] == LAYER
    by_mode = {s["suffix_mode"]: s["verdict"] for s in res["scenarios"]}
    assert by_mode["token_by_token"] in ("exact", "within-tolerance")  # decode path is clean
    tr = res["operation_trace"]
    assert res["first_divergent_operation"] == f"layers.{LAYER}.self_attn.attention.mask"
    start = tr["call"]["start"]
    assert tr["how"].startswith(f"mask hides key positions [{start - 1}]")
    assert tr["in_recompute"] is False and tr["recompute"].startswith("only on reuse")


def perturb_k_proj_on_reuse(model):
    """The planted bug: layer LAYER's k_proj output is off by a constant whenever a cache with
    content is passed (the reuse path), never in a full forward."""
    layer = decoder_layers(model)[LAYER]
    state = {"reuse": False}

    def pre(_m, args, kw):
        cache = kw.get("cache")
        state["reuse"] = cache is not None and cache.get_seq_length() > 0

    def hook(_m, _inp, out):
        return out + 0.5 if state["reuse"] else out

    layer.register_forward_pre_hook(pre, with_kwargs=True)
    layer.self_attn.k_proj.register_forward_hook(hook)


def test_planted_projection_bug_is_traced_to_the_projection():
    res = run_diff("gemma3_text", scenarios=3, seed=0, model_hook=perturb_k_proj_on_reuse)
    assert res["verdict"] == "divergent" and res["first_divergent_layer"] == LAYER
    assert res["first_divergent_operation"] == f"layers.{LAYER}.self_attn.k_proj"
    assert "while its input is equal within tolerance" in res["operation_trace"]["how"]


def crash_on_decode(model):
    """The planted crash: layer 1's MLP raises on a one-token call with a cache (decode)."""
    layer = decoder_layers(model)[1]
    state = {"decode": False}

    def pre(_m, args, kw):
        hs = kw.get("hidden_states", args[0] if args else None)
        state["decode"] = hs.shape[1] == 1 and kw.get("cache") is not None

    def raise_on_decode(args, kw):
        if state["decode"]:
            raise RuntimeError("planted decode crash")
        return args, kw

    layer.register_forward_pre_hook(pre, with_kwargs=True)
    _wrap_forward(layer.mlp, raise_on_decode)


def test_crash_in_one_path_is_an_error_verdict_and_the_run_goes_on():
    res = run_diff("mistral", scenarios=3, seed=0, model_hook=crash_on_decode)
    assert res["verdict"] == "error"
    verdicts = [s["verdict"] for s in res["scenarios"]]
    assert verdicts.count("error") == 3  # every scenario greedy-decodes
    err = res["scenarios"][1]["error"]
    assert "\n" not in err
    assert "decode crashed in layer 1, module model.layers.1.mlp: RuntimeError: planted decode crash" in err
    assert err.startswith("scenario 1 (prefix 7, token_by_token)")


def test_deepseek_v32_runs_and_names_the_indexer_top_k():
    """Was a traceback (generic tiny config); now a verdict, traced to the indexer's top-k."""
    res = run_diff("deepseek_v32", scenarios=4, seed=0)
    assert res["verdict"] == "divergent"
    assert res["boundaries"] == {"index_topk": 3}
    assert res["first_divergent_operation"].endswith("self_attn.indexer.topk")
    assert "selected a different set of indices" in res["operation_trace"]["how"]
