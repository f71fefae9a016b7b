"""`kvcheck matrix --differential` on a toy engine with planted per-release behaviour
(toy_releases.py; each "release" is this python with $TOY_RELEASE set): the generated workloads,
a reuse loss and an unsound hit reported with their expected shrunk traces and reproducers, the
refusals, and bad --traces files. No real engine: each release's driver imports kvcheck only."""
from __future__ import annotations

import argparse
import html
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcheck.checker import cmd_differential
from kvcheck.checker.common import UsageError
from kvcheck.fuzz import registry
from kvcheck.fuzz.reuse_workloads import KINDS, check_sizes, check_workloads, generate

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "cli"))
import toy_releases  # noqa: E402
from badinput import assert_bad_input, run  # noqa: E402

SIZES = {"block": 4, "max_tokens": 40, "vocab": 50}


def sends(w):
    return [s for s in w["steps"] if s["op"] == "send"]


# ---- the workloads ---------------------------------------------------------------------------
def test_workloads_are_seeded_every_kind_within_the_sizes_and_independent_of_count() -> None:
    ws = generate(5, 8, SIZES)
    assert ws == generate(5, 8, SIZES) and ws[:3] == generate(5, 3, SIZES) and ws != generate(6, 8, SIZES)
    assert [w["kind"] for w in ws] == list(KINDS) * 2
    for w in ws:
        check_workloads([w], "w")
        assert all(1 <= len(s["tokens"]) <= SIZES["max_tokens"] - 6 for s in sends(w))
        assert all(t < SIZES["vocab"] for s in sends(w) for t in s["tokens"])
        finished = [s["r"] for s in w["steps"] if s["op"] == "finish"]
        assert sorted(finished) == sorted(s["r"] for s in sends(w))          # every request ends
    chat, resend, system, long_ = ws[:4]
    turns = [s["tokens"] for s in sends(chat)]
    assert all(b[:len(a) + len(s["output"])] == a + s["output"] for a, b, s in zip(turns, turns[1:], sends(chat)))
    r = [s["tokens"] for s in sends(resend)]
    assert r[0] == r[1] == r[2] and r[3][:-1] == r[0][:-1] and r[3] != r[0]
    sp = [s["tokens"] for s in sends(system)]
    common = min(len(os.path.commonprefix(sp)), 99)
    assert common >= SIZES["block"] and len({tuple(t[common:]) for t in sp}) == len(sp)
    assert len(sends(long_)[0]["tokens"]) >= 3 * SIZES["block"]


@pytest.mark.parametrize("bad", [None, [], {"block": 0, "max_tokens": 40, "vocab": 5},
                                 {"block": 4, "max_tokens": 9, "vocab": 5}, {"block": 4, "vocab": 5}])
def test_bad_sizes_are_one_line(bad) -> None:
    with pytest.raises(ValueError) as e:
        check_sizes(bad)
    assert "\n" not in str(e.value)


# ---- the command on toy releases --------------------------------------------------------------
@pytest.fixture
def toy(monkeypatch, tmp_path):
    """`--sut toy-releases` (and `no-replay`) resolvable, a python per toy release, the toy
    module importable by the drivers."""
    real = registry.get
    fakes = {"toy-releases": toy_releases.ENGINE, "no-replay": toy_releases.NoReplay()}
    monkeypatch.setattr(registry, "get", lambda name: fakes.get(name) or real(name))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))

    def python(release: str) -> str:
        p = tmp_path / f"py-{re.sub(r'[^A-Za-z0-9.]', '_', release)}"
        p.write_text(f'#!/bin/sh\nTOY_RELEASE={shlex.quote(release)} exec {sys.executable} "$@"\n')
        p.chmod(0o755)
        return str(p)
    return python


def differential(capsys, tmp_path, toy, *releases, layouts="toy", extra=()):
    out = tmp_path / "out"
    pys = [x for r in releases for x in ("--python", toy(r))]
    code, stdout, err = run(capsys, "matrix", "--sut", "toy-releases", "--differential", *pys, "--layouts", layouts,
                            "--seed", "3", "--workloads", "8", "--shrink-seconds", "10", "--json", "--out", str(out),
                            *extra)
    return code, json.loads(stdout), err, out


def test_a_planted_reuse_loss_is_reported_shrunk_with_a_two_release_reproducer(capsys, tmp_path, toy) -> None:
    code, data, _, out = differential(capsys, tmp_path, toy, "1.0", "2.0")
    assert code == 13, data
    lay = data["layouts"]["toy"]
    assert [s["release"] for s in lay["sides"]] == ["1.0", "2.0"]
    assert lay["less"]["2.0"]["1.0"] > 0 and lay["less"]["1.0"]["2.0"] == 0
    assert lay["sides"][1]["ratio"] < lay["sides"][0]["ratio"]
    (d,) = data["differences"]
    assert (d["less"], d["more"], d["check"]) == ("2.0", "1.0", None) and d["hit_less"] < d["hit_more"]
    steps = d["trace"]["steps"]            # the smallest trace showing it: two blocks, then one token more
    assert [s["op"] for s in steps] == ["send", "send"]
    assert [len(s["tokens"]) for s in steps] == [8, 9] and steps[1]["tokens"][:8] == steps[0]["tokens"]
    assert all(s["output"] == [] and s["chunk"] is None for s in steps)
    assert (out / "differential-toy-releases.md").read_text().count("reuse available elsewhere") >= 1
    env = dict(os.environ)
    rep = subprocess.run([sys.executable, d["reproducer"]], capture_output=True, text=True, env=env, timeout=120)
    assert rep.returncode == 1 and "still differs" in rep.stdout, rep.stdout + rep.stderr
    assert "--traces" in d["replay"]
    saved = json.loads(Path(d["path"]).read_text())
    assert check_workloads(saved, "saved") == [d["trace"]]


def test_the_html_page_has_the_tables_and_the_shrunk_difference_and_escapes_release_names(capsys, tmp_path, toy):
    evil = "<script>alert(1)</script>"            # a release name is data: it must never become markup
    code, data, _, out = differential(capsys, tmp_path, toy, evil, "2.0")
    assert code == 13, data
    page_path = out / "differential-toy-releases.html"
    assert str(page_path) in data["outputs"]
    page = page_path.read_text()
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    lay = data["layouts"]["toy"]
    (less,) = [s for s in lay["sides"] if s["release"] == "2.0"]
    e_evil = html.escape(evil)
    # the table: the row of 2.0 with its ratio and lookups, and its count of lookups below the other release
    assert (f"<td class=''>2.0</td><td class=''>{less['ratio']}</td><td class=''>{less['lookups']}</td>"
            in page), page
    assert f"<th>{e_evil}</th>" in page and f"<td class=''>{lay['less']['2.0'][evil]}</td>" in page
    (d,) = data["differences"]
    assert "reuse available elsewhere" in page and html.escape(d["reproduce"], quote=True) in page
    steps = d["trace"]["steps"]
    assert len(steps) == 2 and f"<td class=''>{len(steps[1]['tokens'])}: " in page
    hits = {rel: [r["hit"] for r in rs] for rel, rs in d["shrunk_hits"].items()}
    assert hits["2.0"][1] < hits[evil][1]       # the shrunk lookup, on both releases, in the page
    assert f"<th>hit on {e_evil}</th>" in page and f"<td class=''>{hits[evil][1]}</td>" in page
    text = run(capsys, "matrix", "--sut", "toy-releases", "--differential", "--python", toy("1.0"), "--python",
               toy("1.0"), "--layouts", "toy", "--workloads", "2", "--out", str(tmp_path / "o2"))[1]
    assert "differential-toy-releases.html" in text.splitlines()[-1]     # the console line names the page


def test_the_same_release_twice_differs_nowhere(capsys, tmp_path, toy) -> None:
    code, data, _, _ = differential(capsys, tmp_path, toy, "1.0", "1.0")
    assert code == 0 and data["differences"] == [] and data["layouts"]["toy"]["classes"] == [["1.0", "1.0 (2)"]]


def test_an_unsound_hit_is_a_finding_shrunk_to_its_check(capsys, tmp_path, toy) -> None:
    code, data, _, _ = differential(capsys, tmp_path, toy, "1.0", "3.0")
    assert code == 10, data
    (u, *_) = data["layouts"]["toy"]["unsound"]
    assert (u["release"], u["check"], u["more_than"]) == ("3.0", "hit_leaves_last_token", ["1.0"])
    d = next(x for x in data["differences"] if x["check"])
    assert d["less"] == "3.0"
    steps = d["trace"]["steps"]            # a prompt computed, then resent: one token is enough
    assert [len(s["tokens"]) for s in steps] == [1, 1] and steps[0]["tokens"] == steps[1]["tokens"]


def test_a_layout_a_release_lacks_is_cannot_express_and_nothing_compared_is_undecided(capsys, tmp_path, toy) -> None:
    code, data, _, _ = differential(capsys, tmp_path, toy, "1.0", "2.0", layouts="toy2")
    sides = data["layouts"]["toy2"]["sides"]
    assert [s["status"] for s in sides] == ["cannot express", "ran"] and "no toy2" in sides[0]["why"]
    assert code == 3


def test_a_saved_difference_replays_with_traces(capsys, tmp_path, toy) -> None:
    _, data, _, _ = differential(capsys, tmp_path, toy, "1.0", "2.0")
    path = data["differences"][0]["path"]
    code, again, _, _ = differential(capsys, tmp_path / "again", toy, "1.0", "2.0", extra=("--traces", path))
    assert code == 13 and again["layouts"]["toy"]["workloads"] == [data["differences"][0]["trace"]["name"]]


# ---- refusals ------------------------------------------------------------------------------------
def test_refusals_are_one_line(capsys, tmp_path, toy) -> None:
    py = toy("1.0")
    base = ["matrix", "--differential", "--out", str(tmp_path / "o")]
    assert_bad_input(*run(capsys, *base, "--sut", "toy-releases", "--python", py, "--layouts", "nope")[::2],
                     "--layouts", "nope")
    assert_bad_input(*run(capsys, *base, "--sut", "vllm", "--releases", "9.9", "--envs", str(tmp_path / "e"))[::2],
                     "9.9", "outside")
    assert_bad_input(*run(capsys, *base, "--sut", "no-replay", "--python", py)[::2], "no-replay", "replay_reuse")
    assert_bad_input(*run(capsys, *base, "--sut", "toy-releases", "--python", py, "--resume")[::2], "--resume")
    assert_bad_input(*run(capsys, *base, "--sut", "toy-releases", "--python", py, "--traces",
                          str(tmp_path / "missing.json"))[::2], "--traces", "no such file")
    assert_bad_input(*run(capsys, *base, "--sut", "toy-releases", "--python", py, "--shrink-seconds", "nan")[::2],
                     "--shrink-seconds")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00garbage")
    assert_bad_input(*run(capsys, *base, "--sut", "toy-releases", "--python", py, "--traces",
                          str(tmp_path / "bin.json"))[::2], "--traces")


json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 60) | st.text(max_size=5),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(
                               st.sampled_from(["name", "steps", "op", "r", "tokens", "output", "chunk", "trace", "x"]),
                               c, max_size=5), max_leaves=20)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(json_values, st.binary(max_size=40)))
def test_any_traces_file_is_workloads_or_one_line(tmp_path, data) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    args = argparse.Namespace(budget_per_cell=None, fuzz_option=None, resume=False, workers=1, traces=str(path),
                              shrink_seconds=1.0)
    try:
        got = cmd_differential.check_args(args, toy_releases.ENGINE)
    except UsageError as e:
        assert "\n" not in str(e) and str(e).startswith(f"--traces {path}")
        return
    assert isinstance(got, list) and got and all(isinstance(w["steps"], list) for w in got)


def test_a_driver_that_prints_garbage_or_dies_is_an_error_side_and_exit_3(capsys, tmp_path, toy) -> None:
    bad = tmp_path / "py-garbage"
    bad.write_text("#!/bin/sh\necho 'not json'\n")
    bad.chmod(0o755)
    dead = tmp_path / "py-dead"
    dead.write_text("#!/bin/sh\nexit 7\n")
    dead.chmod(0o755)
    code, out, _ = run(capsys, "matrix", "--sut", "toy-releases", "--differential", "--python", toy("1.0"),
                       "--python", str(bad), "--python", str(dead), "--layouts", "toy", "--json",
                       "--out", str(tmp_path / "o"))
    sides = json.loads(out)["layouts"]["toy"]["sides"]
    assert code == 3 and [s["status"] for s in sides] == ["ran", "error", "error"]
    assert "unreadable driver output" in sides[1]["why"] and "died (exit 7)" in sides[2]["why"]
