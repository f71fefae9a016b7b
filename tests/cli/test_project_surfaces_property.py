"""Property: the project gate's own surfaces (the corpus directory and its entries, `[known]`
acknowledgements, budgets) given garbage: exit 2 with one line naming the file or key, no
traceback, before any work, nothing already written changed; special files (a FIFO, a link to
/dev/zero) are refused at once, never read. And a name that becomes a file name (a user SUT's
fault called "../../../ESCAPED") never leaves the output directory."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from badinput import assert_bad_input, run, trace_dict

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PROJECT = '[systems.spec]\nengines = ["walk", "replay-corpus"]\nbudget = 200\n'


def _gate(capsys, d: Path, text: str = PROJECT) -> tuple[int, str]:
    (d / "kvcheck.toml").write_text(text)
    code, _, err = run(capsys, "gate", "--project", str(d / "kvcheck.toml"), "--out", str(d / "out"))
    return code, err


def _finding_trace(**over) -> dict:
    t = trace_dict(violation={"invariants": ["refcount_equals_holders"], "step": 0, "action": "submit"})
    t.update(over)
    return t


bad_violation = st.one_of(
    st.fixed_dictionaries({"invariants": st.one_of(st.integers(), st.text(max_size=4), st.lists(st.integers(), min_size=1))}),
    st.fixed_dictionaries({"step": st.one_of(st.integers(min_value=1, max_value=10**6), st.integers(max_value=-1),
                                             st.text(max_size=3), st.booleans())}),
    st.fixed_dictionaries({"check": st.one_of(st.integers(), st.lists(st.text(max_size=3), max_size=2))}),
    st.fixed_dictionaries({"kind": st.one_of(st.integers(), st.floats(allow_nan=False))}),
)
bad_decision = st.one_of(st.fixed_dictionaries({"kind": st.one_of(st.integers(), st.lists(st.integers()))}),
                         st.fixed_dictionaries({"k": st.one_of(st.text(max_size=3), st.booleans(), st.floats())}),
                         st.fixed_dictionaries({"reasons": st.one_of(st.integers(), st.text(max_size=3))}))
garbage_entry = st.one_of(
    st.binary(max_size=40),
    bad_violation.map(lambda v: json.dumps(_finding_trace(violation={"invariants": ["x"], "step": 0, **v})).encode()),
    bad_decision.map(lambda dec: json.dumps(_finding_trace(
        steps=[{"action": "submit", "params": {"r": 0, "n": 1}, "expect": {"decision": dec}}])).encode()),
)


@SETTINGS
@given(garbage_entry)
def test_a_garbage_corpus_entry_is_one_line_before_any_work(capsys, data) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "kvcheck-corpus").mkdir()
        (root / "kvcheck-corpus" / "z.json").write_bytes(data)
        (root / "out").mkdir()
        keep = root / "out" / "keep.txt"
        keep.write_text("earlier work")
        code, err = _gate(capsys, root)
        assert_bad_input(code, err, "z.json")
        assert keep.read_text() == "earlier work" and not (root / "out" / "report.json").exists()


@pytest.mark.parametrize("special", ["fifo", "devzero", "dir"])
def test_special_files_in_the_corpus_are_refused_not_read(capsys, tmp_path, special) -> None:
    corpus = tmp_path / "kvcheck-corpus"
    corpus.mkdir()
    entry = corpus / "z.json"
    if special == "fifo":
        os.mkfifo(entry)                 # reading it would block the gate forever
    elif special == "devzero":
        entry.symlink_to("/dev/zero")    # reading it would never end
    else:
        entry.mkdir()
    code, err = _gate(capsys, tmp_path)
    assert_bad_input(code, err, "z.json", "not a regular file")


acks = st.one_of(
    st.integers(), st.lists(st.text(alphabet="abz _", max_size=3), max_size=2),
    st.dictionaries(st.sampled_from(["fine_cow_same_step", "x"]),
                    st.one_of(st.integers(), st.booleans(), st.just(""), st.just({}),
                              st.fixed_dictionaries({"reason": st.one_of(st.integers(), st.just(" "))}),
                              st.fixed_dictionaries({"reason": st.just("r"), "why": st.text(alphabet="ab", max_size=3)})),
                    min_size=1, max_size=2),
    st.dictionaries(st.sampled_from(["../x", "a b", "", "ü" * 3]), st.just("reason"), min_size=1, max_size=1),
)
budgets = st.one_of(st.text(alphabet="0123456789.smhx -", max_size=6).filter(
    lambda s: not __import__("re").fullmatch(r"\s*\d+\s*|\s*\d*[1-9]\d*(\.\d+)?\s*[smh]\s*", s)),
    st.just("0.0000000001s"), st.just("0.5s"), st.just("9" * 400), st.just("9" * 300 + "s"))


def _toml(v) -> str:
    dumps = lambda x: json.dumps(x, ensure_ascii=False)  # noqa: E731 (TOML takes no surrogate escapes)
    return dumps(v) if not isinstance(v, dict) else "{ " + ", ".join(f"{dumps(k)} = {_toml(x)}" for k, x in v.items()) + " }"


@SETTINGS
@given(acks, budgets)
def test_garbage_acknowledgements_and_budgets_are_one_line(capsys, known, budget) -> None:
    with tempfile.TemporaryDirectory() as d:
        code, err = _gate(capsys, Path(d), f"known = {_toml(known)}\n" + PROJECT)
        assert_bad_input(code, err, "known")
        code, err = _gate(capsys, Path(d), f'[systems.reference]\nbudget = {json.dumps(budget)}\n')
        assert_bad_input(code, err, "budget")


def test_a_fault_name_never_leaves_the_output_directory(capsys, tmp_path, monkeypatch) -> None:
    """A user adapter's fault named like a path: the finding's files land inside --out."""
    (tmp_path / "escaping_sut.py").write_text(
        "from kvcheck.spec.sut import SpecSUT\n"
        "class EscapingSUT(SpecSUT):\n"
        "    faults = {'../../../ESCAPED': 'refcount_equals_holders'}\n"
        "    def __init__(self, fault=None):\n"
        "        super().__init__('shared_free_list' if fault else None)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "a" / "b" / "out"
    code, _, _ = run(capsys, "fuzz", "--sut", "escaping_sut:EscapingSUT", "--fault", "../../../ESCAPED",
                     "--budget", "3000", "--out", str(out))
    written = [p for p in tmp_path.rglob("*") if p.is_file() and "ESCAPED" in p.name]
    assert written and all(out in p.parents for p in written), written
    assert code != 0
    sys.modules.pop("escaping_sut", None)
