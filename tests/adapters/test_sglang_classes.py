"""SGLang's UnifiedRadixCache FULL+MAMBA (Python core, and the Python and Rust cores in lockstep)
and ChunkCache: the layout rules without SGLang; with it, on each release named in
KVCHECK_SGLANG_PYTHONS (side venvs, scripts/install-sglang.sh), the layouts a release has run
clean with their states reached, every planted fault on them is caught by its expected check,
shrunk to at most 10 steps, replays, and its standalone reproducer fails with the fault and passes
with --clean (in one process per release; one fault per class also as a real separate process,
SGLang only), a release without the class says so in one line (exit 2). Skipped, saying why, where
no release named has the class.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvcheck.engines.sglang.layouts import (FAULTS, LAYOUTS, LayoutError, layout_from, fault_applies,
                                            fault_refusal)

ROOT = Path(__file__).resolve().parents[2]
PYTHONS = [p for p in os.environ.get("KVCHECK_SGLANG_PYTHONS", "").split(os.pathsep) if p]
NEW = ("unified-mamba", "unified-mamba-lockstep", "chunk")
# the states a clean run of each layout must reach (else the run proves little)
STATES = {"unified-mamba": ("state:hit", "state:mamba_evicted", "state:tombstoned", "state:evicted"),
          "unified-mamba-lockstep": ("state:hit", "state:mamba_evicted", "state:lockstep_compared"),
          "chunk": ("state:chunked", "state:miss")}


def test_layout_rules_without_sglang():
    mamba = layout_from({"name": "m", "class": "UnifiedRadixCache", "components": ["full", "mamba"],
                          "tree_core": "lockstep", "capacity": 96}, "here")
    assert mamba.tree_core == "lockstep" and mamba.components == ("full", "mamba")
    with pytest.raises(LayoutError, match="FULL\\+MAMBA takes page_size 1"):
        layout_from({"name": "m", "class": "UnifiedRadixCache", "components": ["full", "mamba"], "page_size": 4}, "f")
    with pytest.raises(LayoutError, match="ChunkCache takes components"):
        layout_from({"name": "c", "class": "ChunkCache", "components": ["full", "swa"], "window": 4}, "f")
    with pytest.raises(LayoutError, match="ChunkCache is driven with page_size 1"):
        layout_from({"name": "c", "class": "ChunkCache", "page_size": 2}, "f")
    assert layout_from({"name": "c", "class": "ChunkCache"}, "f").components == ("full",)
    # each new fault applies where its class is, and says why not elsewhere (one line)
    for f in ("mamba_hit_without_state", "mamba_state_freed_on_insert", "mamba_state_dropped_on_insert"):
        assert fault_applies(f, LAYOUTS["unified-mamba"]) and not fault_applies(f, LAYOUTS["unified-full"])
    assert not fault_applies("mamba_state_dropped_on_insert", LAYOUTS["unified-mamba-lockstep"])
    chunk = [f for f in FAULTS if fault_applies(f, LAYOUTS["chunk"])]
    assert set(chunk) == {"lock_ref_leak", "evict_locked", "chunk_reports_hit", "chunk_frees_unfinished",
                          "chunk_double_free", "chunk_finish_leaks"}
    assert "does not apply to layout chunk" in fault_refusal("drop_insert", LAYOUTS["chunk"])
    assert "needs a layout of class ChunkCache" in fault_refusal("chunk_double_free", LAYOUTS["radix"])


def test_every_action_has_a_script_and_an_unplayable_step_gets_none():
    """FULL+MAMBA traces with chunk steps get a script now; a step no script plays gets a note instead
    (a script skipping it could call a present bug fixed)."""
    from kvcheck.engines.sglang.layouts import ACTIONS
    from kvcheck.engines.sglang.repro_classes import script_gap
    for name in ("unified-mamba", "unified-mamba-lockstep", "chunk"):
        assert script_gap({"class": LAYOUTS[name].cls, "components": list(LAYOUTS[name].components)}, set(ACTIONS)) is None
    assert "does not play teleport" in script_gap({"class": "UnifiedRadixCache", "components": ["full", "mamba"]},
                                                  {"chunk", "teleport"})


def test_every_new_check_has_a_fault():
    """Each check these classes add is the expected check of a planted fault in the one table."""
    new_checks = {"disabled_cache_no_hit", "request_kv_intact", "kv_freed_once", "hit_sound_mamba_state"}
    assert new_checks <= {f.expected for f in FAULTS.values()}


# one process per interpreter runs everything below (SGLang's import chain takes seconds)
_RUN = r"""
import contextlib, io, json, runpy, sys
from kvcheck.engines.sglang import drivers as sg
from kvcheck.engines.sglang.layouts import fault_applies
NEW, out_dir = json.loads(sys.argv[1]), sys.argv[2]
rows = {r["name"]: r for r in sg.list_layouts() if r["name"]}
out = {"version": sg.sglang_version(), "rows": {n: rows[n] for n in NEW}, "clean": {}, "faults": []}


def script(path, *args):        # the reproducer in this process (its imports are paid once)
    argv, sys.argv = sys.argv, [path, *args]
    buf, code = io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = int(e.code or 0)
    finally:
        sys.argv = argv
    return code, (buf.getvalue().strip().splitlines() or [""])[-1][:300]     # its verdict line


for lay in [n for n in NEW if rows[n]["supported"]]:
    r = sg.run_campaign(lay, budget_s=120, steps=3000, seed=5, out_dir=out_dir)
    out["clean"][lay] = {k: r[k] for k in ("exit_code", "findings", "missing_actions", "coverage", "steps")}
    for f in [f for f in sg.FAULTS if fault_applies(f, sg.LAYOUTS[lay])]:
        # shrink_s generous: the shrinker is bounded by wall clock, and the lockstep is slow on a busy machine
        r = sg.run_campaign(lay, budget_s=20, steps=20000, seed=1, fault=f, out_dir=out_dir, shrink_s=6)
        row = {"layout": lay, "fault": f, "expected": r["expected_check"], "caught": r["caught"],
               "ttd": r["time_to_failure_s"], "check": r["findings"][0]["check"] if r["findings"] else None}
        if r["findings"]:
            x = r["findings"][0]
            row.update(steps=x["steps"], replayed=sg.replay(x["trace"])["reproduced"], reproducer=x.get("reproducer"))
            if x.get("reproducer"):
                row["repro"] = [script(x["reproducer"], *a) for a in ([], ["--clean"])]
        out["faults"].append(row)
print(json.dumps(out))
"""


def _run(py: str, *argv: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([py, *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


@functools.lru_cache(maxsize=None)          # one run per interpreter for all the tests below
def _results(py: str) -> dict:
    r = _run(py, "-c", _RUN, json.dumps(NEW), tempfile.mkdtemp(prefix="kvcheck-sglang-classes-"))
    assert r.returncode == 0, r.stderr[-1500:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _has_class(py: str) -> dict:
    res = _results(py)
    if not any(row["supported"] for row in res["rows"].values()):
        pytest.skip(f"sglang {res['version']} has none of {', '.join(NEW)}: "
                    + "; ".join(f"{n}: {row['reason']}" for n, row in res["rows"].items()))
    return res


needs_pythons = pytest.mark.skipif(not PYTHONS, reason="set KVCHECK_SGLANG_PYTHONS to side-venv pythons "
                                   "(scripts/install-sglang.sh VERSION DIR) to test these SGLang classes")


@needs_pythons
@pytest.mark.parametrize("py", PYTHONS)
def test_clean_runs_reach_their_states(py):
    res = _has_class(py)
    for lay, r in res["clean"].items():
        assert r["exit_code"] == 0 and r["findings"] == [] and r["missing_actions"] == [], (res["version"], lay, r)
        for s in STATES[lay]:
            assert r["coverage"].get(s, 0) > 0, (res["version"], lay, s, r["coverage"])


@needs_pythons
@pytest.mark.parametrize("py", PYTHONS)
def test_planted_faults_caught_shrunk_replayed_and_reproduced(py):
    res = _has_class(py)
    assert res["faults"], res
    for row in res["faults"]:
        v = (res["version"], row)
        assert row["caught"] and row["check"] == row["expected"], v
        assert row["steps"] <= 10 and row["replayed"] and row["ttd"] <= 10, v
        assert row["reproducer"], v                    # every fault on these classes has a script
        (bug, bug_out), (clean, clean_out) = row["repro"]
        assert bug == 1 and "BUG:" in bug_out, v
        assert clean == 0 and "OK:" in clean_out, v


@needs_pythons
@pytest.mark.parametrize("py", PYTHONS)
def test_reproducer_is_standalone(py):
    """One fault per class as its own process with SGLang only (no kvcheck on its path)."""
    res = _has_class(py)
    done = set()
    for row in res["faults"]:
        cls = LAYOUTS[row["layout"]].cls
        if row["fault"] != "evict_locked" or cls in done:
            continue
        done.add(cls)
        src = Path(row["reproducer"]).read_text()
        assert "import kvcheck" not in src and "from kvcheck" not in src
        env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
        codes = [subprocess.run([py, row["reproducer"], *a], capture_output=True, text=True, env=env,
                                timeout=600).returncode for a in ([], ["--clean"])]
        assert codes == [1, 0], (res["version"], row["layout"], codes)
    assert done, res["faults"]


@needs_pythons
@pytest.mark.parametrize("py", PYTHONS)
def test_a_release_without_the_class_says_so(py, tmp_path_factory):
    res = _results(py)
    missing = [n for n, row in res["rows"].items() if not row["supported"]]
    if not missing:
        pytest.skip(f"sglang {res['version']} has every class of {', '.join(NEW)}")
    for n in missing:
        assert res["rows"][n]["reason"] and "\n" not in res["rows"][n]["reason"], res["rows"][n]
    r = _run(py, "-m", "kvcheck", "fuzz", "--sut", "sglang", "--layout", missing[0], "--budget", "10",
             "--out", str(tmp_path_factory.mktemp("out")), timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-500:]
    assert res["version"] in r.stderr.strip().splitlines()[-1]
