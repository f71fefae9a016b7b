"""vLLM presets (real models' KV cache groups, with EAGLE/MTP drafters) and the layout generator:
each preset runs clean, the generator's layouts run and every finding they give replays, a
planted fault is caught on a preset and on a generated layout, and the adapter's EAGLE hit
rule is load-bearing (without it the checks disagree with vLLM)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from known_ack import ACK_ALL
from kvcheck.engines.vllm.presets import PRESETS, REFUSED
from kvcheck.engines.vllm.runtime import NEWEST

vllm = pytest.importorskip("vllm")
from kvcheck.engines.vllm import drivers as V  # noqa: E402
from kvcheck.engines.vllm import generator as G  # noqa: E402
from kvcheck.engines.vllm.adapter import VllmAdapter  # noqa: E402
from kvcheck.engines.vllm.layout_file import parse_layout  # noqa: E402


@pytest.mark.parametrize("layout", PRESETS)
def test_each_preset_runs_clean(layout, tmp_path):
    r = V.run_campaign(layout, budget_s=None, steps=1000, seed=3, out_dir=str(tmp_path), acknowledged=ACK_ALL)
    assert r["exit_code"] == 0 and not r["findings"], r["findings"]
    assert not r["missing_actions"] and r["lookups_with_hit"] > 0


def test_presets_have_the_scale_and_drafter_they_claim():
    ad = VllmAdapter("gemma3+eagle", 200)
    assert (ad.hb, ad.max_len) == (16, 256) and len(ad.groups) == 6
    # vLLM looks the five identical SWA groups up together, and flags only the drafter's group
    assert [g.group_ids for g in ad.coord.attention_groups] == [[0], [1, 2, 3, 4, 5]]
    assert ad.eagle_groups == {0} and [m.use_eagle for m in ad.coord.single_type_managers] == [True] + [False] * 5


def test_a_release_without_align_mode_refuses_the_mamba_presets_in_one_line(monkeypatch):
    from kvcheck.engines.vllm.layouts import vllm_modules
    assert not REFUSED and {"qwen3-next", "nemotron-h"} <= set(PRESETS)
    monkeypatch.setitem(vllm_modules(), "features", vllm_modules()["features"] - {"MambaSpec.mamba_cache_mode"})
    for name in ("qwen3-next", "nemotron-h", "full+mamba"):
        with pytest.raises(ValueError) as e:
            VllmAdapter(name, 40)
        assert "\n" not in str(e.value) and "MambaSpec.mamba_cache_mode" in str(e.value) and NEWEST in str(e.value)
        assert V.supported_layouts()[name] == str(e.value)


def test_the_generator_is_seeded_and_speaks_the_layout_file_grammar():
    assert G.sample_definition(7) == G.sample_definition(7) != G.sample_definition(8)
    defs = [G.sample_definition(s) for s in range(300)]
    for d in defs:
        parse_layout(d, "gen", 4, 64)
    assert {len(d["groups"]) for d in defs} == set(range(1, 7))
    assert {g["kind"] for d in defs for g in d["groups"]} == set(G.kinds_available())
    assert any(d.get("use_eagle") for d in defs) and {d.get("retention_interval") is None for d in defs} == {True, False}
    assert any(len({g["block_size"] for g in d["groups"]}) > 1 for d in defs)


def test_generated_layouts_run_and_every_finding_replays(tmp_path):
    r = V.run_campaign("generated", budget_s=None, steps=3000, seed=1, out_dir=str(tmp_path), acknowledged=ACK_ALL)
    assert r["exit_code"] == 0 and r["layouts_sampled"] > 20 and not r["missing_actions"]
    # what they find is lost reuse (vLLM's EAGLE rules: docs/adapters-vllm.md#generated-layouts)
    assert {f["kind"] for f in r["findings"]} <= {"lost_reuse"}
    for f in r["findings"]:
        meta = json.loads(Path(f["trace"]).read_text())["meta"]
        assert meta["layout"] == f["layout"] and meta["layout_file"]["groups"]
        assert V.replay(f["trace"])["reproduced"], f


@pytest.mark.parametrize("layout, fault", [("gemma3", "swa_hit_unchecked"), ("deepseek-v3+mtp", "drop_ref_on_free"),
                                           ("generated", "swa_hit_unchecked"), ("generated", "evict_keeps_hash")])
def test_a_planted_fault_is_caught_and_replays(layout, fault, tmp_path):
    r = V.run_campaign(layout, budget_s=60, seed=0, fault=fault, out_dir=str(tmp_path))
    assert r["exit_code"] == 10 and r["caught"], r["findings"]
    f = next(f for f in r["findings"] if f["check"] == V.FAULTS[fault][0])
    assert f["steps"] <= 20
    rep = V.replay(f["trace"])
    assert rep["reproduced"] and rep["fault"] == fault


def test_without_the_eagle_rule_the_checks_disagree_with_vllm(tmp_path, monkeypatch):
    """The adapter's EAGLE rule (a drafter group must match one block past the hit) is what
    keeps the drafter presets clean: judged without it, vLLM's hits look short."""
    monkeypatch.setattr(VllmAdapter, "_eagle_groups", lambda self, *a: set())
    r = V.run_campaign("gpt-oss+eagle", budget_s=None, steps=1000, seed=3, out_dir=str(tmp_path), acknowledged=ACK_ALL)
    assert r["lost_reuse_lookups"] > 0 and r["findings"][0]["kind"] == "lost_reuse"


def test_list_layouts_as_text_names_every_layout() -> None:
    """`--list-layouts` without --json: one line per layout, generated included (it once raised
    KeyError on the generated entry, which has no release gap of its own)."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "kvcheck", "fuzz", "--sut", "vllm", "--list-layouts"],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    names = {line.split()[0] for line in p.stdout.splitlines()[1:] if line.startswith("  ") and line.split()}
    static = {k for k in V.LAYOUTS if ":" not in k}     # (gen:/file: ones registered by other tests)
    assert static <= names, static - names


def test_every_layout_config_declares_vllms_semantics() -> None:
    """The ground-truth Config of each layout says what vLLM does among the spec's configurable
    semantics (drop_hash eviction, decode, allocation that evicts), and each semantic's
    invariant names an adapter check that exists."""
    from kvcheck.engines.vllm.layouts import (BOOKKEEPING_CHECKS, SAFETY_CHECKS, SEMANTIC_CHECKS,
                                              VLLM_SEMANTICS, layout_config)
    from kvcheck.spec.config import Config
    for name in [k for k in V.LAYOUTS if k != "generated" and ":" not in k]:
        cfg = layout_config(name)
        assert cfg.semantics() == VLLM_SEMANTICS, name
        assert Config.from_dict(cfg.to_dict()) == cfg        # a trace's config round-trips
    assert set(SEMANTIC_CHECKS.values()) <= set(SAFETY_CHECKS) | set(BOOKKEEPING_CHECKS)
