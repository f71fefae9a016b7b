"""transformers' known defect `recurrent_state_multitoken_extend`, recognised from a run's own
scenarios (engines/transformers/known.py): named as a finding, accepted only with
--acknowledge, and never hiding a divergence it does not explain."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvcheck.checker import matrix as mx
from kvcheck.engines.transformers import known

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from badinput import run  # noqa: E402

NAME = known.MULTITOKEN


def sc(mode, verdict, layer=None, error=None):
    return {"suffix_mode": mode, "verdict": verdict, "first_divergent_layer": layer, "error": error}


LT = ["linear_attention", "full_attention"]


@pytest.mark.parametrize("res, hits, explained", [
    # the signature: decode right, multi-token extends wrong in a state layer
    ({"layer_types": LT, "scenarios": [sc("one_chunk", "divergent", 0), sc("token_by_token", "exact"),
                                       sc("chunks", "divergent", 0)]}, 2, True),
    # a crash in the mixer on a multi-token extend, per-layer types unknown (5.0's MambaCache)
    ({"layer_types": None, "scenarios": [sc("token_by_token", "within-tolerance"), sc(
        "chunks", "error", error="scenario 2 (prefix 5, chunks): extend crashed in layer 0, module "
                                 "backbone.layers.0.mixer: IndexError: index 1 is out of bounds")]}, 1, True),
    # the decode path is wrong too: not this defect
    ({"layer_types": LT, "scenarios": [sc("one_chunk", "divergent", 0), sc("token_by_token", "divergent", 0)]}, 0, False),
    # no token-by-token scenario ran: no evidence the decode path is right
    ({"layer_types": LT, "scenarios": [sc("one_chunk", "divergent", 0)]}, 0, False),
    # wrong first in a full-attention layer: not explained
    ({"layer_types": LT, "scenarios": [sc("one_chunk", "divergent", 1), sc("token_by_token", "exact")]}, 0, False),
    # one explained, one not: named, but the other stays a finding
    ({"layer_types": LT, "scenarios": [sc("one_chunk", "divergent", 0), sc("chunks", "divergent", 1),
                                       sc("token_by_token", "exact")]}, 1, False),
    ({"layer_types": LT, "scenarios": [sc("one_chunk", "exact"), sc("token_by_token", "exact")]}, 0, False),
])
def test_the_signature_is_read_from_the_scenarios(res, hits, explained) -> None:
    counts, all_ = known.recognise(res)
    assert counts.get(f"known:{NAME}", 0) == hits and all_ == explained


def test_an_unexplained_finding_leads_the_matrix_cell_even_beside_a_known_defect() -> None:
    row = {"name": NAME, "status": "finding", "check": "reuse_equals_recompute", "kind": "differential",
           "upstream": "transformers#45513"}
    plain = {"kind": "differential", "check": "reuse_equals_recompute", "message": "layer 1 differs"}
    both = mx.classify({"layout": "jamba", "code": 11, "result": {"findings": [plain], "known": [row]}})
    assert both["short"] == "finding: reuse_equals_recompute (+1 known)" and both["line"].startswith("differential")
    only = mx.classify({"layout": "mamba", "code": 11, "result": {"findings": [], "known": [row]}})
    assert only["short"] == f"finding: {NAME} (known, transformers#45513)"


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_mamba_on_the_installed_release_is_named_and_acknowledging_it_passes(capsys, tmp_path) -> None:
    import transformers
    if not known.KNOWN[NAME].in_release(transformers.__version__):
        pytest.skip(f"transformers {transformers.__version__} is outside {NAME}'s releases")
    args = ["diff", "--sut", "transformers", "--model-type", "mamba", "--scenarios", "6", "--out", str(tmp_path), "--json"]
    code, out, _ = run(capsys, *args)
    res = json.loads(out)
    if res["verdict"] not in ("divergent", "error"):
        pytest.skip(f"mamba is {res['verdict']} on transformers {transformers.__version__}: the defect is fixed there")
    assert code == 11 and res["findings"] == [] and [k["name"] for k in res["known"]] == [NAME]
    code, out, _ = run(capsys, *args, "--acknowledge", f"{NAME}=upstream fix pending")
    res = json.loads(out)
    assert code == 0 and res["known"][0]["status"] == "acknowledged" and "--acknowledge" in res["command"]
    # mistral has no recurrent state: acknowledging changes nothing there, the row says it was not hit
    code, out, _ = run(capsys, "diff", "--sut", "transformers", "--model-type", "mistral", "--scenarios", "3",
                       "--out", str(tmp_path), "--json", "--acknowledge", f"{NAME}=x")
    res = json.loads(out)
    assert code == 0 and res["known"][0]["status"] == "acknowledged, not hit"


def test_a_crash_of_an_uncropped_recording_sliding_layer_is_its_own_known_defect() -> None:
    crash = ("scenario 15 (prefix 7, crop_continue): decode crashed in layer 0, module model.layers.0.self_attn: "
             "RuntimeError: The size of tensor a (9) must match the size of tensor b (8) at non-singleton dimension 3")
    res = {"layer_types": None, "cache_layer_classes": ["DynamicSlidingWindowLayer", "DynamicSlidingWindowLayer"],
           "scenarios": [sc("one_chunk", "exact"), sc("token_by_token", "exact"),
                         dict(sc("crop_continue", "error"), error=crash)]}
    assert known.recognise(res) == ({f"known:{known.UNCROPPED}": 1}, True)
    # the same crash in a full-attention layer's cache, or outside crop_continue: not this defect
    full = dict(res, cache_layer_classes=["DynamicLayer", "DynamicLayer"])
    assert known.recognise(full) == ({}, False)
    other = dict(res, scenarios=[sc("token_by_token", "exact"), dict(sc("assist_burst", "error"), error=crash)])
    assert known.recognise(other) == ({}, False)


def test_a_divergence_explicit_positions_remove_is_its_own_known_defect() -> None:
    agree, differ = {"ran": True, "agrees": True}, {"ran": True, "agrees": False}
    res = {"layer_types": LT, "scenarios": [dict(sc("one_chunk", "divergent", 1), positions_probe=agree),
                                           dict(sc("token_by_token", "divergent", 1), positions_probe=agree)]}
    assert known.recognise(res) == ({f"known:{known.POSITIONS}": 2}, True)
    # the probe did not agree (moshi), or could not run (no position_ids parameter): not this defect
    for probe in (differ, {"ran": False, "why": "no position_ids"}):
        res = {"layer_types": LT, "scenarios": [dict(sc("one_chunk", "divergent", 1), positions_probe=probe)]}
        assert known.recognise(res) == ({}, False)
    # one explained by positions, one divergent without: named, and the other stays a finding
    res = {"layer_types": LT, "scenarios": [dict(sc("one_chunk", "divergent", 1), positions_probe=agree),
                                           dict(sc("chunks", "divergent", 1), positions_probe=differ)]}
    assert known.recognise(res) == ({f"known:{known.POSITIONS}": 1}, False)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
@pytest.mark.parametrize("planted", [True, False])
def test_the_positions_probe_names_a_forward_that_restarts_positions_and_only_that(planted, tmp_path) -> None:
    """A planted wrapper makes mistral's forward start the new tokens' positions at 0 when the caller
    passes none (Bamba's defect, on a model without it): the run diverges and the probe explains
    every divergent scenario; without the wrapper, mistral is clean and nothing is named."""
    import torch

    from kvcheck.engines.transformers.oracle import run_diff

    def restart_positions(model):
        forward = type(model).forward

        def wrapped(self, input_ids=None, position_ids=None, **kw):
            if position_ids is None and input_ids is not None:
                position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)
            return forward(self, input_ids=input_ids, position_ids=position_ids, **kw)
        wrapped.__signature__ = __import__("inspect").signature(forward)
        model.__class__ = type(type(model).__name__, (type(model),), {"forward": wrapped})

    res = run_diff("mistral", scenarios=6, seed=0, out_dir=str(tmp_path),
                   model_hook=restart_positions if planted else None)
    counts, explained = known.recognise(res)
    if planted:
        assert res["verdict"] == "divergent" and explained and counts == {
            f"known:{known.POSITIONS}": res["counts"]["divergent"]}
    else:
        assert res["verdict"] in ("exact", "within-tolerance") and counts == {}


def test_the_positions_probe_leaves_a_divergence_of_the_generation_alone() -> None:
    """A scenario whose extend agreed and whose generation diverged (dots3_note_text: a tie in its
    top-k while decoding) is not the extend's positions: the probe does not run, nothing is named."""
    from kvcheck.engines.transformers import positions
    got = positions.probe(runner=None, ids=None, prefix=3, steps=[4], restored=None, ref=None, tol=1e-6,
                          extend_diff=2e-7)
    assert got["ran"] is False and "generation" in got["why"]


def test_positions_and_the_multitoken_defect_together_are_both_named() -> None:
    """Bamba 5.4-5.12: its token-by-token continuation is wrong only by its positions (the probe
    agrees), its multi-token extends also by the Mamba2 mixer (the probe does not): both defects
    are named and together they explain the run."""
    agree, differ = {"ran": True, "agrees": True}, {"ran": True, "agrees": False}
    res = {"layer_types": LT, "scenarios": [dict(sc("one_chunk", "divergent", 0), positions_probe=differ),
                                           dict(sc("token_by_token", "divergent", 1), positions_probe=agree),
                                           dict(sc("chunks", "divergent", 0), positions_probe=differ)]}
    assert known.recognise(res) == ({f"known:{known.POSITIONS}": 1, f"known:{NAME}": 2}, True)


def test_a_generate_continue_equal_to_the_prefix_fed_twice_is_its_own_known_defect() -> None:
    """`generate_refeeds_cached_prefix`: only a divergent generate_continue whose probe found the
    whole prompt fed onto the prefix's cache again; anything else stays a finding."""
    twice, other = {"agrees": True, "max_abs_diff": 4.8e-07}, {"agrees": False, "max_abs_diff": 0.4}
    res = {"layer_types": ["mamba"] * 2, "scenarios": [sc("token_by_token", "exact"),
                                                     dict(sc("generate_continue", "divergent"), refeed_probe=twice)]}
    assert known.recognise(res) == ({f"known:{known.REFEED}": 1}, True)
    for s in (dict(sc("generate_continue", "divergent"), refeed_probe=other), sc("generate_continue", "divergent"),
              dict(sc("shared_prefix", "divergent"), refeed_probe=twice)):
        assert known.recognise({"layer_types": ["mamba"] * 2, "scenarios": [sc("token_by_token", "exact"), s]}) \
            == ({}, False)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_mamba2_generate_from_its_cache_is_probed_on_the_installed_release(capsys, tmp_path) -> None:
    """On a release with the defect (5.4.0-5.24.0), mamba2's generate_continue scenario is named by
    the probe's evidence and acknowledging it passes; on others nothing is named."""
    import transformers
    args = ["diff", "--sut", "transformers", "--model-type", "mamba2", "--scenarios", "13", "--out", str(tmp_path),
            "--json"]
    code, out, _ = run(capsys, *args)
    res = json.loads(out)
    cont = [s for s in res["scenarios"] if s["suffix_mode"] == "generate_continue"]
    if not known.KNOWN[known.REFEED].in_release(transformers.__version__):
        assert all(s["verdict"] != "divergent" for s in cont), cont
        return
    (s,) = [s for s in cont if s["verdict"] == "divergent"]
    assert s["refeed_probe"]["agrees"] and code == 11 and [k["name"] for k in res["known"]] == [known.REFEED], res
    code, out, _ = run(capsys, *args, "--acknowledge", f"{known.REFEED}=fixed in 5.25.0")
    assert code == 0 and json.loads(out)["known"][0]["status"] == "acknowledged"
