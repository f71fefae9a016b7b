"""The worker model of the scheduler drive (worker.py): block tables from SchedulerOutputs alone,
checked against the manager's before each forward (`worker_table_sound`)."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace as NS

import pytest

from kvcheck.engines.vllm.violation import Violation
from kvcheck.engines.vllm.worker import Worker, plant_stale


def _out(new=(), cached=(), resumed=(), finished=(), scheduled=None):
    """A SchedulerOutput's fields the model runner reads for its tables."""
    ids = [rid for rid, _ in cached]
    return NS(finished_req_ids=set(finished),
              scheduled_new_reqs=[NS(req_id=rid, block_ids=tuple(b)) for rid, b in new],
              scheduled_cached_reqs=NS(req_ids=ids, new_block_ids=[b for _, b in cached], resumed_req_ids=set(resumed)),
              num_scheduled_tokens=dict.fromkeys(scheduled if scheduled is not None else [r for r, _ in new] + ids, 1))


def test_tables_follow_the_model_runner_append_replace_and_drop():
    w = Worker()
    w.update(_out(new=[("a", ([1, 2], [7]))]))
    w.update(_out(cached=[("a", ([3], []))]))
    assert w.tables["a"] == [[1, 2, 3], [7]]
    w.update(_out(cached=[("a", None)]))               # no new block: unchanged
    assert w.tables["a"] == [[1, 2, 3], [7]]
    w.update(_out(cached=[("a", ([9], [8]))], resumed=["a"]))   # resumed: replaced, not appended
    assert w.tables["a"] == [[9], [8]]
    w.update(_out(finished=["a"], scheduled=[]))
    assert "a" not in w.tables
    w.update(_out(new=[("b", ([1],))]))
    with pytest.raises(Violation, match="without its block table"):
        w.update(_out(cached=[("b", None)], resumed=["b"]))


def _ad(tables):
    """An adapter's view of the manager: group kinds and req_to_blocks (block objects)."""
    blk = lambda i: NS(block_id=i, is_null=i == 0)          # noqa: E731
    return NS(layout="t", groups=[("full", 4, None), ("swa", 4, 8)],
              _table=lambda g, rid: [blk(i) for i in tables[rid][g]])


def test_the_check_ignores_nulled_positions_and_catches_a_missing_or_wrong_block():
    w = Worker()
    w.update(_out(new=[("a", ([1, 2], [5, 6]))]))
    w.check(_ad({"a": [[1, 2], [0, 6]]}), _out(scheduled=["a"]))     # a window-dropped block: stale is fine
    for wrong in ([[1, 3], [5, 6]], [[1, 2, 4], [5, 6]], [[1], [5, 6]]):
        with pytest.raises(Violation, match="worker's block table of a") as e:
            w.check(_ad({"a": wrong}), _out(scheduled=["a"]))
        assert e.value.check == "worker_table_sound"


def test_the_plant_drops_a_running_requests_first_new_block_only():
    so = _out(cached=[("r", ([], [4, 5])), ("s", ([6], []))], resumed=["r"])
    assert plant_stale(so) and so.scheduled_cached_reqs.new_block_ids == [([], [4, 5]), ([], [])]
    assert not plant_stale(_out(cached=[("r", None)]))


vllm = pytest.importorskip("vllm")
from kvcheck.engines.vllm import drivers as V  # noqa: E402


def test_a_forced_preemption_reset_resumes_with_replaced_tables_and_stays_clean(tmp_path):
    res = V.run_campaign("gemma3", budget_s=None, steps=4000, seed=2, drive="engine", out_dir=str(tmp_path))
    assert res["exit_code"] == 0, res["findings"]
    assert res["coverage"]["state:reset_preempting"] > 0 and res["coverage"]["state:preempted"] > 0
    assert "SchedulerOutput" in res["scheduler"]["worker_model"]


def test_the_worker_fault_is_caught_by_its_check_and_refused_off_the_engine_drive(tmp_path):
    res = V.run_campaign("full", budget_s=None, steps=3000, seed=1, drive="engine", fault="worker_table_stale",
                         out_dir=str(tmp_path))
    assert res["caught"] and res["findings"][-1]["check"] == "worker_table_sound"
    assert V.replay(res["findings"][-1]["trace"])["reproduced"]
    cli = subprocess.run([sys.executable, "-m", "kvcheck", "fuzz", "--sut", "vllm", "--layout", "full",
                          "--fault", "worker_table_stale", "--budget", "100", "--drive", "mixed",
                          "--out", str(tmp_path / "m")], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 2 and "--drive engine" in cli.stderr and "Traceback" not in cli.stderr
    # the default drive (auto) runs it on vLLM's own scheduler, even on a layout that retains sparsely
    # (the dense twin, the manager drive's, is then off: as under --drive engine)
    from kvcheck.engines.vllm.drive_plan import engine_fault_why, static_choice
    assert static_choice("full+swa-sparse", "worker_table_stale", None, "random") == \
        ("engine", engine_fault_why("worker_table_stale"))
