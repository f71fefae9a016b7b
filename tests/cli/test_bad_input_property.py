"""Property: every command that reads a file, given a malformed one, exits 2 with one line on
stderr, no traceback, and changes no file that was already written.

Generated inputs (Hypothesis, derandomized: the same examples on every run): garbage bytes,
non-UTF-8 text, JSON of the wrong types and shapes, out-of-range values, unknown keys and very
deep nesting, for configs (spec, prove, explore, gate, fuzz, mutants, diff), traces (replay)
and report files (report --in, with the traces and mutants.json it reads). Each example is built to be invalid, so exit 2 is the only
right answer. The CLI runs in-process, so a few hundred examples take seconds.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from badinput import assert_bad_input, run, trace_dict

SETTINGS = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

INT_FIELDS = {"block_size": (1, 4096), "reserve": (0, 1 << 16), "max_inflight": (0, 1 << 16),
              "max_active": (0, 1 << 16), "max_version": (0, 1 << 16), "blocks": (1, 64),
              "requests": (1, 64), "seed": (0, 2 ** 63 - 1)}

json_leaf = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False, allow_infinity=False),
                      st.text(max_size=8), st.integers(-10**6, 10**6))
json_any = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=3),
                                                       st.dictionaries(st.text(max_size=5), c, max_size=3)),
                        max_leaves=8)
not_int = json_any.filter(lambda v: isinstance(v, bool) or not isinstance(v, int))


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def _garbage(obj_ok: bool = False) -> st.SearchStrategy[bytes]:
    """Bytes that are not a JSON object (so never a valid file of any kind)."""
    def not_an_object(b: bytes) -> bool:
        try:
            return not isinstance(json.loads(b.decode()), dict)
        except (UnicodeDecodeError, ValueError, RecursionError):
            return True
    return st.binary(max_size=64).filter(not_an_object)


def _non_utf8(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    text = json.dumps(valid).encode()
    return st.tuples(st.integers(0, len(text)), st.sampled_from([b"\xff", b"\xc3\x28", b"\x80", b"\xfe\xfe"])
                     ).map(lambda t: text[:t[0]] + t[1] + text[t[0]:])


def _dumps(x: Any) -> bytes:
    return json.dumps(x).encode()


@st.composite
def bad_config_dict(draw) -> dict[str, Any]:
    kind = draw(st.sampled_from(["int_type", "int_range", "layers", "tiers", "maps", "unknown", "deep"]))
    if kind == "int_type":
        return {draw(st.sampled_from(sorted(INT_FIELDS))): draw(not_int)}
    if kind == "int_range":
        name = draw(st.sampled_from(sorted(INT_FIELDS)))
        lo, hi = INT_FIELDS[name]
        return {name: draw(st.one_of(st.integers(max_value=lo - 1), st.integers(hi + 1, hi + 10**30)))}
    if kind == "layers":
        layer = draw(st.one_of(
            json_any.filter(lambda v: not isinstance(v, (dict, str))),
            st.text(max_size=6).filter(lambda t: t not in ("full",)).filter(lambda t: t not in ("swa", "hca", "csa")),
            st.fixed_dictionaries({"kind": st.sampled_from(["swa", "hca", "csa"]),
                                   "window": st.one_of(not_int, st.integers(max_value=0))}),
            st.fixed_dictionaries({"kind": st.sampled_from(["hca", "csa"]), "window": st.just(6),
                                   "m": st.one_of(not_int, st.integers(max_value=0))}),
            st.fixed_dictionaries({"kind": json_any.filter(lambda v: v not in ("full", "swa", "hca", "csa"))}),
        ))
        return {"layers": draw(st.one_of(st.just([layer]), json_any.filter(lambda v: not isinstance(v, list)),
                                         st.just([])))}
    if kind == "tiers":
        return {"tiers": draw(st.one_of(json_any.filter(lambda v: not isinstance(v, list)),
                                        st.lists(json_any.filter(lambda v: v not in ("device", "host", "disk")),
                                                 min_size=1, max_size=3).map(lambda l: ["device"] + l),
                                        st.just(["host", "disk"]), st.just(["device", "device"])))}
    if kind == "maps":
        name = draw(st.sampled_from(["capacity", "page_tokens"]))
        key = "tail" if name == "capacity" else "swa"
        return {name: draw(st.one_of(json_any.filter(lambda v: not isinstance(v, dict)),
                                     st.fixed_dictionaries({key: not_int}),
                                     st.fixed_dictionaries({key: st.integers(max_value=-1)}),
                                     st.fixed_dictionaries({"bogus_kind": st.integers(0, 4)})))}
    if kind == "unknown":
        return {draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in INT_FIELDS and k not in
                                                            ("layers", "tiers", "capacity", "page_tokens"))): draw(json_any)}
    return {"layers": json.loads(_deep(draw(st.integers(50, 400))))}


def bad_config() -> st.SearchStrategy[bytes]:
    return st.one_of(_garbage(), _non_utf8({"blocks": 2}), bad_config_dict().map(_dumps),
                     st.integers(900, 5000).map(lambda n: _deep(n).encode()))


@st.composite
def bad_trace_dict(draw) -> dict[str, Any]:
    kind = draw(st.sampled_from(["config", "field", "step", "params", "expect", "format"]))
    if kind == "config":
        return trace_dict(config=draw(bad_config_dict()))
    if kind == "field":
        key, ok = draw(st.sampled_from([("fault", (str, type(None))), ("engine", (str,)), ("sut", (str,)),
                                        ("seed", (int, type(None))), ("violation", (dict, type(None))),
                                        ("meta", (dict, type(None))), ("steps", (list,))]))
        return trace_dict(**{key: draw(json_any.filter(lambda v: isinstance(v, bool) or not isinstance(v, ok)))})
    if kind == "step":
        return trace_dict(steps=[draw(st.one_of(
            json_any.filter(lambda v: not isinstance(v, dict)),
            st.fixed_dictionaries({"action": json_any.filter(lambda v: not isinstance(v, str))}),
            st.fixed_dictionaries({"action": st.text(max_size=10).filter(lambda a: a not in _actions())})))])
    if kind == "params":
        params = draw(st.one_of(
            json_any.filter(lambda v: not isinstance(v, dict)),
            st.fixed_dictionaries({"r": not_int, "n": st.just(1)}),
            st.fixed_dictionaries({"r": st.integers(2, 10**9), "n": st.just(1)}),
            st.fixed_dictionaries({"r": st.integers(max_value=-1), "n": st.just(1)}),
            st.fixed_dictionaries({"r": st.just(0)}),
            st.fixed_dictionaries({"r": st.just(0), "n": st.just(1), "zz": st.integers(0, 3)})))
        return trace_dict(steps=[{"action": "submit", "params": params}])
    if kind == "expect":
        exp = draw(st.one_of(json_any.filter(lambda v: not isinstance(v, dict) and v not in (None, 0, 0.0, False, "", [], {})),
                             st.fixed_dictionaries({"violations": json_any.filter(
                                 lambda v: v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)))}),
                             st.fixed_dictionaries({"decision": json_any.filter(lambda v: v is not None and not isinstance(v, dict))})))
        return trace_dict(steps=[{"action": "submit", "params": {"r": 0, "n": 1}, "expect": exp}])
    return trace_dict(format=draw(json_any.filter(lambda v: v != "kvcheck-trace/1")))


def _actions() -> set[str]:
    from kvcheck.spec.actions import ACTIONS
    return set(ACTIONS)


def bad_trace() -> st.SearchStrategy[bytes]:
    return st.one_of(_garbage(), _non_utf8(trace_dict()), bad_trace_dict().map(_dumps),
                     st.integers(900, 5000).map(lambda n: _deep(n).encode()))


def bad_report() -> st.SearchStrategy[tuple[str, bytes]]:
    """(file name, content): a report file that is not one kvcheck could have written."""
    shapes = st.one_of(
        json_any.filter(lambda v: not isinstance(v, dict)),
        st.fixed_dictionaries({"exit_code": st.integers(0, 13)}),                       # no verdict
        st.fixed_dictionaries({"verdict": not_int.filter(lambda v: not isinstance(v, str)),
                               "exit_code": st.integers(0, 13)}),
        st.fixed_dictionaries({"verdict": st.text(max_size=8), "exit_code": not_int}),
        st.fixed_dictionaries({"verdict": st.text(max_size=8), "exit_code": st.integers(0, 13),
                               "engines": json_any.filter(lambda v: not isinstance(v, dict) or v)
                               .filter(lambda v: not isinstance(v, dict))}),
        st.fixed_dictionaries({"verdict": st.text(max_size=8), "exit_code": st.integers(0, 13),
                               "engines": st.fixed_dictionaries({"walk": json_any.filter(
                                   lambda v: bool(v) and not isinstance(v, dict))})}),
        st.fixed_dictionaries({"verdict": st.text(max_size=8), "exit_code": st.integers(0, 13),
                               "violation": json_any.filter(lambda v: v and not isinstance(v, dict))}),
    ).map(_dumps)
    content = st.one_of(_garbage(), _non_utf8({"verdict": "holds", "exit_code": 0}), shapes,
                        st.integers(900, 5000).map(lambda n: _deep(n).encode()))
    header_only = st.fixed_dictionaries({"verdict": st.text(max_size=8), "exit_code": st.integers(0, 13)}).map(_dumps)
    return st.one_of(st.tuples(st.just("report.json"), content),
                     st.tuples(st.sampled_from(["prove.json", "explore.json"]), st.one_of(content, header_only)),
                     st.tuples(st.just("mutants.json"), st.one_of(_garbage(), bad_mutants().map(_dumps))))


def bad_mutants() -> st.SearchStrategy[dict[str, Any]]:
    """`kvcheck mutants --json` output saved next to a report, broken in one place."""
    row = {"fault": "shared_free_list", "expected": "five_state_routing", "status": "killed",
           "engines": {"walk": {"detected": True, "caught_by": ["five_state_routing"], "seconds": 0.1,
                                "expected_caught": True}}}
    return st.one_of(
        st.fixed_dictionaries({"faults": json_any.filter(lambda v: not isinstance(v, list)), "exit_code": st.just(0)}),
        st.fixed_dictionaries({"faults": st.just([row]), "exit_code": not_int}),
        st.fixed_dictionaries({"faults": st.lists(json_any.filter(lambda v: not isinstance(v, dict)), min_size=1,
                                                  max_size=2), "exit_code": st.just(0)}),
        st.fixed_dictionaries({"faults": st.just([{**row, "fault": 3}]), "exit_code": st.just(0)}),
        st.fixed_dictionaries({"faults": json_any.filter(lambda v: not isinstance(v, dict)).map(
            lambda v: [{**row, "engines": {"walk": v}}]), "exit_code": st.just(0)}),
        st.fixed_dictionaries({"faults": not_int.filter(lambda v: not isinstance(v, float)).map(
            lambda v: [{**row, "engines": {"walk": {**row["engines"]["walk"], "seconds": v}}}]),
            "exit_code": st.just(0)}))


CONFIG_COMMANDS = [
    ["spec"], ["prove", "--out", "{out}"], ["explore", "--out", "{out}"], ["gate", "--out", "{out}"],
    ["fuzz", "--budget", "10", "--out", "{out}"], ["fuzz", "--sut", "reference", "--budget", "10", "--out", "{out}"],
    ["mutants", "--budget-per-fault", "1s", "--fault", "shared_free_list"],
    ["diff", "--scenarios", "1", "--out", "{out}"],
]


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def _check(capsys, argv: list[str], d: Path) -> None:
    before = _snapshot(d)
    code, _, err = run(capsys, *argv)
    assert_bad_input(code, err)
    assert _snapshot(d) == before, "a file that was already written changed"


def _workdir() -> tuple[tempfile.TemporaryDirectory, Path]:
    t = tempfile.TemporaryDirectory()
    d = Path(t.name)
    (d / "out").mkdir()
    for name in ("report.json", "report.md", "prove.json", "explore.json"):
        (d / "out" / name).write_text("already written; must not change\n")
    return t, d


@SETTINGS
@given(cmd=st.sampled_from(CONFIG_COMMANDS), content=bad_config())
def test_every_config_reader_refuses_a_malformed_config(capsys, cmd, content) -> None:
    t, d = _workdir()
    with t:
        (d / "cfg.json").write_bytes(content)
        argv = [a.replace("{out}", str(d / "out")) for a in cmd] + ["--config", str(d / "cfg.json")]
        _check(capsys, argv, d)


@SETTINGS
@given(content=bad_trace(), sut=st.sampled_from([None, "spec", "reference"]), rep=st.booleans())
def test_replay_refuses_a_malformed_trace(capsys, content, sut, rep) -> None:
    t, d = _workdir()
    with t:
        (d / "trace.json").write_bytes(content)
        _check(capsys, ["replay", str(d / "trace.json")] + (["--sut", sut] if sut else [])
               + (["--reproducer", str(d / "rep")] if rep else []), d)


@SETTINGS
@given(item=bad_report(), html=st.booleans())
def test_report_refuses_malformed_report_files(capsys, item, html) -> None:
    t, d = _workdir()
    with t:
        rep = d / "out"
        for name in ("report.json", "prove.json", "explore.json"):
            (rep / name).unlink()
        (rep / "summary.md").write_text("already written; must not change\n")
        name, content = item
        (rep / name).write_bytes(content)
        _check(capsys, ["report", "--in", str(rep)] + (["--html"] if html else []), d)


@SETTINGS
@given(content=bad_trace(), html=st.booleans())
def test_report_refuses_a_malformed_trace_it_replays(capsys, content, html) -> None:
    """The report replays each finding's trace (the HTML timeline, the Markdown's steps): a
    trace file that is not one kvcheck wrote is bad input too."""
    t, d = _workdir()
    with t:
        rep = d / "out"
        for name in ("prove.json", "explore.json"):
            (rep / name).unlink()
        ce = rep / "counterexample-clean-seed0.json"
        ce.write_bytes(content)
        (rep / "report.json").write_text(json.dumps({
            "verdict": "violated", "exit_code": 10, "config": {}, "fault": None, "engines": {},
            "violation": {"step": 0, "action": "submit(r=0, n=1)", "invariants": ["admission_cap"], "where": [],
                          "trace": str(ce), "trace_steps": ["submit(r=0, n=1)"], "replay": f"kvcheck replay {ce}"}}))
        _check(capsys, ["report", "--in", str(rep)] + (["--html"] if html else []), d)


def test_the_report_fixtures_above_are_valid_when_unbroken(capsys) -> None:
    """The control: the same report with a well-formed trace and mutants.json renders (exit 0),
    so the properties above fail on what they break, not on the rest of the directory."""
    t, d = _workdir()
    with t:
        rep = d / "out"
        for name in ("prove.json", "explore.json"):
            (rep / name).unlink()
        ce = rep / "counterexample-clean-seed0.json"
        ce.write_text(json.dumps(trace_dict()))
        (rep / "report.json").write_text(json.dumps({
            "verdict": "violated", "exit_code": 10, "config": {}, "fault": None, "engines": {},
            "violation": {"step": 0, "action": "submit(r=0, n=1)", "invariants": ["admission_cap"], "where": [],
                          "trace": str(ce), "trace_steps": ["submit(r=0, n=1)"], "replay": f"kvcheck replay {ce}"}}))
        (rep / "mutants.json").write_text(json.dumps({"faults": [
            {"fault": "shared_free_list", "expected": "five_state_routing", "status": "killed",
             "engines": {"walk": {"detected": True, "caught_by": ["five_state_routing"], "seconds": 0.1,
                                  "expected_caught": True}}}], "exit_code": 0}))
        code, _, err = run(capsys, "report", "--in", str(rep), "--html")
        assert code == 0, err
        assert "data-step='0'" in (rep / "report.html").read_text()
