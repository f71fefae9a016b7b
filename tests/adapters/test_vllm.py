"""vLLM's real KV cache manager against the spec (issue 8). Needs vllm (CI installs it with
scripts/install-vllm.sh); skipped otherwise, except the VllmUnavailable test."""
from __future__ import annotations

import builtins
import json

import pytest

from known_ack import ACK_ALL
from kvcheck.engines.vllm import drivers as V
from kvcheck.engines.vllm import layouts as vllm_layouts  # noqa: F401
from kvcheck.engines.vllm import runtime as vllm_runtime
from kvcheck.engines.vllm.runtime import NEWEST
from kvcheck.engines.vllm.presets import PRESETS, REFUSED   # tested in test_vllm_presets.py
from kvcheck.fuzz.lockstep import Finding


def test_unavailable_without_vllm(monkeypatch):
    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(vllm_runtime, "_V", {})
    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(V.VllmUnavailable) as e:
        V.run_campaign("full+swa", steps=10)
    msg = str(e.value)
    assert "\n" not in msg and "install-vllm.sh" in msg


vllm = pytest.importorskip("vllm")


def test_layouts_and_faults_are_described():
    assert {"full", "full+swa", "full+chunked_local", "mla+swa_mla", "mixed_block"} <= set(V.LAYOUTS)
    for name, (check, desc) in V.FAULTS.items():
        assert check and desc


@pytest.mark.parametrize("layout", [k for k in V.LAYOUTS if k not in PRESETS + tuple(REFUSED) + ("generated",)])
def test_layout_runs_clean(layout, tmp_path):
    # the manager drive's actions (lookup, prefill, preempt, ...): pinned, the default is auto
    r = V.run_campaign(layout, budget_s=None, steps=1000, seed=3, out_dir=str(tmp_path), acknowledged=ACK_ALL,
                       drive="mixed")
    json.dumps(r)  # JSON-serialisable
    assert r["exit_code"] == 0, r["findings"]
    assert r["vllm_version"] == NEWEST and r["layout"] == layout and r["steps"] == 1000
    assert r["scheduler_episodes"] > 0          # (Mamba layouts too: steps of several requests)
    assert not r["missing_actions"] and all(r["coverage"].get(a, 0) > 0 for a in V.ACTIONS)
    assert not [f for f in r["findings"] if f["kind"] != "lost_reuse"]


@pytest.mark.parametrize("fault", list(V.FAULTS))
def test_planted_fault_is_caught_with_expected_check(fault, tmp_path):
    expected = V.FAULTS[fault][0]
    layout = ("full+swa-sparse" if expected == "lost_reuse_retention"       # needs retention
              else "qwen3-next+mtp" if fault == "mamba_accept_ignored"        # Mamba drafts
              else "full+mamba-fine" if fault.startswith("mamba_partial")     # hits inside a Mamba block
              else "full+mamba" if fault.startswith("mamba_")                   # needs a mamba group
              else "full" if fault.startswith("connector_") else "full+swa")     # one group (a connector)
    from kvcheck.engines.vllm.layouts import ENGINE_FAULTS   # (planted in what only the engine drive runs)
    drive = "engine" if fault in {f.name for f in ENGINE_FAULTS} else "mixed"
    r = V.run_campaign(layout, budget_s=60, steps=(5000 if expected.startswith("lost_reuse") else 100_000),
                       seed=0, fault=fault, drive=drive,
                       out_dir=str(tmp_path))
    assert r["caught"], r
    f = next(f for f in r["findings"] if f["check"] == expected)
    assert f["replay"] == f"kvcheck replay {f['trace']} --sut vllm"
    if not expected.startswith("lost_reuse"):
        assert r["exit_code"] == 10
        # the first violation is the expected one, not another check by accident
        assert r["findings"][-1]["check"] == expected


def test_saved_trace_replays(tmp_path):
    r = V.run_campaign("full+swa", budget_s=60, steps=100_000, seed=1, fault="swa_hit_unchecked",
                       out_dir=str(tmp_path))
    path = r["findings"][-1]["trace"]
    data = json.loads(open(path).read())
    assert data["sut"] == "vllm" and data["meta"]["layout"] == "full+swa"
    assert data["meta"]["vllm_version"] == NEWEST
    out = V.replay(path)
    assert out["reproduced"] and out["exit_code"] == 10
    assert out["violation"]["check"] == "hit_sound_swa_window"


def test_strict_reuse_turns_lost_reuse_into_failure(tmp_path):
    r = V.run_campaign("full+swa", budget_s=60, steps=100_000, seed=0, fault="swa_overstrict",
                       strict_reuse=True, out_dir=str(tmp_path))
    assert r["exit_code"] == 13 and r["findings"][-1]["kind"] == "lost_reuse"
    assert V.replay(r["findings"][-1]["trace"])["reproduced"]


def test_bad_fault_for_layout():
    with pytest.raises(ValueError):
        V.run_campaign("full", steps=10, fault="swa_hit_unchecked")


def test_hypothesis_machine_clean_and_catches_fault():
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvcheck.engines.vllm.machine import VllmMachine

    # derandomized: the same examples every run (a random 200-example search missed sometimes)
    cfg = settings(max_examples=8, stateful_step_count=30, deadline=None, database=None, derandomize=True,
                   suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    run_state_machine_as_test(VllmMachine.for_layout("full+swa"), settings=cfg)
    with pytest.raises(Finding) as e:   # generation only: the campaign tests cover shrinking
        run_state_machine_as_test(VllmMachine.for_layout("full+swa", "swa_hit_unchecked"),
                                  settings=settings(cfg, max_examples=200, phases=[Phase.generate]))
    assert e.value.kind == "safety" and e.value.checks == ["hit_sound_swa_window"]


def test_one_config_gives_each_window_its_own_ground_truth(tmp_path):
    """`full+swa+swa` is one spec Config (the spec retains a window per group): each SWA group's
    hit is judged by its own window, and the planted SWA faults are caught there too."""
    from kvcheck.engines.vllm.adapter import VllmAdapter
    ad = VllmAdapter("full+swa+swa", 64)
    assert [(g.kind, g.window) for g in ad.cfg.groups] == [("full", None), ("swa", 6), ("swa", 11)]
    # a resume at 16 tokens: full reads every block, W=6 tokens [11, 16), W=11 tokens [6, 16)
    assert (ad.needed_hit(0, 16), ad.needed_hit(1, 16), ad.needed_hit(2, 16)) == ([0, 1, 2, 3], [2, 3], [1, 2, 3])
    for fault, expected in (("swa_hit_unchecked", "hit_sound_swa_window"), ("swa_overstrict", "lost_reuse")):
        r = V.run_campaign("full+swa+swa", budget_s=60, steps=5000, seed=0, fault=fault, out_dir=str(tmp_path / fault))
        assert r["caught"] and r["findings"][0]["check"] == expected, r["findings"][:2]
