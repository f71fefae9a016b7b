"""The assisted-decoding path as scenarios (engines/transformers/assist.py): draft a burst, roll the
cache back with the release's own crop, continue; `generate()` with an assistant model. A planted
crop bug that the reuse scenarios cannot see is caught; clean models stay clean; a cache the
release cannot roll back is `unsupported` (never error nor divergent); the crop convention comes
from the installed release's `crop` signature."""

import json

import pytest

from kvcheck.engines.transformers import interface as itf
from kvcheck.engines.transformers.assist import MODES
from kvcheck.fuzz.boundary import CannotDrive


# ---- the crop convention, on fake signatures (no transformers needed) --------------------------
class Remove:                       # transformers 5.24: Cache.crop(tokens_to_remove), negative
    def crop(self, tokens_to_remove: int) -> None: ...


class Absolute:                     # transformers 5.0.0: Cache.crop(max_length), the length kept
    def crop(self, max_length: int) -> None: ...


class EncDec:                       # 5.0.0 EncoderDecoderCache.crop(maximum_length)
    def crop(self, maximum_length: int) -> None: ...


class Unknown:                      # a release kvcheck does not know: no number is passed
    def crop(self, n: int) -> None: ...


class NoCrop:
    pass


def test_crop_convention_is_read_from_the_release_signature():
    assert itf.crop_convention(Remove()) == itf.CROP_REMOVE
    assert itf.crop_convention(Absolute()) == itf.CROP_ABSOLUTE
    assert itf.crop_convention(EncDec()) == itf.CROP_ABSOLUTE
    assert itf.crop_convention(NoCrop()) is None
    with pytest.raises(CannotDrive, match=r"Unknown.crop takes 'n'"):
        itf.crop_convention(Unknown())
    # rolling 12 tokens back to 9, and back to what it holds (assisted decoding's crop(0))
    assert itf.crop_argument(itf.CROP_REMOVE, 12, 9) == -3
    assert itf.crop_argument(itf.CROP_ABSOLUTE, 12, 9) == 9
    assert itf.crop_argument(itf.CROP_REMOVE, 12, 12) == 0
    assert itf.crop_argument(itf.CROP_ABSOLUTE, 12, 12) == 12
    with pytest.raises(ValueError):
        itf.crop_argument(itf.CROP_REMOVE, 5, 6)


def test_crop_to_passes_the_number_in_the_release_convention():
    seen = []

    class R(Remove):
        def crop(self, tokens_to_remove):
            seen.append(("remove", tokens_to_remove))

    class A(Absolute):
        def crop(self, max_length):
            seen.append(("absolute", max_length))

    assert itf.crop_to(R(), 10, 7) == (itf.CROP_REMOVE, -3)
    assert itf.crop_to(A(), 10, 7) == (itf.CROP_ABSOLUTE, 7)
    assert seen == [("remove", -3), ("absolute", 7)]


def test_not_croppable_is_what_the_release_documents():
    class Layer:
        is_croppable = False

    class C:
        is_croppable = False
        layers = [Layer()]

    assert "is_croppable is False" in itf.not_croppable(C()) and "0:Layer" in itf.not_croppable(C())
    assert itf.not_croppable(Remove()) is None          # a release that does not say: the crop decides

    class Stateful:                 # transformers' flag: generate() refuses assisted decoding for it
        _is_stateful = True

    assert "Stateful._is_stateful is True" in itf.not_croppable(Remove(), Stateful())
    assert itf.not_croppable(Remove(), Remove()) is None


# ---- on the installed transformers ---------------------------------------------------------------
@pytest.fixture
def tf(one_thread):                 # tests/conftest.py: single-threaded on a busy box
    return pytest.importorskip("transformers")


def _assist(res):
    return [s for s in res["scenarios"] if s["suffix_mode"] in MODES]


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text"])
def test_sliding_models_are_clean_through_draft_roll_back_and_assistant(tf, model_type):
    from kvcheck.engines.transformers.oracle import run_diff
    res = run_diff(model_type, scenarios=20, seed=0)
    json.dumps(res, allow_nan=False)
    assert len(res["scenarios"]) == 20 and sum(res["counts"].values()) == 20
    assist = _assist(res)
    assert [s["suffix_mode"] for s in assist] == list(MODES) * 2
    assert res["verdict"] in ("exact", "within-tolerance"), [(s["suffix_mode"], s["verdict"]) for s in assist]
    for s in assist:
        assert s["verdict"] in ("exact", "within-tolerance") and s["max_abs_diff"] <= res["tolerance"]
        if s["suffix_mode"] != "generate_assistant":
            assert s["crop_convention"] == "remove" and s["past_recording"]
            assert s["length_after_crop"] == s["prefix_len"] + s["kept"]
        else:
            assert s["generation"]["match"] and s["generation"]["forwards"] > 0
    burst = [s for s in assist if s["suffix_mode"] == "assist_burst"]
    assert burst[0]["kept"] == 0                                          # a = 0: every draft rejected
    w = res["boundaries"]["sliding_window"]
    assert burst[0]["prefix_len"] < w <= burst[0]["prefix_len"] + burst[0]["extended"]   # the crop crosses it
    assert burst[1]["prefix_len"] > w


def test_linear_attention_models(tf, tmp_path):
    """qwen3_next: 5.24 documents its recurrent layers as not croppable: every assisted-decoding
    scenario is `unsupported` and the run is clean (deepseek_v4 likewise by its model class's
    `_is_stateful`: cropping it anyway crashed its next forward, kvcheck's mistake). lfm2 with short-conv layers (conv state only):
    croppable, and clean."""
    from kvcheck.engines.transformers.oracle import run_diff
    res = run_diff("qwen3_next", scenarios=10, seed=0)
    assist = _assist(res)
    assert [s["suffix_mode"] for s in assist] == list(MODES)
    assert all(s["verdict"] == "unsupported" and "is_croppable is False" in s["reason"] for s in assist)
    assert res["verdict"] in ("exact", "within-tolerance") and res["counts"]["unsupported"] == 3
    res = run_diff("deepseek_v4", scenarios=10, seed=0, trace=False)      # its compressor cannot rewind
    assert [s["verdict"] for s in _assist(res)] == ["unsupported"] * 3
    assert all("DeepseekV4ForCausalLM._is_stateful is True" in s["reason"] for s in _assist(res))
    cfg = tmp_path / "lfm2.json"
    cfg.write_text(json.dumps({"layer_types": ["conv", "full_attention", "conv", "full_attention"],
                               "num_hidden_layers": 4, "full_attn_idxs": [1, 3]}))
    res = run_diff("lfm2", config_json=str(cfg), scenarios=10, seed=0)
    assert "LinearAttentionLayer" in res["cache_layer_classes"]
    assert [s["verdict"] in ("exact", "within-tolerance") for s in _assist(res)] == [True] * 3
    assert res["verdict"] in ("exact", "within-tolerance")


def test_planted_crop_fault_is_caught_only_by_the_assisted_decoding_scenarios(tf, capsys, tmp_path):
    from kvcheck.checker.cli import main
    code = main(["diff", "--sut", "transformers", "--model-type", "mistral", "--scenarios", "10",
                 "--fault", "crop_keeps_stale", "--out", str(tmp_path), "--json"])
    res = json.loads(capsys.readouterr().out)
    assert code == 11 and res["exit_code"] == 11 and res["verdict"] == "divergent"
    assist = _assist(res)
    others = [s for s in res["scenarios"] if s["suffix_mode"] not in MODES]
    assert others and all(s["verdict"] in ("exact", "within-tolerance") for s in others)    # invisible there
    assert all(not s["fault"]["applied"] for s in others)
    assert [s["verdict"] for s in assist] == ["divergent"] * 3
    assert all(s["fault"]["applied"] and s["fault_layer"] == res["fault_layer"] for s in assist)
    burst = assist[0]
    assert burst["first_divergent_layer"] == res["fault_layer"]
    assert any(r["layer"] == res["fault_layer"] for r in burst["cache_diff"])


def _verdicts_not_bad(res):
    assert res["verdict"] not in ("divergent", "error"), [(s["suffix_mode"], s["verdict"]) for s in res["scenarios"]]


def test_a_cache_without_crop_is_unsupported_not_an_error(tf, monkeypatch):
    from kvcheck.engines.transformers.oracle import run_diff
    monkeypatch.setattr(tf.DynamicCache, "crop", None)
    res = run_diff("mistral", scenarios=10, seed=0)
    _verdicts_not_bad(res)
    assist = _assist(res)
    assert [s["verdict"] for s in assist] == ["unsupported"] * 3 and res["counts"]["unsupported"] == 3
    assert all("DynamicCache has no crop" in s["reason"] for s in assist)


def test_a_crop_the_release_refuses_before_changing_state_is_unsupported(tf, monkeypatch):
    """A crop that raises before touching the cache (as 5.0.0's sliding layers past the window
    do), whether kvcheck's roll-back or generate()'s own, is `unsupported` with the reason."""
    from kvcheck.engines.transformers.oracle import run_diff

    def crop(self, tokens_to_remove: int) -> None:      # called by the release's own Cache.crop
        raise ValueError("rolling back is not supported here")
    monkeypatch.setattr(tf.cache_utils.DynamicSlidingWindowLayer, "crop", crop)
    res = run_diff("mistral", scenarios=10, seed=0)
    _verdicts_not_bad(res)
    assist = _assist(res)
    assert [s["verdict"] for s in assist] == ["unsupported"] * 3
    assert all("rolling back is not supported here" in s["reason"] for s in assist)
    assert "before changing any state" in assist[0]["reason"]
    assert "generate() with an assistant rolled its cache back" in assist[2]["reason"]


def test_a_crop_that_breaks_midway_is_an_error(tf, monkeypatch):
    from kvcheck.engines.transformers.oracle import run_diff
    orig = tf.cache_utils.DynamicSlidingWindowLayer.crop

    def crop(self, tokens_to_remove: int) -> None:      # called by the release's own Cache.crop
        orig(self, tokens_to_remove)
        raise RuntimeError("crop failed after cropping")
    monkeypatch.setattr(tf.cache_utils.DynamicSlidingWindowLayer, "crop", crop)
    res = run_diff("mistral", scenarios=10, seed=0)
    assist = _assist(res)
    assert assist[0]["verdict"] == "error" and "crop failed after cropping" in assist[0]["error"]
    assert res["verdict"] == "error"


def test_the_crop_fault_brings_its_scenarios_to_a_short_run(tf):
    from kvcheck.engines.transformers.oracle import run_diff
    res = run_diff("mistral", scenarios=2, seed=0, fault="crop_keeps_stale")
    assert [s["suffix_mode"] for s in _assist(res)] == list(MODES) and len(res["scenarios"]) == 4
    assert res["verdict"] == "divergent"
    assert run_diff("mistral", scenarios=2, seed=0)["scenarios"][-1]["suffix_mode"] not in MODES
