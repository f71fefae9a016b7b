"""`kvcheck fuzz --ray`: a campaign split over 2 Ray workers finds a planted fault; the
finding lands in Redis and the next run replays it first; a worker killed mid-run loses no
finding (its shard is retried); Ctrl-C keeps what the shards found and is never a pass."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcheck.checker.replay import replay_trace
from kvcheck.fuzz.campaign import Budget
from kvcheck.fuzz.exampledb import KEY_PREFIX, namespace
from kvcheck.fuzz.ray_campaign import TASK_NAME, plan, run_ray
from kvcheck.spec.config import Config
from kvcheck.spec.trace import Trace

ROOT = Path(__file__).resolve().parents[2]
FAULT = "refcount_double_decrement"          # a spec fault Hypothesis finds in well under a second
CHECK = "refcount_equals_holders"


def _fuzz(address: str, *args: str) -> subprocess.Popen:
    """`kvcheck fuzz --ray ADDRESS ... --json` as its own driver, in its own session (a Ctrl-C
    to its process group is what a terminal sends)."""
    return subprocess.Popen([sys.executable, "-m", "kvcheck", "fuzz", "--ray", address, "--json", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _result(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, dict, str]:
    out, err = proc.communicate(timeout=timeout)
    try:
        return proc.returncode, json.loads(out), err
    except json.JSONDecodeError:
        raise AssertionError(f"not JSON (exit {proc.returncode}): {out[-500:]!r} / {err[-1500:]}") from None


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _ours(pid: int) -> bool:
    """A descendant of this process: a worker of the cluster the fixture started here."""
    me = os.getpid()
    while pid > 1:
        pid = _parent(pid)
        if pid == me:
            return True
    return False


def _shard_pids() -> list[int]:
    """Our cluster's worker processes running a shard now (Ray titles them ray::<task name>)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if f.read().startswith(f"ray::{TASK_NAME}".encode()) and _ours(int(d)):
                        pids.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return pids


def _settled_shard(proc: subprocess.Popen, settle_s: float = 2.0, timeout: float = 120) -> int:
    """A shard process seen running for `settle_s` (past its scoreboard registration, which
    run_shard waits for before anything else) and still running."""
    seen: dict[int, float] = {}
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        now = time.monotonic()
        pids = _shard_pids()
        for p in pids:
            seen.setdefault(p, now)
        old = [p for p in pids if now - seen[p] >= settle_s]
        if old:
            return old[0]
        if proc.poll() is not None:
            raise AssertionError(f"the driver ended before a shard settled: {proc.stderr.read()[-1500:]}")
        time.sleep(0.05)
    raise AssertionError("no shard ran for long enough to be killed")


def _wait_for_shards(n: int, proc: subprocess.Popen, timeout: float = 120) -> list[int]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        pids = _shard_pids()
        if len(pids) >= n:
            return pids
        if proc.poll() is not None:
            raise AssertionError(f"the driver ended before {n} shards ran: {proc.stderr.read()[-1500:]}")
        time.sleep(0.05)
    raise AssertionError(f"{n} shards never ran at once")


def test_two_workers_find_the_fault_save_it_in_redis_and_the_next_run_replays_it_first(
        ray_cluster, redis_server, tmp_path) -> None:
    import redis
    url = f"{redis_server}/1"
    code, res, err = _result(_fuzz(ray_cluster, "--workers", "2", "--fault", FAULT, "--budget", "60s",
                                   "--redis", url, "--out", str(tmp_path / "a")))
    assert code == 10, err[-1500:]
    assert res["ray"]["answered"] == [f"spec/{FAULT}/seed0", f"spec/{FAULT}/seed1"]
    assert sorted(w["seed"] for w in res["workers"]) == [0, 1]
    assert len(res["findings"]) == 2 and all(CHECK in f["checks"] for f in res["findings"])
    assert res["steps"] == sum(w["steps"] for w in res["workers"])           # merged like --workers
    for f in res["findings"]:          # the traces came back from the workers and replay here
        assert Path(f["trace"]).parent == tmp_path / "a"
        rc, out = replay_trace(Trace.load(f["trace"]))
        assert rc == 10 and CHECK in out["violation"]["invariants"]
    keys = redis.Redis.from_url(url).keys(KEY_PREFIX + namespace("spec", FAULT).encode() + b":*")
    assert keys, "no example of the finding was saved in Redis"

    # the next run, with other seeds: Hypothesis replays the saved failure before generating
    again = run_ray(Config(), plan([("spec", FAULT)], seed=10, seeds=2), Budget(seconds=60), url,
                    tmp_path / "b", address=ray_cluster)
    assert again["exit_code"] == 10 and len(again["findings"]) == 2
    first = [w["steps_to_first_failure"] for w in res["workers"]]
    replayed = [w["steps_to_first_failure"] for w in again["workers"]]
    assert max(replayed) < min(first), (first, replayed)
    # at once: within the saved example, no longer than an example Hypothesis shrank
    assert max(replayed) <= 2 * max(len(f["trace_steps"]) for f in res["findings"]) + 10, replayed


def test_a_worker_killed_mid_run_loses_no_finding(ray_cluster, redis_server, tmp_path) -> None:
    proc = _fuzz(ray_cluster, "--workers", "2", "--fault", FAULT, "--budget", "60s",
                 "--redis", f"{redis_server}/2", "--out", str(tmp_path))
    _wait_for_shards(2, proc)
    victim = _settled_shard(proc)    # its start is on the scoreboard; it finds and shrinks for seconds
    os.kill(victim, signal.SIGKILL)
    code, res, err = _result(proc)
    assert code == 10, err[-1500:]
    lost = [k for k, pids in res["ray"]["pids"].items() if victim in pids]
    assert lost and res["ray"]["retries"].get(lost[0], 0) >= 1, (victim, res["ray"], err[-2000:])   # ran again
    assert res["ray"]["errors"] == {}
    assert sorted(w["seed"] for w in res["workers"]) == [0, 1]
    assert len(res["findings"]) == 2 and all(CHECK in f["checks"] for f in res["findings"])


def test_ctrl_c_stops_the_shards_keeps_what_they_did_and_is_not_a_pass(ray_cluster, tmp_path) -> None:
    proc = _fuzz(ray_cluster, "--workers", "2", "--budget", "120s", "--out", str(tmp_path))
    _wait_for_shards(2, proc)
    _settled_shard(proc)             # both registered and under way (one settled, the other close)
    os.killpg(proc.pid, signal.SIGINT)
    code, res, err = _result(proc, timeout=90)
    assert code == 130 and res["exit_code"] == 130 and res["interrupted"], err[-1500:]
    assert res["verdict"].startswith("interrupted")
    assert res["workers_answered"] == len(res["workers"]) == 2     # both shards came back ...
    assert all(w["interrupted"] for w in res["workers"])            # ... stopped, not run out
    assert res["steps"] == sum(w["steps"] for w in res["workers"])
    deadline = time.monotonic() + 20
    while _shard_pids() and time.monotonic() < deadline:     # no shard keeps running
        time.sleep(0.2)
    assert _shard_pids() == []


@pytest.mark.slow        # vLLM's import takes ~20 s in the driver and in each worker on a busy box
def test_vllm_layouts_as_shards_find_a_planted_fault_in_each(ray_cluster, tmp_path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")
    code, res, err = _result(subprocess.Popen(
        [sys.executable, "-m", "kvcheck", "fuzz", "--ray", ray_cluster, "--json", "--sut", "vllm",
         "--layout", "full,full+swa", "--fault", "drop_ref_on_free", "--budget", "60s", "--workers", "1",
         "--out", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    assert code == 10, err[-1500:]
    assert res["layouts"] == ["full", "full+swa"] and len(res["ray"]["answered"]) == 2
    assert sorted(f["layout"] for f in res["findings"]) == ["full", "full+swa"]
    assert all(f["check"] == "refcount_equals_holders" for f in res["findings"])
    from kvcheck.engines.vllm import drivers as vllm
    for f in res["findings"]:          # the traces came back and replay on vLLM here
        assert vllm.replay(f["trace"])["reproduced"]


def test_a_project_file_runs_its_fuzz_campaigns_on_ray(ray_cluster, redis_server, tmp_path) -> None:
    """The project file's `ray` / `redis` / `ray_shards` keys: `kvcheck gate` runs the fuzz of a
    system as Ray tasks and its expected fault is caught by its expected check."""
    proj = tmp_path / "kvcheck.toml"
    proj.write_text(f'ray = "{ray_cluster}"\nredis = "{redis_server}/3"\nray_shards = 2\n'
                    '[systems.spec]\nengines = ["fuzz"]\nbudget = 8000\n'
                    f'expected_faults = ["{FAULT}"]\nfault_budget = "60s"\n')
    r = subprocess.run([sys.executable, "-m", "kvcheck", "gate", "--project", str(proj), "--json",
                        "--junit", str(tmp_path / "j.xml"), "--out", str(tmp_path / "rep")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
    rep = json.loads(r.stdout)
    fault = [c for c in rep["checks"] if c["check"] == f"expected_fault:{FAULT}"]
    assert fault and fault[0]["verdict"] == "passed", rep["checks"]
    runs = [c for c in rep["checks"] if c["engine"] == "fuzz" and c["check"] == CHECK]
    assert runs and all(c["verdict"] == "passed" for c in runs)


def test_a_project_file_with_a_bad_ray_key_is_one_line(tmp_path) -> None:
    proj = tmp_path / "kvcheck.toml"
    for text, key in (('ray = 3\n', "ray"), ('redis = "redis://x"\n', "redis"), ('ray = true\nray_shards = 0\n', "ray_shards")):
        proj.write_text(text + '[systems.spec]\nengines = ["fuzz"]\n')
        r = subprocess.run([sys.executable, "-m", "kvcheck", "gate", "--project", str(proj)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and key in r.stderr, r.stderr
