"""The reuse paths users take, as scenarios (engines/transformers/paths.py): one prompt cache
deep-copied per request, generate() continuing a cache, a left-padded batch through generate().
Clean models stay clean on a sliding, a full-attention and a hybrid short-conv model; each planted
fault is caught by its own path and not by the plain scenarios; runs of 4 and 10 scenarios are as
they were; a path the release refuses is `unsupported`."""

import json

import pytest

from kvcheck.engines.transformers import paths
from kvcheck.engines.transformers.paths import MODES
from kvcheck.engines.transformers.plan import SUFFIX_MODES


class _F:
    def __init__(self, name):
        self.name = name


# ---- the plan (no transformers needed) -------------------------------------------------------------
def test_plan_leaves_short_runs_as_they_were():
    b = {"sliding_window": 8}
    assert paths.plan(b, 4, 0) == paths.plan(b, 10, 0) == paths.plan(b, 12, 0) == []
    assert [it["mode"] for it in paths.plan(b, 13, 0)] == list(MODES)
    assert [it["mode"] for it in paths.plan(b, 26, 0)] == list(MODES) * 2
    assert [it["mode"] for it in paths.plan(b, 1, 0, _F("pad_rows_swapped"))] == list(MODES)   # its fault: one each
    assert paths.plan(b, 4, 0, _F("perturb_key")) == []
    for it in paths.plan(b, 26, 0):
        if it["mode"] == "batched_left_pad":
            assert 2 <= len(it["lengths"]) == len(set(it["lengths"])) <= 3 and it["P"] == max(it["lengths"])
        if it["mode"] == "shared_prefix":
            assert 2 <= len(it["suffixes"]) <= 3
    assert paths.plan({}, 13, 0)[0]["b"] == ("none", 8)          # full attention only: around 8 tokens


def test_pad_id_is_the_config_s_else_zero():
    class Cfg:
        def __init__(self, pid):
            self.pad_token_id = pid

        def get_text_config(self, decoder=True):
            return self

    assert paths.pad_id(Cfg(5), 100) == 5
    assert paths.pad_id(Cfg(None), 100) == 0 and paths.pad_id(Cfg(500), 100) == 0


# ---- on the installed transformers ---------------------------------------------------------------
@pytest.fixture
def tf(one_thread):                 # tests/conftest.py: single-threaded on a busy box
    return pytest.importorskip("transformers")


def _paths(res):
    return [s for s in res["scenarios"] if s["suffix_mode"] in MODES]


def _clean(res):
    from kvcheck.engines.transformers.interface import release
    json.dumps(res, allow_nan=False)
    got = _paths(res)
    assert [s["suffix_mode"] for s in got] == list(MODES)
    assert res["verdict"] in ("exact", "within-tolerance"), [(s["suffix_mode"], s["verdict"]) for s in got]
    shared, cont, batch = got
    assert 2 <= len(shared["copies"]) <= 3 and shared["prompt_cache_changed"] == []
    assert all(c["verdict"] in ("exact", "within-tolerance") and not c["shared_storage"] for c in shared["copies"])
    g = cont["generation"]
    assert g["match"] and g["scratch_match"] and g["logits_compared"] and g["max_abs_diff"] <= res["tolerance"]
    assert g["cache_keyword"] == ("cache" if release().startswith("5.24") else g["cache_keyword"])
    assert len(batch["rows"]) == len(batch["lengths"]) >= 2 and batch["divergent_rows"] == []
    assert all(r["match"] or r["tie_flip"] for r in batch["rows"])


# At 4 scenarios (what the release matrix and CI run) the JSON of mistral is the one before the
# reuse paths came: the same prefixes, suffixes, modes and greedy tokens (transformers 5.24.0, seed 0).
MISTRAL_4 = [(8, "on:sliding_window", 9, "one_chunk", None, [24, 93, 84]),
             (7, "off:sliding_window-1", 9, "token_by_token", None, [9, 9, 9]),
             (9, "off:sliding_window+1", 9, "chunks", [4, 4, 1], [48, 49, 116]),
             (16, "on:2*sliding_window", 9, "one_chunk", None, [67, 49, 53])]


def test_four_scenarios_of_mistral_are_as_before(tf):
    from kvcheck.engines.transformers.oracle import run_diff
    res = run_diff("mistral", scenarios=4, seed=0, trace=False)
    got = [(s["prefix_len"], s["prefix_boundary"], s["suffix_len"], s["suffix_mode"], s["chunks"],
            s["generation"]["tokens_with_cache"]) for s in res["scenarios"]]
    if tf.__version__ == "5.24.0":
        assert got == MISTRAL_4
    assert [g[:5] for g in got] == [m[:5] for m in MISTRAL_4]
    assert "unsupported" not in res["counts"] and list(res["suffix_modes"]) == list(SUFFIX_MODES)


def test_mistral_is_clean_on_every_path_from_13_scenarios(tf):
    from kvcheck.engines.transformers.oracle import run_diff
    res = run_diff("mistral", scenarios=13, seed=0, trace=False)
    assert [s["index"] for s in _paths(res)] == [10, 11, 12]          # after the assisted-decoding ones
    assert list(res["suffix_modes"])[-3:] == list(MODES)
    _clean(res)


@pytest.mark.parametrize("model_type", ["llama", "lfm2", "qwen3_next"])   # full attention; short conv; linear attention
def test_other_cache_kinds_are_clean(tf, model_type, monkeypatch):
    from kvcheck.engines.transformers.oracle import run_diff
    monkeypatch.setattr(paths, "FIRST_AT", 3)          # the paths alone, after one plain scenario
    res = run_diff(model_type, scenarios=4, seed=0, trace=False)
    assert len(res["scenarios"]) == 4
    _clean(res)


@pytest.mark.parametrize("fault, mode", [("shared_copy_aliases", "shared_prefix"),
                                         ("generate_stale_prefix", "generate_continue"),
                                         ("pad_rows_swapped", "batched_left_pad")])
def test_each_planted_fault_is_caught_by_its_path_only(tf, fault, mode):
    """shared_copy_aliases is applied to the plain scenario's restore too (the restore shares the
    fault layer with the snapshot) and it stays clean there: one copy continued once cannot see
    it; the other two touch nothing but their own path."""
    from kvcheck.engines.transformers.oracle import run_diff
    res = run_diff("mistral", scenarios=1, seed=0, fault=fault, trace=False)
    assert res["verdict"] == "divergent" and len(res["scenarios"]) == 4
    plain = res["scenarios"][0]
    assert plain["verdict"] in ("exact", "within-tolerance")
    assert plain["fault"]["applied"] == (fault == "shared_copy_aliases")
    for s in _paths(res):
        if s["suffix_mode"] == mode:
            assert s["verdict"] == "divergent" and s["fault"]["applied"] and s["fault_layer"] == res["fault_layer"]
        else:
            assert s["verdict"] in ("exact", "within-tolerance") and not s["fault"]["applied"]
    hit = next(s for s in _paths(res) if s["suffix_mode"] == mode)
    if mode == "shared_prefix":
        assert hit["copies"][0]["verdict"] != "divergent"            # the first request is right...
        assert hit["copies"][1]["verdict"] == "divergent"            # ...the next copies a grown prompt cache
        assert {r["layer"] for r in hit["prompt_cache_changed"]} == {res["fault_layer"]}
        assert hit["first_divergent_layer"] == res["fault_layer"]
    if mode == "batched_left_pad":
        assert hit["divergent_rows"] == [0, 1]


def test_a_path_the_release_refuses_is_unsupported(tf, monkeypatch):
    """generate() raising on its arguments before any forward (as a release that cannot left-pad
    a model would) is `unsupported` with the reason; the run stays clean."""
    from kvcheck.engines.transformers.oracle import run_diff
    orig = tf.GenerationMixin._prepare_position_ids_for_generation

    def refuse(self, inputs, model_kwargs):
        if (model_kwargs.get("attention_mask") == 0).any():
            raise ValueError("left padding is not supported by this model")
        return orig(self, inputs, model_kwargs)
    monkeypatch.setattr(tf.GenerationMixin, "_prepare_position_ids_for_generation", refuse)
    monkeypatch.setattr(paths, "FIRST_AT", 3)
    res = run_diff("llama", scenarios=4, seed=0, trace=False)
    got = {s["suffix_mode"]: s for s in _paths(res)}
    assert got["batched_left_pad"]["verdict"] == "unsupported"
    assert "left padding is not supported" in got["batched_left_pad"]["reason"]
    assert "refused before any forward" in got["batched_left_pad"]["reason"]
    assert got["generate_continue"]["verdict"] in ("exact", "within-tolerance")
    assert res["verdict"] in ("exact", "within-tolerance") and res["counts"]["unsupported"] == 1


def test_a_crash_inside_generate_is_an_error_naming_path_and_module(tf, monkeypatch):
    from kvcheck.engines.transformers.oracle import run_diff
    orig = tf.models.llama.modeling_llama.LlamaMLP.forward

    def forward(self, x):
        if x.shape[0] > 1 and x.shape[1] == 1:         # a batch's decode step (calibration is a prefill)
            raise RuntimeError("the MLP fails on a batch")
        return orig(self, x)
    monkeypatch.setattr(tf.models.llama.modeling_llama.LlamaMLP, "forward", forward)
    monkeypatch.setattr(paths, "FIRST_AT", 3)
    res = run_diff("llama", scenarios=4, seed=0, trace=False)
    batch = next(s for s in _paths(res) if s["suffix_mode"] == "batched_left_pad")
    assert batch["verdict"] == "error" and res["verdict"] == "error"
    assert "generate (left-padded batch) crashed in layer 0" in batch["error"] and ".mlp" in batch["error"]
    assert "the MLP fails on a batch" in batch["error"]


def test_deepseek_v4_left_padding_divergence_is_its_forward_not_the_reuse(tf, monkeypatch):
    """DeepSeek-V4 (5.24.0): a left-padded row diverges from the row alone (its compressor groups
    the cache by index, pads included); the padded batch without a cache diverges the same, so the
    scenario names the padding, and stays divergent (nothing papered over)."""
    from kvcheck.engines.transformers.oracle import run_diff
    monkeypatch.setattr(paths, "FIRST_AT", 3)
    res = run_diff("deepseek_v4", scenarios=4, seed=0, trace=False)
    batch = next(s for s in _paths(res) if s["suffix_mode"] == "batched_left_pad")
    if batch["verdict"] != "divergent":
        pytest.skip(f"no left-padding divergence on transformers {tf.__version__}")
    assert batch["without_cache"]["explained_by"] == "padding" and batch["without_cache"]["same_tokens"]
    shared, cont = (next(s for s in _paths(res) if s["suffix_mode"] == m) for m in MODES[:2])
    assert shared["verdict"] in ("exact", "within-tolerance") and cont["verdict"] in ("exact", "within-tolerance")
