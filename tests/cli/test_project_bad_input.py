"""A bad project file is one line naming its key path, exit 2, before anything runs; so is a
broken trace in the corpus (naming the file). Hand-picked cases, then Hypothesis-generated
garbage and one-key corruptions of a valid file (derandomized: the same examples every run)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from badinput import assert_bad_input, run, trace_dict

ROOT = Path(__file__).resolve().parents[2]
TOY = "examples.toy_allocator:ToyAllocator"
SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)


def gate(capsys, tmp_path: Path, text: str | bytes, *more: str, name: str = "kvcheck.toml") -> tuple[int, str, str]:
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return run(capsys, "gate", "--project", str(p), "--out", str(tmp_path / "o"), *more)


V = "[tool.kvcheck.systems.vllm]"
CASES = [
    ('[tool.kvcheck.systems.vllm]\nlayouts = ["full", "foo"]\n',
     "kvcheck.toml: [tool.kvcheck.systems.vllm] layouts[1]: unknown layout 'foo' (known: full, full+swa"),
    ('[systems.vllm]\nlayouts = ["full"]\nengines = ["walk"]\n',
     "[systems.vllm] engines[0]: does not apply to vllm 'walk' (for vllm: fuzz, replay-corpus)"),
    ('[systems.vllm]\nengines = ["fuzz"]\n', "[systems.vllm] layouts: missing"),
    ('[systems.spec]\nengines = ["fly"]\n', "[systems.spec] engines[0]: unknown engine 'fly'"),
    ('[systems.spec]\nengine = ["walk"]\n', "[systems.spec] engine: unknown key (known: engines,"),
    ('colour = 1\n[systems.spec]\n', "kvcheck.toml: colour: unknown key"),
    ('[systems.sglang]\n', "[systems] sglang: unknown system under test"),
    ('[systems.spec]\nbudgets = { walk = "30s" }\n', "[systems.spec.budgets] walk: walk's budget is a count of steps"),
    ('[systems.spec]\nengines = ["prove"]\nbudgets = { prove = 5 }\n', "[systems.spec.budgets] prove: prove takes no budget"),
    ('[systems.spec]\nbudget = "soon"\n', "[systems.spec] budget: budget must be a duration like 60s"),
    ('[systems.spec]\nbudget = [1]\n', "[systems.spec] budget: must be a budget"),
    ('[systems.spec]\nseeds = [0, -1]\n', "[systems.spec] seeds[1]: must be a non-negative integer"),
    ('seeds = "0"\n[systems.spec]\n', "seeds: must be a non-empty list of integers"),
    ('[systems.spec]\nexpected_faults = ["nope"]\n', "[systems.spec] expected_faults[0]: unknown fault 'nope'"),
    ('[systems.spec]\nexpected_faults = ["engine_refcount_double_decrement"]\n',
     "[systems.spec] expected_faults[0]: fault 'engine_refcount_double_decrement' is an engine fault"),
    ('[systems.spec]\nengines = ["prove"]\nexpected_faults = ["shared_free_list"]\n',
     "[systems.spec] expected_faults: need an engine that plants faults (walk or fuzz)"),
    ('[systems.vllm]\nlayouts = ["full"]\nexpected_faults = ["shared_free_list"]\n',
     "[systems.vllm] expected_faults[0]: fault 'shared_free_list' is planted by --sut spec, not by vllm"),
    (f'[systems."{TOY}"]\nexpected_faults = ["nope"]\n',
     f'[systems."{TOY}"] expected_faults[0]: unknown fault \'nope\' for --sut {TOY}; it declares: hash_only_hit'),
    ('[systems."no_such_module:X"]\nexpected_faults = ["f"]\n', "cannot import 'no_such_module'"),
    ('[systems.reference]\nlayouts = ["full"]\n', "[systems.reference] layouts: applies to vllm only"),
    ('[systems.reference]\nconfig = "missing.json"\n', "[systems.reference] config: cannot read"),
    ('[systems.spec]\nengines = ["walk", "walk"]\n', "[systems.spec] engines: 'walk' is listed twice"),
    ('[systems.spec]\nengines = []\n', "[systems.spec] engines: must be a non-empty list"),
    ('corpus = 3\n[systems.spec]\n', "corpus: must be a path"),
    ('systems = 3\n', "systems: must be a non-empty table"),
    ('', "systems: missing"),
    ('[systems.spec\n', "kvcheck.toml: invalid TOML"),
    (b'[systems.spec]\nengines = ["\xff"]\n', "not UTF-8"),
    # no pass without work: a budget too short for one step, an absurd one (issue: unearned pass)
    ('[systems.reference]\nbudget = "0.0000000001s"\n', "[systems.reference] budget: budget '0.0000000001s' is shorter"),
    ('[systems.reference]\nfault_budget = "' + "9" * 400 + 's"\n', "fault_budget: budget 999999999999... is too large"),
    ('[systems.spec]\nbudget = "' + "7" * 400 + '"\n', "[systems.spec] budget: budget 777777777777... is too large"),
    ('[known]\nfine_cow_same_step = { reason = "" }\n[systems.spec]\n', "known.fine_cow_same_step: reason must be"),
    ('[systems.spec]\nknown = { x = "y" }\n', "[systems.spec] known: applies to vllm only"),
    ('known_strict = "yes"\n[systems.spec]\n', "known_strict: must be true or false"),
    ('corpus = "c\\u0000d"\n[systems.spec]\n', "corpus: a path cannot hold a NUL byte"),
    ('[systems.reference]\nconfig = "a\\u0000b.json"\n', "[systems.reference] config: cannot read config"),
]


@pytest.mark.parametrize("text,needle", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_bad_project_file_is_one_line_naming_the_key(capsys, tmp_path, text, needle) -> None:
    code, _, err = gate(capsys, tmp_path, text)
    assert_bad_input(code, err, needle)
    assert not (tmp_path / "o" / "report.json").exists()        # nothing ran


def test_transformers_model_type_is_checked(capsys, tmp_path) -> None:
    code, _, err = gate(capsys, tmp_path, '[systems.transformers]\nmodel_types = ["mistral", "llama_9000"]\n')
    assert_bad_input(code, err, "[systems.transformers] model_types[1]: unknown or non-hybrid model type 'llama_9000'")


def test_pyproject_without_tool_kvcheck_and_cli_conflicts(capsys, tmp_path) -> None:
    code, _, err = gate(capsys, tmp_path, '[project]\nname = "x"\n', name="pyproject.toml")
    assert_bad_input(code, err, "pyproject.toml: no [tool.kvcheck] table")
    code, _, err = gate(capsys, tmp_path, '[systems.spec]\n', "--fault", "shared_free_list")
    assert_bad_input(code, err, "--fault/--steps/--seed apply to the default profile")
    code, _, err = run(capsys, "gate", "--project", str(tmp_path / "nope.toml"))
    assert_bad_input(code, err, "nope.toml: no such file")
    code, _, err = gate(capsys, tmp_path, '[systems.spec]\nengines = ["walk"]\n', "--junit", str(tmp_path / "j.txt"))
    assert_bad_input(code, err, "--junit", "unknown format '.txt'")


# ---- generated: garbage files, and one-key corruptions of a valid file --------------------

def toml(d: dict[str, Any]) -> str:
    """Top-level `key = value` lines with inline tables/arrays (JSON scalars are TOML scalars)."""
    def dumps(x: Any) -> str:
        return json.dumps(x, ensure_ascii=False)    # JSON's surrogate-pair escapes are not TOML's

    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{dumps(k)} = {val(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return dumps(v)
    return "".join(f"{dumps(k)} = {val(v)}\n" for k, v in d.items())


VALID = {"seeds": [0], "systems": {"spec": {"engines": ["walk"], "budgets": {"walk": 100}, "seeds": [1],
                                            "expected_faults": ["shared_free_list"], "fault_budget": "5s"},
                                   "vllm": {"layouts": ["full"], "engines": ["fuzz"], "budget": 100},
                                   "reference": {"engines": ["fuzz", "diff"], "budget": 50}}}
text = st.text(st.characters(exclude_categories=("Cc", "Cs")), max_size=6)     # no control characters
scalar = st.one_of(st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False, allow_infinity=False), text)
junk = st.recursive(scalar, lambda c: st.one_of(st.lists(c, max_size=2), st.dictionaries(text, c,
                                                                                           max_size=2)), max_leaves=4)


@st.composite
def corrupted(draw) -> tuple[dict[str, Any], str]:
    """A valid file with one key made wrong; returns (doc, the key the error must name)."""
    d = json.loads(json.dumps(VALID))
    kind = draw(st.sampled_from(["unknown_top", "unknown_system_key", "wrong_type", "bad_name"]))
    sysname = draw(st.sampled_from(sorted(d["systems"])))
    body = d["systems"][sysname]
    if kind == "unknown_top":
        k = draw(st.text("abcdefgh_", min_size=1, max_size=8).filter(lambda k: k not in ("corpus", "seeds", "systems")))
        d[k] = draw(junk)
        return d, k
    if kind == "unknown_system_key":
        k = draw(st.text("abcdefgh_", min_size=1, max_size=8).filter(
            lambda k: k not in ("engines", "budget", "budgets", "seeds", "config")))
        body[k] = draw(junk)
        return d, k
    if kind == "wrong_type":
        k = draw(st.sampled_from(sorted(body)))
        ok_types = {"engines": list, "budgets": dict, "seeds": list, "expected_faults": list, "layouts": list,
                    "budget": (int, str), "fault_budget": (int, str)}[k]
        v = draw(junk.filter(lambda v: isinstance(v, bool) or not isinstance(v, ok_types)))
        body[k] = v
        return d, k
    k = draw(st.sampled_from([x for x in ("engines", "layouts", "expected_faults") if x in body]))
    body[k] = list(body[k]) + [draw(st.text("xyz!+_", min_size=1, max_size=6))]
    return d, f"{k}[{len(body[k]) - 1}]"


@SETTINGS
@given(corrupted())
def test_property_one_corrupted_key_is_named(capsys, tmp_path, case) -> None:
    doc, key = case
    code, _, err = gate(capsys, tmp_path, toml(doc))
    assert_bad_input(code, err, "kvcheck.toml", key)


def _not_a_project(b: bytes) -> bool:
    import tomllib
    try:
        return "systems" not in tomllib.loads(b.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError, ValueError):
        return True


@SETTINGS
@given(st.one_of(st.binary(max_size=80), st.text(max_size=40).map(str.encode), st.just(b"[" * 2000)
                 ).filter(_not_a_project))
def test_property_garbage_project_file_is_exit_2(capsys, tmp_path, data) -> None:
    code, _, err = gate(capsys, tmp_path, data)
    assert_bad_input(code, err, "kvcheck.toml")


# ---- the corpus: a broken trace names its file --------------------------------------------

corpus_garbage = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda d: json.dumps(d).encode(), st.one_of(
        st.builds(lambda s: trace_dict(steps=s), junk),
        st.builds(lambda s: trace_dict(sut=s), junk.filter(lambda v: not isinstance(v, str))),
        st.builds(lambda c: trace_dict(config=c), st.dictionaries(st.sampled_from(["blocks", "requests"]),
                                                                   st.integers(-3, 0), min_size=1)),
        st.builds(lambda f: trace_dict(fault=f, sut="spec"), st.sampled_from(["shared_free_list"])),
    )))


@SETTINGS
@given(corpus_garbage)
def test_property_broken_corpus_trace_names_the_file(capsys, tmp_path, data) -> None:
    (tmp_path / "corpus").mkdir(exist_ok=True)
    (tmp_path / "corpus" / "broken-1.json").write_bytes(data)
    code, _, err = gate(capsys, tmp_path, 'corpus = "corpus"\n[systems.spec]\nengines = ["replay-corpus"]\n')
    assert_bad_input(code, err, "broken-1.json")
