"""Known vLLM defects (vllm_known.py): a finding that matches one is counted as known:NAME,
one that does not is reported, and KVCHECK_VLLM_STRICT=1 reports every finding."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvcheck.engines.vllm import drivers as V                      # noqa: E402
from kvcheck.engines.vllm import known as K                # noqa: E402
from kvcheck.fuzz.lockstep import Act                            # noqa: E402
from kvcheck.spec.trace import Trace                             # noqa: E402

COW = "docs/repro/traces/vllm_fine_cow_same_step.json"          # the same-step copy-on-write (new)
TRUNC = "docs/repro/traces/vllm-gen_2000016-hit_length_equal-seed2000016.json"
PAST = "docs/repro/traces/vllm-gen_1000991-lost_reuse1-seed1000991.json"   # fine_block_past_candidate
TWIN = "docs/repro/traces/vllm-gen_1001615-lost_reuse_retention2-seed1001615.json"   # swa_eagle_realign, twin


def _program(path: str) -> tuple[Trace, list[Act]]:
    t = Trace.load(path)
    return t, [Act(s.action, dict(s.params)) for s in t.steps]


def _in_range(name: str) -> bool:
    k = next(k for k in K.KNOWN if k.name == name)
    return K._ver(k.first) <= K._ver(V.vllm_version()) <= K._ver(k.last)


def _explain(path: str) -> dict:
    """explain_trace, skipped where the installed release cannot build the trace's layout."""
    try:
        return K.explain_trace(path)
    except ValueError as e:
        if "cannot express" in str(e):
            pytest.skip(str(e))
        raise


def test_every_entry_names_its_release_range_check_and_evidence():
    for k in K.KNOWN:
        assert K._ver(k.first) <= K._ver(k.last) and k.check and k.upstream and k.repro
        assert (Path(__file__).resolve().parents[2] / k.repro).is_file(), k.repro   # a reproducer in the repo
        assert k.fixed is not None or k.message is not None      # a fix to rerun, or a signature


def test_a_matched_finding_is_counted_known_and_strict_mode_reports_it(monkeypatch):
    if not _in_range("fine_cow_same_step"):
        pytest.skip("the same-step copy-on-write is in 0.26.0-0.34.0")
    t, prog = _program(COW)
    ad, f = V.execute(t.meta["layout"], int(t.meta["num_blocks"]), None, prog)
    assert f is not None and f.checks == ["known:fine_cow_same_step"]
    assert K.explain_trace(COW)["known"] == "fine_cow_same_step"
    monkeypatch.setattr(K, "STRICT", True)
    ad, f = V.execute(t.meta["layout"], int(t.meta["num_blocks"]), None, prog)
    assert f is not None and f.checks == ["state_copy_sound"]


def test_an_unmatched_finding_is_reported():
    """The same trace with a planted fault: no known defect is active, the finding stands; a
    message that is not the defect's signature matches nothing."""
    t, prog = _program(COW)
    ad = V.make_adapter(t.meta["layout"], int(t.meta["num_blocks"]), "mamba_same_step_hit", False, False)
    assert K.active(ad, V.vllm_version()) == []
    clean = V.make_adapter(t.meta["layout"], int(t.meta["num_blocks"]), None, False, False)
    assert K.by_signature(clean, V.vllm_version(), "state_copy_sound", "some other cause") is None
    assert K.by_signature(clean, V.vllm_version(), "hash_map_sound",
                          "the source's bytes are not written yet (published in this step") is None
    assert K.by_signature(clean, V.vllm_version(), "state_copy_sound",      # a copy of an older block
                          "the source's bytes are not written yet (published before this step") is None


def test_the_second_full_group_truncation_is_known_only_where_it_exists():
    """Fixed in 0.33.0: there the trace does not reproduce and nothing is recognised; on 0.18.1
    to 0.28.0 the counterfactual lookup (every full group truncated) explains it."""
    e = K.explain_trace(TRUNC)
    if _in_range("second_full_group_truncation"):
        assert e["reproduced"] and e["known"] == "second_full_group_truncation"
    else:
        assert not e["reproduced"] and e["known"] is None


def test_a_full_group_asked_past_its_cut_candidate_is_known_where_it_exists(monkeypatch):
    """gen:1000991 (0.33.0): the EAGLE MLA group cuts the candidate to 24 before the block-32
    indexer groups are asked, and they cannot see their block 0 keyed at 32; looked up at the
    lookup's candidate and trimmed (the coordinator's own rule for full attention) the hit is
    the spec's 24, so the lost reuse is the known defect. Strict: the finding itself; outside
    the release range: not recognised."""
    e = _explain(PAST)
    assert e["reproduced"]
    if not _in_range("fine_block_past_candidate"):
        assert e["known"] != "fine_block_past_candidate"
        return
    assert e["known"] == "fine_block_past_candidate"
    t = Trace.load(PAST)
    layout = V.register_layout(t.meta["layout_file"], "1000991", prefix="gen")
    ad = V.make_adapter(layout, int(t.meta["num_blocks"]), None, False, False)
    K.install(ad, V.vllm_version())
    for s in t.steps:
        obs = ad.apply(s.action, dict(s.params))
    assert (obs["hit"], obs["usable"]) == (0, 24)
    rid, hit, fixed = ad.known_last
    assert (rid, hit) == ("r1", 0)
    assert [(k.name, h, ok) for k, h, ok in fixed if k.name == "fine_block_past_candidate"] == \
        [("fine_block_past_candidate", 24, True)]
    monkeypatch.setattr(K, "STRICT", True)
    assert K.active(ad, V.vllm_version()) == []


def test_a_twin_check_finding_on_a_known_defect_is_counted_like_explain_trace_counts_it():
    """gen:1001615 (0.33.0, sparse retention + dense twin): the lookup adds two lost-reuse
    records, the map-based one (usable 64) and the twin's `lost_reuse_retention` (promised 64).
    The campaign's step rule (`sort_lost`), the shrinker's (`of_finding`) and `explain_trace`
    all name swa_eagle_realign, whichever check the finding carries; a promise above what the
    fixed lookup reaches is not explained."""
    from kvcheck.fuzz.lockstep import Finding
    from types import SimpleNamespace
    e = _explain(TWIN)
    if not _in_range("swa_eagle_realign"):
        pytest.skip("swa_eagle_realign is in 0.23.0-0.34.0")
    assert e["known"] == "swa_eagle_realign"
    t, prog = _program(TWIN)
    layout = V.register_layout(t.meta["layout_file"], "1001615", prefix="gen")
    ad = V.make_adapter(layout, int(t.meta["num_blocks"]), None, False, True)     # not strict: as a campaign
    K.install(ad, V.vllm_version())
    for act in prog:
        n_lost = len(ad.lost)
        ad.apply(act.action, dict(act.params))
    assert [v.check for v in ad.lost[n_lost:]] == ["lost_reuse", "lost_reuse_retention"]
    assert ad.lost[-2].size["prompt_tokens"] == ad.lost[-1].size["prompt_tokens"] == 81   # (at the lookup)
    assert K.sort_lost(ad, n_lost, act, V.vllm_version()) == (["swa_eagle_realign"], [])
    twin = ad.lost[-1]
    for check in ("lost_reuse", "lost_reuse_retention"):
        f = Finding("lost_reuse", [check], "m")
        f.program = prog
        assert K.of_finding(ad, f, V.vllm_version()) == "swa_eagle_realign", check
    beyond = SimpleNamespace(check=twin.check, message=twin.message, size={**twin.size, "promised": 80})
    assert K.of_violation(ad, beyond, act, V.vllm_version()) is None
    ad, f = V.execute(layout, int(t.meta["num_blocks"]), None, prog, strict=True, twin=True)
    assert f is not None and f.checks == ["known:swa_eagle_realign"]


@pytest.mark.parametrize("layout, fault", [("full+swa", "swa_hit_unchecked"),              # a safety finding
                                           ("full+swa-sparse", "retention_drops_tail")])    # a lost-reuse one
def test_a_finding_that_shrinks_to_a_known_defect_is_counted_not_reported(monkeypatch, tmp_path, layout, fault):
    """A finding the campaign did not recognise at its step may, shrunk, be a known defect's (the
    0.14.1 sweep: a generated layout's lost reuse shrank to #32802's): counted as known:NAME, not
    reported (its trace would replay as a mismatch against the known label)."""
    from kvcheck.fuzz.lockstep import Finding
    seen = []

    def shrink(layout, num_blocks, fault, f, strict, seconds, twin=False, sched_policy="fcfs"):
        seen.append(f.checks[0])
        g = Finding(f.kind, ["known:stand_in"], f.message)
        g.program = list(f.program)
        return g
    monkeypatch.setattr(V, "_shrink", shrink)
    from kvcheck.fuzz.known import parse_cli
    r = V.run_campaign(layout, budget_s=8, seed=0, fault=fault, out_dir=str(tmp_path),     # counted, then judged:
                       acknowledged=parse_cli(["stand_in=the test's stand-in defect"]))    # acknowledged here
    assert seen and r["findings"] == [] and r["coverage"]["known:stand_in"] == len(seen), (seen, r["findings"])
    assert r["exit_code"] == 0 and r["time_to_failure_s"] is None
