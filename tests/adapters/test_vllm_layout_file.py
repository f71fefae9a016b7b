"""`--layout-file`: a user's own vLLM layout, validated in one place, driven like a preset."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvcheck.engines.vllm.layout_file import parse_layout

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"groups": [{"kind": "mla", "block_size": 8}, {"kind": "swa", "block_size": 4, "window": 5},
                   {"kind": "swa", "block_size": 4, "window": 13},
                   {"kind": "chunked_local", "block_size": 8, "chunk": 16}]}
json_values = st.recursive(st.none() | st.booleans() | st.integers(-100, 100) | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
                           max_leaves=12)


def _parse(d):
    return parse_layout(d, "f.json", 4, 64)


def test_a_good_layout_parses():
    desc, groups, sched, ret = _parse(GOOD)
    assert groups == [("mla", 8, None), ("swa", 4, 5), ("swa", 4, 13), ("chunked_local", 8, 16)]
    assert sched == 8 and ret is None and desc


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["groups"][1].update(kind="mamba", window=None) or d["groups"][1].pop("window"),
     "groups[1].block_size"),                      # a mamba block must be the scheduler block
    (lambda d: d.update(groups=[{"kind": "full", "block_size": 4}, {"kind": "mamba", "block_size": 4}],
                        retention_interval=0), "retention_interval"),
    (lambda d: d.update(groups=[{"kind": "full", "block_size": 4}, {"kind": "mamba", "block_size": 4}],
                        use_eagle=True, eagle_groups=[1]), "eagle_groups"),   # no drafter layer is Mamba
    (lambda d: d["groups"][1].update(kind="compressed"), "groups[1].kind"),
    (lambda d: d["groups"][0].update(block_size=6), "groups[0].block_size"),
    (lambda d: d["groups"][0].update(block_size=True), "groups[0].block_size"),
    (lambda d: d["groups"][1].update(window=0), "groups[1].window"),
    (lambda d: d["groups"][3].update(chunk=12), "groups[3].chunk"),
    (lambda d: d["groups"][0].update(window=4), "groups[0].window"),
    (lambda d: d.update(retention_interval=-1), "retention_interval"),
    (lambda d: d.update(colour="red"), "colour"),
    (lambda d: d.update(groups=[]), "groups"),
])
def test_each_bad_value_names_its_field(mutate, field):
    d = json.loads(json.dumps(GOOD))
    mutate(d)
    with pytest.raises(ValueError) as e:
        _parse(d)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"f.json: {field}:"), msg


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(json_values)
def test_any_json_value_parses_or_is_one_line(d):
    try:
        _, groups, sched, _ = _parse(d)
    except ValueError as e:
        assert "\n" not in str(e) and str(e).startswith("f.json")
    else:
        assert groups and sched % 4 == 0


def _fuzz(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcheck", "fuzz", "--sut", "vllm", *argv],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


@settings(max_examples=8, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
          deadline=None)
@given(st.binary(max_size=64))
def test_a_garbage_file_is_one_line_exit_2(tmp_path, data):
    p = tmp_path / "l.json"
    p.write_bytes(data)
    r = _fuzz("--layout-file", str(p), "--budget", "10", "--out", str(tmp_path / "o"))
    if r.returncode == 0:                  # garbage that happens to be a valid layout
        return
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


vllm = pytest.importorskip("vllm")


@pytest.mark.parametrize("layout", [GOOD, {"groups": [{"kind": "full", "block_size": 16},
                                                      {"kind": "full", "block_size": 4},
                                                      {"kind": "swa", "block_size": 8, "window": 20}]}])
def test_a_file_layout_runs_clean_and_a_fault_in_it_is_caught_and_replays(layout, tmp_path):
    p = tmp_path / "mine.json"
    p.write_text(json.dumps(layout))
    r = _fuzz("--layout-file", str(p), "--budget", "1500", "--json", "--out", str(tmp_path))
    res = json.loads(r.stdout)
    assert res["exit_code"] == 0 and not res["missing_actions"], res["findings"]
    r = _fuzz("--layout-file", str(p), "--fault", "swa_hit_unchecked", "--budget", "60s", "--json",
              "--out", str(tmp_path))
    res = json.loads(r.stdout)
    assert r.returncode == 10 and res["caught"], res
    trace = next(f["trace"] for f in res["findings"] if f["check"] == "hit_sound_swa_window")
    assert json.loads(Path(trace).read_text())["meta"]["layout_file"] == layout   # replayable anywhere
    rep = subprocess.run([sys.executable, "-m", "kvcheck", "replay", trace, "--sut", "vllm", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert json.loads(rep.stdout)["reproduced"], rep.stdout + rep.stderr
