"""The external prefix store behind vLLM's KV connector interface (connector.py), on vLLM's own
scheduler: loads (sync, async, failing) and stores (immediate, delayed) run through the release's
scheduler code, and their bytes are checked on the timeline."""
from __future__ import annotations

import pytest

from kvcheck.engines.vllm.connector import stable, supported
from kvcheck.engines.vllm.engine_gen import knobs_of
from kvcheck.engines.vllm.sched_build import SchedKnobs

vllm = pytest.importorskip("vllm")
from kvcheck.engines.vllm import drivers as V  # noqa: E402
from kvcheck.fuzz.boundary import CannotExpress  # noqa: E402


def test_decisions_are_stable_functions_of_the_request():
    assert stable("r1", 0, "async") == stable("r1", 0, "async")
    assert len({stable(f"r{i}", 0, "async") % 2 for i in range(20)}) == 2


def test_attention_hybrids_are_served_and_state_groups_cannot_be_expressed():
    from kvcheck.engines.vllm.connector import has_hma
    assert supported([("full", 4, None)]) is None
    assert has_hma()               # (0.18+: a connector of the release's own implements SupportsHMA)
    assert supported([("full", 4, None), ("swa", 4, 6)]) is None
    assert "mamba" in supported([("full", 4, None), ("mamba", 4, None)])
    from kvcheck.engines.vllm.sched_build import build
    with pytest.raises(CannotExpress, match="KV connector"):
        build("full+mamba", SchedKnobs(connector=True))
    built = build("full+swa", SchedKnobs(connector=True))
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    assert isinstance(built.scheduler.connector, SupportsHMA)
    assert len(built.scheduler.kv_cache_config.kv_cache_groups) == 2      # (the hybrid manager stays on)


HYBRID_TRACE = "docs/repro/traces/vllm_connector_hybrid_evicts_hit.trace.json"
HYBRID_SCRIPT = "docs/repro/vllm_connector_hybrid_external_evicts_hit.py"


def test_the_cross_group_eviction_replays_where_vllm_has_it_and_not_after_the_fix():
    """Found by the hybrid connector on 0.18.1 (vllm PR #33775, fixed by #44409 in 0.24.0): a
    group's external blocks evict a later group's cache hit. Its trace and standalone script give
    the defect on 0.18-0.23 and hold on a fixed release (this environment's, whichever it is)."""
    import subprocess
    import sys
    from kvcheck.engines.vllm.known import _ver
    from kvcheck.engines.vllm.layouts import vllm_version
    buggy = _ver("0.18.0") <= _ver(vllm_version()) <= _ver("0.23.0")
    got = V.replay(HYBRID_TRACE)
    assert got["reproduced"] == buggy, got
    run = subprocess.run([sys.executable, HYBRID_SCRIPT], capture_output=True, text=True, timeout=600)
    assert run.returncode == (1 if buggy else 0), run.stdout + run.stderr[-2000:]
    assert ("BUG: block(s)" if buggy else "OK: no block is in both groups' tables") in run.stdout


def test_a_trace_from_before_the_connector_knob_reads_as_connector_off():
    old = {k: v for k, v in SchedKnobs().as_dict().items() if k != "connector"}
    assert knobs_of({"drive": "engine", "scheduler": old}).connector is False
    with pytest.raises(ValueError, match="meta.scheduler"):
        knobs_of({"drive": "engine", "scheduler": dict(old, connector="yes")})


@pytest.mark.parametrize("layout,steps,seed", [("full", 4000, 3), ("full+swa", 3000, 1)])
def test_a_campaign_runs_every_transfer_through_the_scheduler_and_holds(tmp_path, layout, steps, seed):
    """Async loads finish, some failing (one block in invalid_block_ids on one group; on full + sliding
    window the whole load in failed_recving: vLLM raises on invalid_block_ids with several groups),
    and stores (immediate and delayed) complete; each group's non-null external blocks are loaded."""
    res = V.run_campaign(layout, budget_s=None, steps=steps, seed=seed, drive="engine", out_dir=str(tmp_path))
    cov = res["coverage"]
    assert res["scheduler"]["knobs"]["connector"].get("True", 0) > 0
    assert cov["state:connector_recv"] > 0 and cov["state:connector_load_failed"] > 0
    assert cov["state:connector_send"] > 0
    # whole loads failed (failed_recving): a hybrid's always, a one-group load's sometimes; block ones on one group
    assert cov["state:connector_failed_recving"] > 0
    assert (cov["state:connector_load_failed"] > cov["state:connector_failed_recving"]) == (layout == "full")
    unknown = [f for f in res["findings"] if not f.get("known")]
    assert not unknown, unknown


@pytest.mark.parametrize("layout", ["full", "full+swa"])
def test_the_planted_early_publication_is_caught_replayed_and_named(tmp_path, layout):
    res = V.run_campaign(layout, budget_s=None, steps=3000, seed=1, drive="engine",
                         fault="connector_cache_early", out_dir=str(tmp_path))
    assert res["caught"]
    f = res["findings"][-1]
    assert f["check"] == "read_before_write" and "KV connector load into it" in f["message"], f
    assert V.replay(f["trace"])["reproduced"]
    assert f.get("reproducer") is None and "kvcheck replay" in f["reproducer_note"]


TRACES = {"0.34.0": "docs/repro/traces/vllm_connector_recompute_abort.trace.json",
          "0.14.1": "docs/repro/traces/vllm_connector_recompute_preempt.trace.json"}


def test_failed_sync_loads_are_opt_in(monkeypatch):
    import random
    from kvcheck.engines.vllm.connector import SYNC_FAILURES_ENV
    from kvcheck.engines.vllm.engine_gen import draw_knobs
    monkeypatch.delenv(SYNC_FAILURES_ENV, raising=False)
    assert not any(draw_knobs(random.Random(i), "full").sync_fail for i in range(20))
    monkeypatch.setenv(SYNC_FAILURES_ENV, "1")
    assert all(draw_knobs(random.Random(i), "full").sync_fail for i in range(5))


def test_the_recompute_policy_defect_replays_and_needs_the_failed_sync_load(tmp_path):
    """vLLM keeps the blocks at and after a failed synchronous load cached under
    kv_load_failure_policy=recompute; a request that hits them before their owner recomputes them
    (the owner aborted: 0.34.0; preempted: 0.14.1) reads bytes the failed load or the discarded
    forward left (docs/findings-vllm.md)."""
    from kvcheck.engines.vllm.layouts import vllm_version
    from kvcheck.spec.trace import Trace
    path = TRACES.get(vllm_version())
    if path is None:
        pytest.skip(f"no trace of this defect shrunk on vLLM {vllm_version()}")
    got = V.replay(path)
    assert got["reproduced"] and got["violation"]["check"] == "read_before_write", got
    # a finding that needs the connector's transfers gets no standalone script, and says why
    from kvcheck.engines.vllm.engine_repro import write_engine_reproducer
    note = write_engine_reproducer(Trace.load(path), str(tmp_path / "x.json"))
    assert note["reproducer"] is None and "needs the KV connector's transfers" in note["reproducer_note"]
    t = Trace.load(path)
    t.meta["scheduler"]["sync_fail"] = False          # the same steps, no load failing
    assert not V.replay(t)["reproduced"]


def test_the_standalone_reproducer_shows_the_defect_and_the_fail_policy_contrast():
    import subprocess
    import sys
    script = "docs/repro/vllm_connector_recompute_stale_block.py"
    bug = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    assert bug.returncode == 1 and "BUG: C's hit includes block" in bug.stdout, bug.stdout + bug.stderr[-2000:]
    ok = subprocess.run([sys.executable, script, "--policy", "fail"], capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0 and "OK: the failed block is not served" in ok.stdout, ok.stdout + ok.stderr[-2000:]


def test_with_sync_failures_on_campaigns_name_the_known_defect(tmp_path, monkeypatch):
    from kvcheck.engines.vllm.connector import SYNC_FAILURES_ENV
    monkeypatch.setenv(SYNC_FAILURES_ENV, "1")
    res = V.run_campaign("full", budget_s=None, steps=20000, seed=5, drive="engine", out_dir=str(tmp_path))
    assert res["coverage"].get("known:connector_recompute_stale_block", 0) > 0, res["findings"]
    assert res["exit_code"] == 10                  # a known safety defect, not acknowledged: never a pass
