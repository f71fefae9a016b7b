"""transformers driven through each release's own interface: the cache keyword comes from the model
class's own `forward` signature, the cache is read back from the output field the release declares,
and a model call that did not use the cache kvcheck passed (an interface change: transformers 5.16
swallows 5.24's `cache=` in `**kwargs`) is "cannot drive" (exit 3), never a divergence (exit 11).
An exception of transformers' own code stays the scenario's `error`
(tests/adapters/test_transformers_trace.py::test_crash_in_one_path_is_an_error_verdict...)."""

import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from kvcheck.engines.transformers import interface as itf
from kvcheck.fuzz.boundary import CannotDrive


# ---- the helper, on fake classes (no transformers needed) --------------------------------
class NewForward:                   # transformers 5.24
    def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None, **kwargs): ...


class OldForward:                   # transformers 5.16
    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, **kwargs): ...


class MambaForward:                 # the Mamba family in 5.16
    def forward(self, input_ids=None, cache_params=None, use_cache=None, **kwargs): ...


class SwallowsAll:                  # no explicit cache parameter: any cache keyword goes into **kwargs
    def forward(self, input_ids=None, use_cache=None, **kwargs): ...


def test_keyword_is_the_explicit_cache_parameter_of_the_forward_signature():
    assert itf.cache_keyword(NewForward()) == "cache"
    assert itf.cache_keyword(OldForward()) == "past_key_values"
    assert itf.cache_keyword(MambaForward) == "cache_params"
    assert itf.cache_kwargs(OldForward(), "C") == {"past_key_values": "C"}


def test_a_forward_that_declares_no_cache_parameter_is_cannot_drive():
    with pytest.raises(CannotDrive) as e:
        itf.cache_keyword(SwallowsAll())
    assert e.value.engine == "transformers"
    assert "SwallowsAll.forward declares none of the cache parameters" in e.value.what
    assert "swallowed" in e.value.what and "**kwargs" in e.value.what
    assert e.value.where.startswith("tests/adapters/test_transformers_boundary.py:")
    assert "\n" not in e.value.line


@dataclass
class OutNew:                       # 5.24's CausalLMOutputWithPast: a `cache` field
    logits: Any = None
    cache: Any = None

    @property
    def past_key_values(self):      # 5.24 keeps the old name as a deprecated alias: never read
        raise AssertionError("read the deprecated alias")


@dataclass
class OutOld:                       # 5.16's: a `past_key_values` field
    logits: Any = None
    past_key_values: Any = None


def test_returned_cache_is_read_from_the_field_the_output_declares():
    assert itf.returned_cache(OutNew(cache="C")) == "C"
    assert itf.returned_cache(OutNew(cache="C"), "cache") == "C"
    assert itf.returned_cache(OutOld(past_key_values="P")) == "P"
    assert itf.returned_cache(OutOld(past_key_values="P"), "past_key_values") == "P"
    assert itf.returned_cache(OutNew()) is None


class FakeCache:
    def __init__(self, n):
        self.n = n

    def get_seq_length(self):
        return self.n


def test_a_call_used_the_cache_when_it_returned_it_or_a_cache_holding_the_prefix():
    c = FakeCache(9)
    itf.check_used(NewForward(), c, 9, c, 5, "here")                    # the same object, updated
    itf.check_used(NewForward(), c, 9, FakeCache(14), 5, "here")        # a new one holding prefix + call
    with pytest.raises(CannotDrive) as e:                               # a fresh cache of the call's tokens only
        itf.check_used(NewForward(), c, 9, FakeCache(5), 5, "kvcheck/x.py:1")
    assert "kvcheck passed the cache as cache= to NewForward.forward and the model ignored it" in e.value.what
    assert "holding 5 tokens instead of 9 + 5" in e.value.what
    assert "the forward's cache parameters: cache" in e.value.what and e.value.where == "kvcheck/x.py:1"
    with pytest.raises(CannotDrive, match="returned no cache"):
        itf.check_used(OldForward(), c, 9, None, 5, "here")
    with pytest.raises(CannotDrive):                                    # a cache that cannot say: identity only
        itf.check_used(NewForward(), object(), None, object(), 5, "here")


# ---- the real models (transformers installed) --------------------------------------------
@pytest.fixture
def tf(one_thread):                 # tests/conftest.py: single-threaded on a busy box
    return pytest.importorskip("transformers")


def _diff(capsys, tmp_path, model_type="mistral", *extra):
    from kvcheck.checker.cli import main
    code = main(["diff", "--sut", "transformers", "--model-type", model_type, "--scenarios", "1",
                 "--out", str(tmp_path), *extra])
    return code, capsys.readouterr()


def _plant_swallowed_cache(monkeypatch, tf):
    """The planted interface drift: MistralForCausalLM.forward still declares `cache` but drops it
    (as 5.16 swallowed 5.24's keyword in **kwargs): every call runs without the cache."""
    cls = tf.MistralForCausalLM
    orig = cls.forward

    def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
        return orig(self, input_ids=input_ids, use_cache=use_cache, **kwargs)

    monkeypatch.setattr(cls, "forward", forward)


def test_planted_swallowed_cache_keyword_is_cannot_drive_not_divergent(tf, monkeypatch, capsys, tmp_path):
    _plant_swallowed_cache(monkeypatch, tf)
    code, out = _diff(capsys, tmp_path, "mistral", "--json")
    assert code == 3, out.out[-2000:]
    res = json.loads(out.out)
    assert res["exit_code"] == 3 and res["findings"] == [] and "scenarios" not in res
    cd = res["cannot_drive"]
    assert cd["engine"] == "transformers" and cd["release"] == tf.__version__
    assert "kvcheck passed the cache as cache= to MistralForCausalLM.forward and the model ignored it" in cd["what"]
    assert "the forward's cache parameters: cache" in cd["what"]
    assert cd["where"].startswith("kvcheck/engines/transformers/scenarios.py:")
    assert cd["line"].startswith(f"kvcheck cannot drive transformers {tf.__version__}: ")
    assert not (tmp_path / "transformers-verdicts.json").exists()      # no verdict about the model
    code, out = _diff(capsys, tmp_path, "mistral")                      # text: the one line
    assert code == 3 and out.out.strip() == cd["line"]


def test_a_forward_with_no_cache_parameter_is_cannot_drive_before_any_scenario(tf, monkeypatch, capsys, tmp_path):
    cls = tf.MistralForCausalLM
    orig = cls.forward

    def forward(self, input_ids=None, use_cache=None, **kwargs):
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        return orig(self, input_ids=input_ids, use_cache=use_cache, **kwargs)

    monkeypatch.setattr(cls, "forward", forward)
    code, out = _diff(capsys, tmp_path, "mistral", "--json")
    assert code == 3
    what = json.loads(out.out)["cannot_drive"]["what"]
    assert "MistralForCausalLM.forward declares none of the cache parameters kvcheck knows" in what


def test_kvchecks_own_failure_during_a_run_is_cannot_drive(tf, monkeypatch, capsys, tmp_path):
    """kvcheck's comparison failing (here: on a cache layout it does not know) is its side of the
    boundary: exit 3, not the scenario's `error` (exit 11)."""
    from kvcheck.engines.transformers import scenarios

    def compare_caches(got, ref):
        return {}["layers"]

    monkeypatch.setattr(scenarios, "compare_caches", compare_caches)
    code, out = _diff(capsys, tmp_path, "mistral", "--json")
    assert code == 3
    cd = json.loads(out.out)["cannot_drive"]
    assert cd["what"] == "KeyError: 'layers'" and cd["where"].startswith("kvcheck/engines/transformers/scenarios.py:")


def test_project_run_is_undecided_not_a_finding(tf, monkeypatch, tmp_path):
    from kvcheck.engines.transformers.project import run_transformers
    _plant_swallowed_cache(monkeypatch, tf)
    sys_ = SimpleNamespace(budgets={"diff": SimpleNamespace(steps=1)}, options={"cover": False})
    run = run_transformers(sys_, "mistral", 0, tmp_path)
    assert run.code == 3
    [check] = run.checks
    assert check["verdict"] == "undecided" and check["note"].startswith("kvcheck cannot drive transformers")
    # measured (a project's default): still undecided, never a finding; the coverage check rides along
    sys_.options["cover"] = True
    run = run_transformers(sys_, "mistral", 0, tmp_path)
    by = {c["check"]: c for c in run.checks}
    assert run.code == 3 and set(by) == {"reuse_equals_recompute", "engine_coverage"}, by
    assert by["reuse_equals_recompute"]["verdict"] == "undecided" and all(c["verdict"] != "failed" for c in by.values())


def test_the_installed_release_is_driven_through_its_own_keyword(tf, capsys, tmp_path):
    from kvcheck.engines.transformers.build import build_model
    model = build_model("mistral")[0]
    assert itf.cache_keyword(model) in itf.cache_parameters(type(model))
    code, out = _diff(capsys, tmp_path, "mistral", "--json")
    res = json.loads(out.out)
    assert code == 0 and res["verdict"] in ("exact", "within-tolerance") and "cannot_drive" not in res
