"""The retention-aware reuse oracle (dense twin), the chat workload, the reuse profile and the
standalone reproducers (issue 16, items 3 and 5). Needs vllm; skipped otherwise."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm")

from known_ack import ACK_ALL
from kvcheck.engines.vllm import drivers as V  # noqa: E402
from kvcheck.engines.vllm.layouts import register_layout  # noqa: E402
from kvcheck.engines.vllm.twin import TwinAdapter  # noqa: E402
from kvcheck.engines.vllm.workloads import MODES, ChatGen, reuse_profile  # noqa: E402

BASE = list(range(30))                 # a 30-token prompt: replay boundary (30 - 1) // 4 * 4 = 28


def _serve(ad, rid, tokens):
    """Submit, look up (the whole prompt in one chunk) and return the lookup's observation."""
    ad.apply("submit", {"r": rid, "tokens": tokens})
    obs = ad.apply("lookup", {"r": rid, "chunk": len(tokens)})
    assert ad.broken is None or ad.broken.kind == "lost_reuse", ad.broken
    return obs


def _retention_lost(ad):
    return [v for v in ad.lost if v.check == "lost_reuse_retention"]


def test_sparse_slack_is_not_a_finding_but_promises_are_kept():
    ad = TwinAdapter("full+swa-sparse", 64)
    _serve(ad, "a", BASE)
    ad.apply("finish", {"r": "a"})
    b = _serve(ad, "b", BASE[:20] + [39, 38, 37])
    assert b["hit"] == 0 and ad.twin_stats["below_twin"] == 1   # dense twin: 20; inside the slack
    ad.apply("finish", {"r": "b"})
    assert _serve(ad, "c", BASE[:20] + [35, 34, 33])["hit"] == 20  # b pinned the junction
    assert _serve(ad, "d", list(BASE))["hit"] == 28                 # the replay boundary
    assert not _retention_lost(ad) and ad.twin_stats["lookups"] == 4 and not ad.desynced


def test_planted_retention_fault_is_caught_by_the_twin_and_missed_by_the_map_check():
    ad = TwinAdapter("full+swa-sparse", 64, "retention_drops_tail")
    _serve(ad, "a", BASE)
    ad.apply("finish", {"r": "a"})
    n_map = len([v for v in ad.lost if v.check == "lost_reuse"])
    obs = _serve(ad, "d", list(BASE))
    lost = _retention_lost(ad)
    assert obs["hit"] < 28 and len(lost) == 1
    assert lost[0].kind == "lost_reuse" and lost[0].size["promised"] == 28
    assert lost[0].size["tokens_lost"] == 28 - obs["hit"] and 0 < lost[0].size["share"] <= 1
    assert "replay boundary" in lost[0].message
    # vLLM's own map never held the dropped block: the map-based check sees nothing
    assert len([v for v in ad.lost if v.check == "lost_reuse"]) == n_map


def test_connector_eviction_before_the_promise_is_not_lost_reuse():
    """Found by the campaign (an oracle bug, fixed): r2 pins junction 12, the connector evicts one
    of its published SWA blocks before r2 reaches 12; the policy's promise never covered it."""
    a = [18, 24, 39, 28, 17, 19, 33, 30, 5, 10, 28, 3]
    steps = [("submit", {"r": "r1", "tokens": a + [38, 34, 26, 28, 36, 21, 34, 12, 34, 7, 29, 14, 3, 32, 8]}),
             ("lookup", {"r": "r1", "chunk": 27}),
             ("submit", {"r": "r2", "tokens": a + [23, 2, 28, 0, 21, 9, 25, 5, 30, 36, 36, 19, 6, 38, 21, 8]}),
             ("lookup", {"r": "r2", "chunk": 9}), ("evict_blocks", {"block_ids": [29, 19, 6]}),
             ("prefill", {"r": "r2", "chunk": 7}), ("preempt", {"r": "r2"}), ("lookup", {"r": "r2", "chunk": 29})]
    ad = TwinAdapter("full+swa-sparse", 32)
    for n, (act, p) in enumerate(steps):
        ad.apply(act, p)
        if n == 3:
            assert ad.reqs["r2"].obj.shared_prefix_boundary == 12
    assert not _retention_lost(ad) and ad.twin_stats["below_twin"] >= 1


def test_interval_n_promises_every_n_tokens(tmp_path):
    name = register_layout({"groups": [{"kind": "full", "block_size": 4},
                                       {"kind": "swa", "block_size": 4, "window": 6}],
                            "retention_interval": 16}, str(tmp_path / "ret16.json"))
    ad = TwinAdapter(name, 64)
    _serve(ad, "a", BASE)
    ad.apply("finish", {"r": "a"})
    assert _serve(ad, "b", BASE[:21] + [39, 38])["hit"] == 16    # the segment end below 21
    assert ad.twin_stats["below_twin"] == 1                        # (the dense twin: 20)
    assert not _retention_lost(ad)
    r = V.run_campaign(name, budget_s=None, steps=1500, seed=2, out_dir=str(tmp_path), acknowledged=ACK_ALL)
    assert r["dense_twin"]["lookups"] > 0 and r["dense_twin"]["lost_lookups"] == 0, r["findings"]


def test_campaign_catches_retention_fault_shrinks_replays_and_reproduces(tmp_path, run_script):
    r = V.run_campaign("full+swa-sparse", budget_s=60, steps=3000, seed=0, fault="retention_drops_tail",
                       out_dir=str(tmp_path))
    assert r["caught"] and r["expected_check"] == "lost_reuse_retention"
    f = next(f for f in r["findings"] if f["check"] == "lost_reuse_retention")
    assert f["kind"] == "lost_reuse" and f["steps"] <= 10 and f["size"]["tokens_lost"] > 0
    data = json.loads(open(f["trace"]).read())
    assert data["meta"]["dense_twin"] and data["meta"]["vllm_version"] == vllm.__version__
    out = V.replay(f["trace"])
    assert out["reproduced"] and out["violation"]["check"] == "lost_reuse_retention"
    src = open(f["reproducer"]).read()
    assert "kvcheck" not in src.split("# ======== PLANTED")[0].split("import inspect")[1]   # no kvcheck import
    assert "PLANTED FAULT" in src and vllm.__version__ in src
    # standalone: a fresh interpreter without kvcheck on its path
    bad = subprocess.run([sys.executable, f["reproducer"]], capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path), env={"PATH": "/usr/bin:/bin"})
    assert bad.returncode == 1 and "BUG:" in bad.stdout and "hit " in bad.stdout, bad.stderr[-2000:]
    assert run_script(f["reproducer"], "--clean")[0] == 0
    # the profile: the dense twin reuses every aligned prefix, the sparse layout never more
    prof = r["reuse_profile"]
    dense, sparse = prof["full+swa-sparse (dense twin)"], prof["full+swa-sparse"]
    assert all(h == d // 4 * 4 for d, h in dense[:-1]) and all(s[1] <= t[1] for s, t in zip(sparse, dense))


@pytest.mark.parametrize("fault", ["drop_ref_on_free", "swa_hit_unchecked", "evict_keeps_hash", "swa_overstrict"])
def test_reproducer_exits_1_with_the_fault_and_0_on_clean_vllm(fault, tmp_path, run_script):
    # the manager drive's reproducer (reproducer.py; the engine drive's: test_vllm_engine_repro.py)
    r = V.run_campaign("full+swa", budget_s=30, steps=5000, seed=0, fault=fault, twin=False, drive="mixed",
                       strict_reuse=V.FAULTS[fault][0] == "lost_reuse", out_dir=str(tmp_path))
    f = next(f for f in r["findings"] if f["check"] == V.FAULTS[fault][0])
    assert f["reproducer"] and f["reproducer_run"] == f"python {f['reproducer']}", f
    code, out = run_script(f["reproducer"])
    assert code == 1 and "BUG:" in out and "step 0: submit" in out and "vLLM " + vllm.__version__ in out
    code, out = run_script(f["reproducer"], "--clean")
    assert code == 0 and "OK:" in out


def test_other_checks_get_the_replay_command_only(tmp_path):
    from kvcheck.engines.vllm.reproducer import write_reproducer
    from kvcheck.spec.trace import Trace
    t = Trace(None, [], None, "vllm-fuzz", 0, "vllm", {"check": "toctou_bound_stable"}, {"layout": "full+swa"})
    out = write_reproducer(t, str(tmp_path / "x.json"))
    assert out["reproducer"] is None and "kvcheck replay" in out["reproducer_note"]


def test_chat_workload_covers_every_mode_and_is_seeded():
    def prompts(seed):
        gen = ChatGen(V._Gen(random.Random(seed)))
        gen.history = [list(range(20)), list(range(5, 30))]
        return [gen.prompt() for _ in range(200)]
    a = prompts(4)
    assert a == prompts(4) and a != prompts(5)
    assert len(MODES) == 4 and all(2 <= len(p) <= 44 for p in a)
    assert any(p[:20] == list(range(20)) and len(p) > 20 for p in a)              # next turn / resend + k
    assert any(p[:8] != list(range(8)) and p[:3] == list(range(3)) for p in a)    # a sibling cut early
    r = V.run_campaign("full+swa-sparse", budget_s=None, steps=1500, seed=1, workload="chat", acknowledged=ACK_ALL)
    assert r["workload"] == "chat" and r["exit_code"] == 0 and not r["missing_actions"]
    assert r["dense_twin"]["below_twin"] > 0            # the sparse policy's declared slack shows


def test_random_workload_unchanged_and_bad_inputs():
    a = V.run_campaign("full", budget_s=None, steps=400, seed=3, out_dir="/tmp/kvcheck-twin-test", acknowledged=ACK_ALL)
    assert "dense_twin" not in a and a["reuse_profile"] == {} and a["workload"] == "random"
    with pytest.raises(ValueError, match="retention interval"):
        TwinAdapter("full+swa", 24, "retention_drops_tail")
    with pytest.raises(ValueError, match="dense twin"):
        V.run_campaign("full+swa-sparse", steps=10, fault="retention_drops_tail", twin=False)
    with pytest.raises(ValueError, match="workload"):
        V.run_campaign("full", steps=10, workload="nope")
    assert "\n" not in str(pytest.raises(ValueError, TwinAdapter, "full", 24, "retention_drops_tail").value)


def test_fault_is_listed():
    from kvcheck.fuzz import faults
    f = faults.FAULTS["retention_drops_tail"]
    assert f.expected == "lost_reuse_retention" and f.provider == "vllm"


def test_profile_shape():
    p = reuse_profile("full+swa-sparse")
    assert set(p) == {"full+swa-sparse", "full+swa-sparse (dense twin)"}
    assert [d for d, _ in p["full+swa-sparse"]] == list(range(33))
    assert set(reuse_profile("full")) == {"full"}


_EAGLE_SPARSE = {"groups": [{"kind": "mla", "block_size": 16}, {"kind": "swa", "block_size": 16, "window": 7}],
                 "hash_block_size": 16, "max_model_len": 256, "use_eagle": True, "retention_interval": 0}


def test_eagle_replay_boundary_is_one_block_lower(tmp_path):
    """Found by the 0.33.0 release campaign (an oracle bug, fixed): with a drafter vLLM's
    replay boundaries are the resend's and the extension's minus one scheduler block
    (kv_cache_coordinator.replay_boundaries), and a hit there must prove the block above. The
    oracle promised r1's 17-token prompt a hit of 16 (no EAGLE), which not even the dense twin
    can give: trace vllm-gen_1000038-lost_reuse_retention2-seed1000038.json, 4 steps."""
    name = register_layout(_EAGLE_SPARSE, str(tmp_path / "gen_1000038.json"), prefix="gen")
    toks = [35, 8, 6, 19, 22, 14, 11, 36, 4, 5, 9, 23, 20, 34, 26, 35, 1]
    ad = TwinAdapter(name, 14)
    for act, p in [("submit", {"r": "r1", "tokens": toks}), ("lookup", {"r": "r1", "chunk": 16, "la": 2}),
                   ("preempt", {"r": "r1"}), ("lookup", {"r": "r1", "chunk": 16, "la": 2})]:
        obs = ad.apply(act, p)
    assert obs["hit"] == 0 and not _retention_lost(ad)


def test_eagle_promise_still_catches_the_retention_fault(tmp_path):
    """The EAGLE-aware promise still holds vLLM to the boundary it documents: a 40-token prompt
    (block 16) keeps boundary 16 and its resend hits 16; with the planted fault the tail is
    dropped and the twin oracle reports it."""
    name = register_layout(_EAGLE_SPARSE, str(tmp_path / "eagle_sparse.json"), prefix="gen")
    prompt = list(range(40))
    for fault, want in ((None, 16), ("retention_drops_tail", 0)):
        ad = TwinAdapter(name, 32, fault)
        _serve(ad, "a", prompt)
        ad.apply("finish", {"r": "a"})
        assert _serve(ad, "b", list(prompt))["hit"] == want
        lost = _retention_lost(ad)
        if fault is None:
            assert not lost
        else:
            assert len(lost) == 1 and lost[0].size["promised"] == 16 and "EAGLE replay boundary" in lost[0].message
