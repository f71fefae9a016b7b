"""Standalone reproducers of scheduler-drive findings (engine_repro.py): the script builds vLLM's own
Scheduler, replays the trace's steps through it and checks the finding's condition with vLLM alone.

The scripts run outside this process, with ``sys.executable``: the PRIORITY one on its own
(``python script.py``, started first, while the campaigns find the fault traces), then every run
(each script, and with --clean) as ``__main__``, one after the other, in one more interpreter (a
process spends ~13 s importing vLLM: ten of them would take minutes). A second release's
interpreter (KVCHECK_VLLM_SIDE_PYTHON, e.g. the 0.14.1 side environment) runs every script too.
Needs vllm."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from kvcheck.engines.vllm import drivers as V  # noqa: E402
from kvcheck.engines.vllm.engine_repro import ENGINE_PLANTS, write_engine_reproducer  # noqa: E402
from kvcheck.engines.vllm.layouts import layout_config  # noqa: E402
from kvcheck.engines.vllm.sched_build import SchedKnobs  # noqa: E402
from kvcheck.spec.trace import Step, Trace  # noqa: E402

FAULTS = [("full+swa", "swa_hit_unchecked"), ("full", "drop_ref_on_free"), ("full+swa", "evict_keeps_hash"),
          ("full", "early_reader_forward"), ("full", "worker_table_stale")]
SIDE = os.environ.get("KVCHECK_VLLM_SIDE_PYTHON")       # another release's interpreter (optional)
ALLOWED_IMPORTS = {"atexit", "contextlib", "copy", "importlib", "inspect", "io", "os", "shutil", "sys", "tempfile",
                   "torch", "traceback", "transformers", "types", "vllm", "zlib"}


def priority_trace(path: Path) -> str:
    """vLLM's PRIORITY scheduler preempts a request it already scheduled in the step (its chunk's
    blocks published by allocate_slots), then resumes it from those blocks: never written
    (priority_preempt_unwritten). A (low priority) runs first; C makes the prefill cap apply from
    the first step on every release; B (high priority) is admitted next, and when its decode needs
    a block that A's chunk took, A is the victim."""
    knobs = SchedKnobs(policy="priority", max_num_batched_tokens=16, max_num_seqs=4,
                       long_prefill_token_threshold=8, num_blocks=8, spec_tokens=1)
    steps = [Step("submit", {"r": "A", "tokens": list(range(1, 27)), "salt": None, "prio": 1, "max_tokens": 4}),
             Step("submit", {"r": "C", "tokens": [35, 36], "salt": None, "prio": 1, "max_tokens": 1}),
             Step("step"), Step("submit", {"r": "B", "tokens": [30, 31, 32, 33], "salt": None, "prio": 0,
                                           "max_tokens": 2}),
             Step("step"), Step("step"), Step("step")]
    trace = Trace(layout_config("full"), steps, None, "vllm-fuzz", 0, "vllm",
                  {"step": len(steps) - 1, "kind": "safety", "checks": ["read_before_write"],
                   "check": "read_before_write", "message": "hand-made: the PRIORITY scheduler preempts a request "
                                                            "it scheduled in the step, then resumes it"},
                  {"vllm_version": vllm.__version__, "layout": "full", "num_blocks": knobs.num_blocks,
                   "strict_reuse": False, "sched_policy": "priority", "drive": "engine", "scheduler": knobs.as_dict()})
    return str(trace.save(path))


def reset_running_trace(path: Path) -> str:
    """reset_prefix_cache with running=True: vLLM's scheduler preempts A (its blocks freed, so the
    reset succeeds) and A resumes in the next step with a new block table, which the worker's table
    takes in place of the old one; the planted stale output (worker_table_stale) drops the new block
    of A's decode in the step after, the finding's (a script that played the reset as the manager's
    would see it refused; one that appended a resumed table would break a step earlier)."""
    knobs = SchedKnobs(num_blocks=16)
    steps = [Step("submit", {"r": "A", "tokens": list(range(1, 7)), "salt": None, "prio": 0, "max_tokens": 8}),
             Step("step"), Step("step"), Step("reset_prefix_cache", {"running": True}), Step("step"), Step("step")]
    trace = Trace(layout_config("full"), steps, "worker_table_stale", "vllm-fuzz", 0, "vllm",
                  {"step": len(steps) - 1, "kind": "safety", "checks": ["worker_table_sound"],
                   "check": "worker_table_sound", "message": "hand-made: a preempting reset, then a stale table"},
                  {"vllm_version": vllm.__version__, "layout": "full", "num_blocks": knobs.num_blocks,
                   "strict_reuse": False, "sched_policy": "fcfs", "drive": "engine", "scheduler": knobs.as_dict()})
    return str(trace.save(path))


# runs scripts as __main__ one after the other: [(script, args, output file)] -> exit codes (a JSON list)
BATCH = """
import contextlib, json, runpy, sys
jobs, codes = json.loads(sys.argv[1]), []
for script, args, out in jobs:
    sys.argv = [script, *args]
    with open(out, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException as e:              # (what the script's excepthook makes exit 2)
            print(f"CANNOT PLAY: {type(e).__name__}: {e}")
            code = 2
    codes.append(code)
print(json.dumps(codes))
"""


class Runs:
    """Script processes (started now), their exit codes and output read when a test asks."""

    def __init__(self, where: Path) -> None:
        self.where, self.procs, self.infos = where, {}, {}
        self.env = {**os.environ, "PYTHONPATH": ""}     # (and a cwd without kvcheck: vLLM alone)

    def _pythons(self) -> list[tuple[str, str]]:
        return [(sys.executable, ""), *([(SIDE, "side")] if SIDE else [])]

    def alone(self, key: str, script: str) -> None:
        """`python script.py`, in a process of its own."""
        for py, tag in self._pythons():
            out = self.where / f"{key}{tag}.out"
            self.procs[(key, tag, ())] = (subprocess.Popen(
                [py, script], stdout=out.open("w"), stderr=subprocess.STDOUT, cwd=self.where, env=self.env),
                out, None)

    def batch(self, runs: list[tuple[str, str, tuple[str, ...]]]) -> None:
        """Each (key, script, args), as __main__, one after the other in one more interpreter per release."""
        for py, tag in self._pythons():
            jobs = [(s, list(args), str(self.where / f"{k}{tag}{''.join(args)}.out")) for k, s, args in runs]
            proc = subprocess.Popen([py, "-c", BATCH, json.dumps(jobs)], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, cwd=self.where, env=self.env)
            for i, (k, _, args) in enumerate(runs):
                self.procs[(k, tag, args)] = (proc, Path(jobs[i][2]), i)

    def result(self, key: str, *args: str, tag: str = "") -> tuple[int, str]:
        proc, out, i = self.procs[(key, tag, args)]
        if i is None:
            return proc.wait(timeout=1800), out.read_text()
        if not hasattr(proc, "codes"):
            proc.codes = json.loads(proc.communicate(timeout=1800)[0].strip().splitlines()[-1])
        return proc.codes[i], out.read_text()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    where = tmp_path_factory.mktemp("engine-repro")
    r = Runs(where)
    path = priority_trace(where / "vllm-full-priority.json")
    r.infos["priority"] = info = write_engine_reproducer(Trace.load(path), path)
    assert info["reproducer"], info
    r.alone("priority", info["reproducer"])
    path = reset_running_trace(where / "vllm-full-reset-running.json")
    r.infos["reset_running"] = info = write_engine_reproducer(Trace.load(path), path)
    assert info["reproducer"], info
    for layout, fault in FAULTS:
        res = V.run_campaign(layout, budget_s=None, steps=4000, seed=1, drive="engine", fault=fault,
                             out_dir=str(where / fault))
        f = next(x for x in res["findings"] if x["check"] == res["expected_check"])
        r.infos[fault] = {**write_engine_reproducer(Trace.load(f["trace"]), f["trace"]), "finding": f}
    played = ("reset_running", *(f for _, f in FAULTS))
    r.batch([(k, r.infos[k]["reproducer"], ("--clean",)) for k in ("priority", *played)]
            + [(k, r.infos[k]["reproducer"], ()) for k in played])
    yield r
    for proc, _, _ in r.procs.values():
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("layout,fault", FAULTS)
def test_planted_fault_scripts_exit_1_and_0_clean(layout, fault, runs):
    info = runs.infos[fault]
    assert set(info) - {"finding"} == {"reproducer", "reproducer_run"}, info
    src = Path(info["reproducer"]).read_text()
    assert f"PLANTED FAULT (kvcheck negative control {fault!r})" in src and ENGINE_PLANTS[fault] in src
    assert f"CHECK = {info['finding']['check']!r}" in src and "STEPS = [" in src
    code, out = runs.result(fault)
    assert code == 1 and "BUG: " in out, out
    code, out = runs.result(fault, "--clean")
    assert code == 0 and "OK: " in out, out


def test_the_priority_preemption_of_a_scheduled_request_exits_1(runs):
    """The real vLLM defect (no planted fault: --clean changes nothing): the script shows A's
    allocation in the step, A preempted in that step, and A's resume reading a block never written."""
    code, out = runs.result("priority")
    assert code == 1, out
    assert "allocate_slots A for tokens up to 24: new blocks" in out and "preempted ['A']" in out, out
    assert "BUG: A's forward (tokens from 20) reads block #" in out and "never written" in out, out
    code, out = runs.result("priority", "--clean")
    assert code == 1 and "BUG: " in out, out


def test_a_reset_preempting_the_running_requests_plays_in_the_script(runs):
    """The script plays reset_prefix_cache {"running": true} as the scheduler's reset: A is freed, the
    reset succeeds, A resumes with a new table (replacing the worker's); the finding is the last step's."""
    assert "['reset_prefix_cache', {'running': True}]" in Path(runs.infos["reset_running"]["reproducer"]).read_text()
    code, out = runs.result("reset_running")
    assert code == 1, out
    reset = out[out.index("step 3: reset_prefix_cache"):out.index("step 4: step")]
    assert "free A" in reset and "reset: True" in reset, out
    assert "scheduled A [0, 8) (admitted)" in out and out.index("step 5: step") < out.index("BUG: A's block table"), out
    code, out = runs.result("reset_running", "--clean")
    assert code == 0 and "OK: " in out, out


def test_scripts_import_only_vllm_and_its_own_dependencies(runs):
    for key, info in runs.infos.items():
        tree = ast.parse(Path(info["reproducer"]).read_text())
        mods = {n.split(".")[0] for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for n in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])}
        assert mods <= ALLOWED_IMPORTS, (key, mods - ALLOWED_IMPORTS)


def test_findings_without_a_condition_or_replay_say_why(runs, tmp_path):
    f = runs.infos["drop_ref_on_free"]["finding"]
    t = Trace.load(f["trace"])
    t.violation = {**t.violation, "check": "free_count"}
    got = write_engine_reproducer(t, str(tmp_path / "a.json"))
    assert got["reproducer"] is None and "no plain-code condition" in got["reproducer_note"]
    assert "kvcheck replay" in got["reproducer_note"]
    t.violation = {**t.violation, "check": "hash_map_sound"}        # not what this trace shows
    got = write_engine_reproducer(t, str(tmp_path / "b.json"))
    assert got["reproducer"] is None and "does not reproduce 'hash_map_sound'" in got["reproducer_note"]
    t.fault, t.violation = "retention_drops_tail", {**t.violation, "check": "lost_reuse_retention"}
    got = write_engine_reproducer(t, str(tmp_path / "c.json"))
    assert got["reproducer"] is None and "dense twin" in got["reproducer_note"]


@pytest.mark.skipif(not SIDE, reason="KVCHECK_VLLM_SIDE_PYTHON names no second release's interpreter")
@pytest.mark.parametrize("key", ["drop_ref_on_free", "evict_keeps_hash", "early_reader_forward", "priority"])
def test_the_same_scripts_on_a_second_release(key, runs):
    """0.14.1: the planted faults show (1) and leave (0 --clean); the PRIORITY defect is there too.
    (swa_hit_unchecked cannot be planted on a release without the contiguous-block rule: exit 2.)"""
    code, out = runs.result(key, tag="side")
    assert code == 1 and "BUG: " in out, out
    code, out = runs.result(key, "--clean", tag="side")
    assert code == (1 if key == "priority" else 0), out
