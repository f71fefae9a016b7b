"""`kvcheck matrix --differential --traces PATH`: a directory of workload files, and campaign
traces turned into workloads by their engine (`Engine.trace_workload`): what a converted vLLM
(both drives) and SGLang trace keeps, a real vLLM finding trace replayed on vLLM against itself,
and any garbage file or directory under --traces refused in one line (exit 2)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcheck.checker import cmd_differential
from kvcheck.checker.common import UsageError
from kvcheck.engines.sglang.engine import ENGINE as SGLANG
from kvcheck.engines.vllm.engine import ENGINE as VLLM
from kvcheck.fuzz.reuse_workloads import check_workloads, generate
from kvcheck.spec.trace import FORMAT, Step, Trace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "cli"))
import toy_releases  # noqa: E402
from badinput import assert_bad_input, run  # noqa: E402

SIZES = {"block": 4, "max_tokens": 40, "vocab": 50}


def args_for(path: Path) -> argparse.Namespace:
    return argparse.Namespace(budget_per_cell=None, fuzz_option=None, resume=False, workers=1, traces=str(path),
                              shrink_seconds=1.0)


def trace(sut: str, steps: list[tuple[str, dict]], **meta) -> Trace:
    return Trace(Trace.from_dict({"format": FORMAT, "config": {}, "steps": []}).config,
                 [Step(a, p) for a, p in steps], engine=f"{sut}-fuzz", sut=sut, seed=4, meta=meta)


def sends(w):
    return [s for s in w["steps"] if s["op"] == "send"]


# ---- what a converted trace keeps --------------------------------------------------------------
def test_a_vllm_manager_drive_trace_sends_each_prompt_where_it_is_first_looked_up() -> None:
    a, b, c = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9], [7, 7, 7]
    t = trace("vllm", [("submit", {"r": "r0", "tokens": a, "salt": "s1"}), ("submit", {"r": "r1", "tokens": b}),
                       ("submit", {"r": "r2", "tokens": c}),              # never scheduled: left out
                       ("lookup", {"r": "r1", "chunk": 9}),               # looked up before r0
                       ("lookup", {"r": "r0", "chunk": 4}), ("prefill", {"r": "r0", "chunk": 2}),
                       ("decode", {"r": "r1", "tok": 11}), ("preempt", {"r": "r1"}),
                       ("lookup", {"r": "r1", "chunk": 5}),               # its resumption: dropped
                       ("decode", {"r": "r1", "tok": 12}), ("evict_blocks", {"block_ids": [1]}),
                       ("finish", {"r": "r1"}), ("finish", {"r": "r0"})], drive="single")
    w = VLLM.trace_workload(t)
    check_workloads([w], "w")
    assert w["steps"] == [{"op": "send", "r": "r1", "tokens": b, "output": [11, 12], "chunk": None},
                          {"op": "send", "r": "r0", "tokens": a, "output": [], "chunk": 4},
                          {"op": "finish", "r": "r1"}, {"op": "finish", "r": "r0"}]


def test_a_vllm_engine_drive_trace_sends_at_the_step_in_submission_order() -> None:
    t = trace("vllm", [("submit", {"r": "r0", "tokens": [1, 2, 3], "prio": 3, "max_tokens": 2}),
                       ("submit", {"r": "r1", "tokens": [1, 2, 4]}), ("abort", {"r": "r1"}),   # before any step
                       ("submit", {"r": "r2", "tokens": [5, 6]}), ("step", {}),
                       ("submit", {"r": "r3", "tokens": [1, 2, 3, 9]}), ("step", {}), ("step", {}),
                       ("abort", {"r": "r3"})], drive="engine")
    w = VLLM.trace_workload(t)
    assert [(s["op"], s["r"]) for s in w["steps"]] == [("send", "r0"), ("finish", "r0"), ("send", "r2"),
                                                       ("finish", "r2"), ("send", "r3"), ("finish", "r3")]
    assert [s["tokens"] for s in sends(w)] == [[1, 2, 3], [5, 6], [1, 2, 3, 9]]
    assert VLLM.trace_workload(trace("vllm", [("submit", {"r": "r0", "tokens": [1]}), ("abort", {"r": "r0"})])) is None


def test_an_sglang_trace_keeps_the_first_chunk_and_the_decoded_output() -> None:
    t = trace("sglang", [("submit", {"r": "a", "tokens": list(range(12))}), ("submit", {"r": "b", "tokens": [1, 2]}),
                         ("chunk", {"r": "a", "n": 4}), ("chunk", {"r": "a", "n": 8}), ("decode", {"r": "a", "tok": 3}),
                         ("match", {"r": "b"}), ("evict", {"n": 2}), ("abort", {"r": "b"}), ("finish", {"r": "a"})])
    assert SGLANG.trace_workload(t)["steps"] == [
        {"op": "send", "r": "a", "tokens": list(range(12)), "output": [3], "chunk": 4},
        {"op": "send", "r": "b", "tokens": [1, 2], "output": [], "chunk": None},
        {"op": "finish", "r": "b"}, {"op": "finish", "r": "a"}]


@pytest.mark.parametrize("bad", [("submit", {"r": "r0", "tokens": "abc"}), ("submit", {"r": 5, "tokens": [1]}),
                                 ("lookup", {"r": "r0", "chunk": -1}), ("decode", {"r": "r0", "tok": "x"})])
def test_malformed_steps_are_one_line_naming_the_step(bad) -> None:
    t = trace("vllm", [("submit", {"r": "r0", "tokens": [1, 2]}), bad])
    with pytest.raises(ValueError) as e:
        VLLM.trace_workload(t)
    assert "\n" not in str(e.value) and "steps[1]" in str(e.value)


# ---- --traces on the command line --------------------------------------------------------------
def test_a_directory_is_every_json_file_sorted_with_unique_names(tmp_path) -> None:
    ws = generate(2, 3, SIZES)
    (tmp_path / "b.json").write_text(json.dumps(ws[:2]))
    (tmp_path / "a.json").write_text(json.dumps([ws[1], ws[2]]))
    (tmp_path / "notes.txt").write_text("not read")
    (tmp_path / "t.json").write_text(json.dumps(trace("vllm", [("submit", {"r": "r0", "tokens": [1, 2, 3]}),
                                                                ("lookup", {"r": "r0", "chunk": 3})]).to_dict()))
    got = cmd_differential.check_args(args_for(tmp_path), VLLM)
    n1, n2 = ws[1]["name"], ws[2]["name"]
    assert [w["name"] for w in got] == [n1, n2, ws[0]["name"], f"{n1}-2", "t"]
    assert got[-1]["kind"] == "trace" and sends(got[-1])[0]["tokens"] == [1, 2, 3]


def test_a_trace_of_another_engine_or_with_no_request_is_one_line(capsys, tmp_path, monkeypatch) -> None:
    from kvcheck.fuzz import registry
    real = registry.get
    monkeypatch.setattr(registry, "get", lambda name: toy_releases.ENGINE if name == "toy-releases" else real(name))
    d = tmp_path / "traces"
    d.mkdir()
    vtrace = trace("vllm", [("submit", {"r": "r0", "tokens": [1, 2, 3]}), ("lookup", {"r": "r0", "chunk": 3})])
    (d / "v.json").write_text(json.dumps(vtrace.to_dict()))
    base = ["matrix", "--differential", "--python", sys.executable, "--out", str(tmp_path / "o"), "--traces"]
    assert_bad_input(*run(capsys, *base, str(d), "--sut", "sglang", "--layouts", "radix")[::2],
                     str(d / "v.json"), "a trace of 'vllm'")
    assert_bad_input(*run(capsys, *base, str(d), "--sut", "toy-releases", "--layouts", "toy")[::2],
                     str(d / "v.json"), "a trace of 'vllm'")
    (d / "v.json").write_text(json.dumps(trace("vllm", [("step", {}), ("reset_prefix_cache", {})]).to_dict()))
    assert_bad_input(*run(capsys, *base, str(d), "--sut", "vllm", "--layouts", "full")[::2],
                     str(d / "v.json"), "no request")
    (d / "v.json").unlink()
    assert_bad_input(*run(capsys, *base, str(d), "--sut", "vllm", "--layouts", "full")[::2],
                     str(d), "no *.json")


values = st.one_of(st.none(), st.booleans(), st.integers(-2, 60), st.text(max_size=3), st.sampled_from(["r0", "r1"]),
                   st.lists(st.integers(-2, 60), max_size=4), st.lists(st.text(max_size=2), max_size=2))
steps = st.lists(st.one_of(st.fixed_dictionaries({
    "action": st.sampled_from(["submit", "lookup", "prefill", "decode", "finish", "preempt", "step", "abort", "match",
                               "chunk", "evict", "begin_step"]),
    "params": st.dictionaries(st.sampled_from(["r", "tokens", "chunk", "tok", "n"]), values, max_size=4)}), values),
    max_size=6)
traces = st.fixed_dictionaries({
    "format": st.sampled_from([FORMAT, FORMAT, "kvcheck-trace/0", 3]), "sut": st.sampled_from(["vllm", "sglang",
                                                                                              "toy-releases", "spec"]),
    "config": st.one_of(st.just({}), st.dictionaries(st.sampled_from(["block_size", "x"]), values, max_size=1)),
    "meta": st.one_of(st.just({}), st.fixed_dictionaries({"drive": st.sampled_from(["engine", "single", 1])}), values),
    "steps": steps})
json_values = st.recursive(values, lambda c: st.lists(c, max_size=3) | st.dictionaries(
    st.sampled_from(["name", "steps", "op", "r", "tokens", "trace", "format"]), c, max_size=4), max_leaves=12)
contents = st.one_of(st.binary(max_size=30), json_values.map(json.dumps), traces.map(json.dumps),
                     st.integers(0, 3).map(lambda s: json.dumps(generate(s, 2, SIZES))))
names = st.sampled_from(["a.json", "b.json", "c.json", "d.txt", "e.JSON"])


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(files=st.dictionaries(names, contents, max_size=3), as_dir=st.booleans(),
       eng=st.sampled_from([VLLM, SGLANG, toy_releases.ENGINE]))
def test_any_traces_file_or_directory_is_workloads_or_one_line(files, as_dir, eng) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, data in files.items():
            (root / name).write_bytes(data if isinstance(data, bytes) else data.encode())
        arg = root if as_dir or not files else root / sorted(files)[0]
        try:
            got = cmd_differential.check_args(args_for(arg), eng)
        except UsageError as e:
            assert "\n" not in str(e) and str(e).startswith(f"--traces {arg}"), str(e)
            return
        assert got and check_workloads(got, "got") == got
        assert len({w["name"] for w in got}) == len(got)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(raw=st.lists(st.fixed_dictionaries({"action": st.sampled_from(
    ["submit", "submit", "lookup", "decode", "finish", "step", "abort", "match", "chunk", "preempt"]),
    "params": st.dictionaries(st.sampled_from(["r", "r", "tokens", "chunk", "tok", "n"]), values, max_size=4)}),
    max_size=8), drive=st.sampled_from(["engine", "single"]), eng=st.sampled_from([VLLM, SGLANG]))
def test_an_engine_converts_any_steps_to_a_workload_none_or_one_line(raw, drive, eng) -> None:
    t = trace(eng.name, [(x["action"], x["params"]) for x in raw], drive=drive)
    try:
        w = eng.trace_workload(t)
    except ValueError as e:
        assert "\n" not in str(e) and str(e).startswith("steps["), str(e)
        return
    assert w is None or check_workloads([w], "w") == [w]


# ---- a real finding trace, replayed on vLLM against itself ---------------------------------------
def test_a_real_vllm_finding_trace_replays_on_vllm_against_itself(capsys, tmp_path) -> None:
    pytest.importorskip("vllm")
    found = tmp_path / "found"
    fuzz = subprocess.run([sys.executable, "-m", "kvcheck.checker.cli", "fuzz", "--sut", "vllm", "--layout", "full",
                           "--fault", "drop_ref_on_free", "--budget", "300", "--seed", "0", "--json", "--out",
                           str(found)], capture_output=True, text=True, timeout=600)
    assert fuzz.returncode == 10, fuzz.stdout[-2000:] + fuzz.stderr[-2000:]
    (path,) = found.glob("*.json")
    t = Trace.load(path)
    submitted = [s.params["tokens"] for s in t.steps if s.action == "submit"]
    w = VLLM.trace_workload(t)
    assert submitted and [s["tokens"] for s in sends(w)] == submitted     # (every request here is scheduled)
    out = tmp_path / "out"
    code, stdout, err = run(capsys, "matrix", "--sut", "vllm", "--differential", "--python", sys.executable,
                            "--python", sys.executable, "--layouts", "full", "--traces", str(path), "--json",
                            "--out", str(out))
    data = json.loads(stdout)
    assert code == 0, (data, err)
    assert data["layouts"]["full"]["workloads"] == [path.stem]
    assert [s["lookups"] for s in data["layouts"]["full"]["sides"]] == [len(submitted)] * 2
    saved = json.loads((out / "workloads" / "full.json").read_text())
    assert [s["tokens"] for s in sends(saved[0])] == submitted
