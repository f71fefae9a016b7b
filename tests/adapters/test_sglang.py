"""The SGLang adapter: each planted fault is caught by its expected check on every layout the
installed release has, clean layouts run clean with every action exercised, a finding replays,
and bad input is one line with exit code 2. Skipped (with the reason) where SGLang is not
importable: build a side venv with scripts/install-sglang.sh VERSION DIR and run pytest from it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcheck.engines.sglang.layouts import (FAULTS, LAYOUTS, LayoutError, layout_from, fault_applies,
                                            known_finding, load_layout_file)

ROOT = Path(__file__).resolve().parents[2]


def _sglang():
    from kvcheck.engines.sglang.install import SglangUnavailable, load
    try:
        return load()
    except SglangUnavailable as e:
        pytest.skip(str(e))


def _supported() -> list[str]:
    _sglang()
    from kvcheck.engines.sglang.layouts import list_layouts
    return [r["name"] for r in list_layouts() if r["supported"]]


def test_layout_file_errors_are_one_line(tmp_path):
    """No SGLang needed: a malformed layout names the field and the file."""
    bad = tmp_path / "l.json"
    bad.write_text(json.dumps({"name": "x", "class": "RadixCache", "components": ["swa"]}))
    with pytest.raises(LayoutError, match="needs a window"):
        load_layout_file(str(bad))
    bad.write_text("{nope")
    with pytest.raises(LayoutError, match="not JSON"):
        load_layout_file(str(bad))
    with pytest.raises(LayoutError, match="not driven"):
        layout_from({"name": "x", "class": "SWAChunkCache"}, "here")
    with pytest.raises(LayoutError, match="cannot read"):
        load_layout_file(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_planted_fault_caught_by_its_check(fault, tmp_path):
    from kvcheck.engines.sglang import drivers as sg
    lays = [x for x in _supported() if fault_applies(fault, LAYOUTS[x])]
    if not lays:
        pytest.skip(f"{fault} needs a class this release lacks")
    for lay in lays:
        r = sg.run_campaign(lay, budget_s=20, steps=20_000, seed=1, fault=fault, out_dir=str(tmp_path),
                            shrink_s=3)
        assert r["findings"], f"{fault} on {lay}: nothing found in {r['steps']} steps"
        assert r["findings"][0]["check"] == FAULTS[fault].expected, (lay, r["findings"][0])
        assert r["caught"] and r["exit_code"] != 0


def test_clean_layouts_run_clean_and_cover_every_action(tmp_path):
    from kvcheck.engines.sglang import drivers as sg
    for lay in _supported():
        r = sg.run_campaign(lay, budget_s=30, steps=4000, seed=3, out_dir=str(tmp_path))
        known = known_finding(LAYOUTS[lay], sg.sglang_version())    # a real SGLang bug of this release
        if known and r["findings"]:
            assert r["findings"][0]["check"] == known, (lay, r["findings"])
            continue
        assert r["findings"] == [], (lay, r["findings"])
        assert r["exit_code"] == 0 and r["missing_actions"] == []
        if LAYOUTS[lay].cls != "ChunkCache":       # a ChunkCache never hits nor evicts (its contract)
            assert r["lookups_with_hit"] > 0 and r["coverage"].get("state:evicted", 0) > 0


def test_finding_replays_on_the_same_release(tmp_path):
    from kvcheck.engines.sglang import drivers as sg
    lay = _supported()[0]
    r = sg.run_campaign(lay, budget_s=20, steps=20_000, seed=2, fault="evict_locked", out_dir=str(tmp_path),
                        shrink_s=3)
    f = r["findings"][0]
    assert f["steps"] <= 10                      # shrunk
    out = sg.replay(f["trace"])
    assert out["reproduced"] and out["violation"]["check"] == "no_evict_locked"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcheck", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_cli_list_layouts_and_bad_input(tmp_path):
    _sglang()
    p = _cli("fuzz", "--sut", "sglang", "--list-layouts", "--json")
    assert p.returncode == 0, p.stderr[-500:]
    rows = json.loads(p.stdout)["layouts"]
    assert {r["name"] for r in rows if r["supported"]} == set(_supported())
    p = _cli("fuzz", "--sut", "sglang", "--layout", "nope")
    assert p.returncode == 2 and "unknown SGLang layout" in p.stderr and "Traceback" not in p.stderr
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"name": "mine", "class": "RadixCache", "page_size": 2, "capacity": 32}))
    p = _cli("fuzz", "--sut", "sglang", "--layout-file", str(f), "--budget", "1500", "--json",
             "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-500:]
    assert json.loads(p.stdout)["layout"] == "mine"


def test_standalone_reproducer_exits_1_with_the_fault_and_0_clean(tmp_path):
    """The script imports SGLang only (no kvcheck on its path) and is a real reproducer: the
    inlined planted wrapper makes it fail, --clean (unmodified SGLang) makes it pass."""
    from kvcheck.engines.sglang import drivers as sg
    lay = next(x for x in _supported() if sg.LAYOUTS[x].cls in ("RadixCache", "SWARadixCache"))
    r = sg.run_campaign(lay, budget_s=20, steps=20_000, seed=2, fault="lock_ref_leak", out_dir=str(tmp_path),
                        shrink_s=3)
    script = r["findings"][0]["reproducer"]
    assert "import kvcheck" not in open(script).read() and "from kvcheck" not in open(script).read()
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    bug = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=300)
    assert bug.returncode == 1 and "BUG: node at depth" in bug.stdout, bug.stdout[-800:] + bug.stderr[-800:]
    ok = subprocess.run([sys.executable, script, "--clean"], capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0 and "OK:" in ok.stdout, ok.stdout[-800:] + ok.stderr[-800:]
