"""UnifiedRadixCache (FULL, FULL+SWA) and its two tree cores in lockstep, and SWARadixCache's
*Params API: the layout fields are validated without SGLang; with it, the Rust core's
availability is stated in the layout list, the cores agree on a clean run, a planted divergence
is caught by the differential and replays, and the unified layouts catch the planted faults.
The generic fault/clean tests in test_sglang.py also run every unified layout the release has.
Skipped (with the reason) where SGLang is not importable: see scripts/install-sglang.sh.
"""
from __future__ import annotations

import pytest

from kvcheck.engines.sglang.layouts import (FAULTS, LAYOUTS, LayoutError, layout_from, fault_applies)


def _sglang():
    from kvcheck.engines.sglang.install import SglangUnavailable, load
    try:
        return load()
    except SglangUnavailable as e:
        pytest.skip(str(e))


def _rows() -> dict:
    _sglang()
    from kvcheck.engines.sglang.layouts import list_layouts
    return {r["name"]: r for r in list_layouts() if r["name"]}


def _supported_unified() -> list[str]:
    rows = _rows()
    out = [n for n, r in rows.items() if r["supported"] and r["class"] == "UnifiedRadixCache"]
    if not out:
        pytest.skip("this release has no UnifiedRadixCache")
    return out


def test_unified_layout_fields_are_checked():
    """No SGLang needed: a bad component set, tree core or misplaced field is one clear error."""
    with pytest.raises(LayoutError, match="driven with components"):
        layout_from({"name": "m", "class": "UnifiedRadixCache", "components": ["full", "swa", "mamba"],
                      "window": 4}, "here")
    with pytest.raises(LayoutError, match="tree_core must be one of"):
        layout_from({"name": "t", "class": "UnifiedRadixCache", "tree_core": "cuda"}, "here")
    with pytest.raises(LayoutError, match="tree_core is a UnifiedRadixCache field"):
        layout_from({"name": "r", "class": "RadixCache", "tree_core": "rust"}, "here")
    lay = layout_from({"name": "u", "class": "UnifiedRadixCache"}, "here")
    assert lay.tree_core == "python" and lay.to_dict()["tree_core"] == "python"
    # the faults that need a second core or tombstones apply only where they exist
    assert fault_applies("core_drops_insert", LAYOUTS["unified-full-lockstep"])
    assert not fault_applies("core_drops_insert", LAYOUTS["unified-full"])
    assert fault_applies("match_ignores_tombstones", LAYOUTS["unified-swa"])
    assert not fault_applies("match_ignores_tombstones", LAYOUTS["unified-full"])


def test_rust_core_availability_is_one_line():
    rows = _rows()
    from kvcheck.engines.sglang.unified import rust_core_gap
    if "UnifiedRadixCache" not in _sglang()["classes"]:
        pytest.skip("this release has no UnifiedRadixCache")
    gap = rust_core_gap()
    for name in ("unified-full-lockstep", "unified-swa-lockstep"):
        r = rows[name]
        assert r["supported"] == (gap is None), r
        if gap is not None:
            assert r["reason"] == gap and "\n" not in gap and "tree core" in gap


def test_lockstep_cores_agree_on_a_clean_run(tmp_path):
    from kvcheck.engines.sglang import drivers as sg
    lays = [x for x in _supported_unified() if LAYOUTS[x].tree_core == "lockstep"]
    if not lays:
        pytest.skip("no Rust tree core here: " + str(_rows()["unified-full-lockstep"]["reason"]))
    for lay in lays[:2]:
        r = sg.run_campaign(lay, budget_s=20, steps=1500, seed=5, out_dir=str(tmp_path))
        assert r["findings"] == [] and r["exit_code"] == 0, (lay, r["findings"])
        assert r["coverage"]["state:lockstep_compared"] == r["steps"]
        assert r["lookups_with_hit"] > 0


def test_differential_catches_a_diverging_core_and_replays(tmp_path):
    from kvcheck.engines.sglang import drivers as sg
    if "unified-full-lockstep" not in _supported_unified():
        pytest.skip("no Rust tree core here")
    r = sg.run_campaign("unified-full-lockstep", budget_s=20, steps=20_000, seed=1, fault="core_drops_insert",
                        out_dir=str(tmp_path), shrink_s=3)
    f = r["findings"][0]
    assert f["check"] == "tree_core_differential" and r["caught"] and f["steps"] <= 12
    out = sg.replay(f["trace"])
    assert out["reproduced"] and out["violation"]["check"] == "tree_core_differential"


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_unified_faults_caught_by_their_check(fault, tmp_path):
    """One Python-core layout per component set (the lockstep ones run in test_sglang.py)."""
    from kvcheck.engines.sglang import drivers as sg
    lays = [x for x in _supported_unified() if LAYOUTS[x].tree_core == "python" and fault_applies(fault, LAYOUTS[x])
            and x != "unified-full-page4"]
    if not lays:
        pytest.skip(f"{fault} needs a layout this release lacks")
    for lay in lays:
        r = sg.run_campaign(lay, budget_s=30, steps=40_000, seed=1, fault=fault, out_dir=str(tmp_path), shrink_s=3)
        assert r["findings"], f"{fault} on {lay}: nothing found in {r['steps']} steps"
        assert r["findings"][0]["check"] == FAULTS[fault].expected, (lay, r["findings"][0])


def test_swa_radix_cache_speaks_the_params_api(tmp_path):
    """0.5.8+ SWARadixCache takes MatchPrefixParams / InsertParams / EvictParams and returns an
    IncLockRefResult receipt; the `swa` layout runs on it as on 0.5.7's positional API."""
    S = _sglang()
    if not isinstance(S["classes"].get("SWARadixCache"), type):
        pytest.skip("this release has no SWARadixCache")
    assert _rows()["swa"]["supported"], _rows()["swa"]
    from kvcheck.engines.sglang import drivers as sg
    r = sg.run_campaign("swa", budget_s=20, steps=1500, seed=3, out_dir=str(tmp_path))
    from kvcheck.engines.sglang.layouts import known_finding
    known = known_finding(LAYOUTS["swa"], S["version"])       # finding 1, reached fast by chunked prefill
    assert all(f["check"] == known for f in r["findings"]), r["findings"]
    assert r["missing_actions"] == [] or r["findings"], r
    assert r["coverage"].get("match") and r["coverage"].get("finish") and r["coverage"].get("evict"), r["coverage"]
    ad = sg.make_adapter(LAYOUTS["swa"])
    assert ad.params_api == hasattr(S["bpc"], "MatchPrefixParams")


def test_known_finding_reproducer_matches_the_release():
    """docs/repro/sglang_unified_swa_recover_frees_locked_full.py (SGLang's classes only) exits 1
    exactly on the releases KNOWN_FINDINGS lists (0.5.11, 0.5.12), 0 where it is fixed (0.5.23)."""
    import subprocess
    import sys
    from pathlib import Path
    S = _sglang()
    if not isinstance(S["classes"].get("UnifiedRadixCache"), type):
        pytest.skip("this release has no UnifiedRadixCache")
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, str(root / "docs/repro/sglang_unified_swa_recover_frees_locked_full.py")],
                       cwd=root, capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(root),
                                                                                    "PATH": "/usr/bin:/bin"})
    from kvcheck.engines.sglang.layouts import known_finding
    bad = known_finding(LAYOUTS["unified-swa"], S["version"]) is not None
    assert p.returncode == (1 if bad else 0), (p.returncode, p.stdout[-300:], p.stderr[-500:])
