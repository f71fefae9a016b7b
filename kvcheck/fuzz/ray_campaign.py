"""Fuzz campaigns beyond one machine: shards as Ray tasks across a cluster.

The process pool of `fuzz --workers` replaced by Ray tasks: each shard (a SUT, a fault, a
seed, a layout) is one `run_campaign` (for `vllm`, vLLM's own driver) on some node, and their
results are merged by the same `merge_results`, so the JSON has the shape of `fuzz --workers`. The example database is shared through Redis
(a finding saved by one shard is replayed first by every later shard and run). A shard whose
worker dies is run again (Ray's `max_retries`; the retry replays the database first). Ctrl-C
asks every running shard to stop (each returns what it found), waits a grace period, cancels
the rest and keeps what finished: the result is `interrupted`, never a pass.

Trace files are written on the worker's node; a shard sends them back with its result and
they are written here, under `out`. Ray is an optional dependency (`pip install
'kvcheck[scale]'`), imported only when a campaign runs.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..spec.config import Config
from ..spec.outputs import kvcheck_command, python_command, write_atomic
from ..spec.verdict import ExitCode
from .exampledb import INSTALL

if TYPE_CHECKING:
    from .campaign import Budget

TASK_NAME = "kvcheck-shard"      # the process title of a worker running a shard: ray::kvcheck-shard


class ScaleUnavailable(Exception):
    """Ray (or redis) is not installed: the one line says how to install them."""


def require_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ScaleUnavailable(f"--ray needs Ray and redis: {INSTALL}") from None
    return ray


def connect(address: str | None) -> None:
    """Join the cluster at `address` (None: RAY_ADDRESS, one started on this machine, or a new
    local one); quiet (no dashboard, workers' logs stay on their nodes)."""
    ray = require_ray()
    _reachable(address)
    # A local cluster's processes (GCS, raylet, workers) are this process's children, in the
    # terminal's process group: a Ctrl-C reached them too and left the driver waiting on a
    # cluster that had stopped answering. Started with SIGINT ignored, they inherit that; the
    # driver alone takes the Ctrl-C (a Ctrl-C during start-up is lost).
    main = threading.current_thread() is threading.main_thread()
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=False, configure_logging=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        hint = ("" if os.environ.get("RAY_AUTH_MODE") else
                "; a cluster with token authentication (`ray start` since Ray 2.59) needs "
                "RAY_AUTH_MODE=token and its token here (see docs/scale.md)")
        raise ScaleUnavailable(f"cannot connect to the Ray cluster at {address or 'auto'}: "
                               f"{' '.join(str(e).split())[:200]}{hint}") from None
    finally:
        if main:
            signal.signal(signal.SIGINT, saved)


def _reachable(address: str | None) -> None:
    """HOST:PORT answers a TCP connect within 5 s (Ray itself retries a wrong address for
    minutes). Other forms (auto, local, ray://...) are left to Ray."""
    import socket
    host, sep, port = (address or "").rpartition(":")
    if not sep or not host or "://" in (address or "") or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise ScaleUnavailable(f"cannot connect to the Ray cluster at {address}: "
                               f"{e.strerror or e} (is `ray start --head` running there?)") from None


def cluster_cpus() -> int:
    return max(1, int(require_ray().cluster_resources().get("CPU", 1)))


@dataclass(frozen=True)
class Shard:
    """One task: a campaign on one SUT with one fault (or none), one seed and one layout: for
    the Hypothesis machines a config as JSON text named `layout` (None: the campaign's config);
    for `vllm`, the vLLM layout's name (`strict`: lost reuse fails the shard)."""

    sut: str
    seed: int
    fault: str | None = None
    layout: str = ""
    config: str | None = None
    strict: bool = False

    @property
    def key(self) -> str:
        return "/".join([self.sut] + ([self.layout] if self.layout else []) + [self.fault or "clean", f"seed{self.seed}"])


def plan(suts: list[tuple[str, str | None]], seed: int, seeds: int,
         layouts: dict[str, Config] | None = None) -> list[Shard]:
    """Shards by SUT (with its fault), layout and seed: seeds seed..seed+seeds-1 of each."""
    lay = [(name, json.dumps(c.to_dict())) for name, c in (layouts or {}).items()] or [("", None)]
    return [Shard(s, seed + k, f, name, text) for s, f in suts for name, text in lay for k in range(seeds)]


class Board:
    """The campaign's scoreboard (a Ray actor): steps per shard, starts per shard (a start
    after the first is a retry), and the stop flag that Ctrl-C raises."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}
        self.starts: dict[str, list[int]] = {}
        self.stop = False

    def started(self, key: str, pid: int) -> None:
        self.starts.setdefault(key, []).append(pid)
        self.steps[key] = 0

    def report(self, key: str, steps: int) -> None:
        self.steps[key] = steps

    def request_stop(self) -> None:
        self.stop = True

    def stopping(self) -> bool:
        return self.stop

    def snapshot(self) -> dict[str, Any]:
        return {"steps": sum(self.steps.values()), "starts": dict(self.starts)}


def run_shard(cfg_dict: dict, shard: Shard, budget: Budget, db: str | None, board: Any) -> dict[str, Any]:
    """Run on a worker: one campaign in a scratch directory; its files come back in the result."""
    import _thread

    import ray
    # first, and waited for: a worker lost from here on is recorded, and its rerun is a retry
    ray.get(board.started.remote(shard.key, os.getpid()))

    from .campaign import merge_results, run_campaign       # (hypothesis, the spec: a second on a busy node)
    from .pool import keep_interrupts
    keep_interrupts()                 # a stop delivered inside a gc callback is not lost
    if threading.current_thread() is threading.main_thread():   # workers may inherit SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
    done = threading.Event()

    def watch() -> None:              # Ctrl-C on the driver: stop like a local campaign does
        while not done.wait(0.5):
            try:
                if ray.get(board.stopping.remote(), timeout=10):
                    if not done.is_set():          # not once the campaign has returned
                        _thread.interrupt_main()
                    return
            except Exception:  # noqa: BLE001 - the board is gone: the driver is; keep going
                return
    threading.Thread(target=watch, daemon=True).start()
    tmp = Path(tempfile.mkdtemp(prefix="kvcheck-shard-"))
    try:
        if shard.layout:                # an engine's own driver (no Hypothesis: no example database)
            from . import registry
            res = registry.get(shard.sut).campaign(shard.layout, budget_s=budget.seconds, steps=budget.steps,
                                                   seed=shard.seed, strict_reuse=shard.strict, fault=shard.fault,
                                                   out_dir=str(tmp))
        else:
            cfg = Config.from_dict(json.loads(shard.config) if shard.config else cfg_dict)
            try:
                res = run_campaign(cfg, shard.sut, budget, shard.seed, shard.fault,
                                   db, tmp, progress=lambda n: board.report.remote(shard.key, n))
            except KeyboardInterrupt:     # stopped before the campaign took over its Ctrl-C
                res = merge_results([], cfg, shard.sut, shard.seed, shard.fault, budget)
        board.report.remote(shard.key, res["steps"])
        res["shard"] = shard.key
        if shard.layout:
            res["layout"] = shard.layout
            for f in res["findings"]:
                f["layout"] = shard.layout
        res["node"] = ray.util.get_node_ip_address()
        res["node_id"] = ray.get_runtime_context().get_node_id()
        res["files"] = {p.name: p.read_text() for p in sorted(tmp.iterdir()) if p.is_file()}
        res["scratch"] = str(tmp)
        return res
    finally:
        done.set()
        shutil.rmtree(tmp, ignore_errors=True)


def _land(res: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write a shard's files under `out` and point its findings at them."""
    scratch, files = res.pop("scratch", None), res.pop("files", {})
    for name, text in files.items():
        if scratch:
            text = text.replace(repr(str(Path(scratch) / name.replace(".py", ".json"))),
                                repr(str(out / name.replace(".py", ".json"))))
        write_atomic(out / name, text)
    for f in res.get("findings", []):
        trace = out / Path(f["trace"]).name
        f["trace"] = str(trace)
        if "reproducer" in f:
            f["reproducer"] = python_command(trace.with_suffix(".py"))
        f["replay"] = kvcheck_command("replay", trace, *([] if res["sut"] == "spec" else ["--sut", res["sut"]]))
    return res


def run_ray(cfg: Config, shards: list[Shard], budget: Budget, db: str | None, out: Path,
            address: str | None = None, progress: Callable[..., None] | None = None,
            retries: int = 3, grace_s: float = 10.0) -> dict[str, Any]:
    """Run `shards` as Ray tasks on the cluster at `address` (None: RAY_ADDRESS, a cluster
    started on this machine, or a new local one) and merge their results (one SUT: the shape
    of `fuzz --workers`; several: one merged result per SUT under `suts`)."""
    ray = require_ray()
    started_here = not ray.is_initialized()
    if started_here:
        connect(address)
    try:
        return _drive(ray, cfg, shards, budget, db, out, progress, retries, grace_s)
    finally:
        if started_here:
            ray.shutdown()


def _drive(ray: Any, cfg: Config, shards: list[Shard], budget: Budget, db: str | None, out: Path,
           progress: Callable[..., None] | None, retries: int, grace_s: float) -> dict[str, Any]:
    board = ray.remote(num_cpus=0)(Board).remote()
    task = ray.remote(num_cpus=1, max_retries=retries)(run_shard).options(name=TASK_NAME)
    cfg_dict = cfg.to_dict()
    refs = {task.remote(cfg_dict, s, budget, db, board): s for s in shards}
    got: dict[Shard, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    interrupted = False

    def collect(timeout: float) -> None:
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout)
        for ref in done:
            pending.discard(ref)
            try:
                got[refs[ref]] = _land(ray.get(ref), out)
            except (ray.exceptions.TaskCancelledError, KeyboardInterrupt):
                pass
            except ray.exceptions.RayError as e:     # retries spent, or the shard raised
                errors[refs[ref].key] = " ".join(str(e).split())[:300]

    pending = set(refs)
    try:
        while pending:
            collect(0.5)
            if progress:
                steps = ray.get(board.snapshot.remote())["steps"]
                progress(len(refs) - len(pending), len(refs))
                progress(f"fuzz on Ray: {len(refs) - len(pending)}/{len(refs)} shards, {steps} steps")
    except KeyboardInterrupt:
        interrupted = True
        board.request_stop.remote()
        deadline = time.monotonic() + grace_s
        try:
            while pending and time.monotonic() < deadline:
                collect(min(0.5, max(0.0, deadline - time.monotonic())))
        except KeyboardInterrupt:     # a second Ctrl-C: stop waiting
            pass
        for ref in pending:
            ray.cancel(ref, force=True)
    starts = ray.get(board.snapshot.remote())["starts"]
    return _merge(cfg, shards, got, errors, starts, budget, interrupted, ray)


def _merge(cfg: Config, shards: list[Shard], got: dict[Shard, dict[str, Any]], errors: dict[str, str],
           starts: dict[str, list[int]], budget: Budget, interrupted: bool, ray: Any) -> dict[str, Any]:
    from .campaign import merge_results
    by_sut: dict[str, dict[str, Any]] = {}
    for sut in dict.fromkeys(s.sut for s in shards):
        mine = [s for s in shards if s.sut == sut]      # all its layouts: one coverage
        results = [got[s] for s in mine if s in got]
        m = (_merge_vllm(results, mine) if sut == "vllm" else
             merge_results(results, cfg, sut, mine[0].seed, mine[0].fault, budget))
        if interrupted or len(results) < len(mine):
            m["interrupted"] = interrupted or m.get("interrupted", False)
            m["workers_answered"] = len(results)
            if not m["findings"]:
                m["exit_code"] = int(ExitCode.INTERRUPTED if interrupted else ExitCode.UNDECIDED)
        by_sut[sut] = m
    merged = next(iter(by_sut.values())) if len(by_sut) == 1 else _combine(by_sut)
    merged["ray"] = {"nodes": len([n for n in ray.nodes() if n.get("Alive")]),
                     "shards": [s.key for s in shards], "answered": [s.key for s in shards if s in got],
                     "retries": {k: len(p) - 1 for k, p in starts.items() if len(p) > 1},
                     "pids": starts,             # the worker process of each start of a shard
                     "errors": errors}
    return merged


def _merge_vllm(results: list[dict[str, Any]], shards: list[Shard]) -> dict[str, Any]:
    """vLLM shards (layouts x seeds): the shape of `fuzz --sut vllm`, summed; the verdict is the
    worst finding, else undecided where an action was never exercised in any shard."""
    from collections import Counter
    cov: Counter = Counter()
    for r in results:
        cov.update(r["coverage"])
    missing = sorted(set.intersection(*[set(r["missing_actions"]) for r in results])) if results else []
    codes = [r["exit_code"] for r in results if r["exit_code"] != ExitCode.UNDECIDED]
    code = max(codes, default=ExitCode.OK)
    if code == ExitCode.OK and (missing or not results):
        code = ExitCode.UNDECIDED
    return {"sut": "vllm", "vllm_version": results[0]["vllm_version"] if results else None,
            "layouts": sorted({s.layout for s in shards}), "seed": shards[0].seed, "fault": shards[0].fault,
            "steps": sum(r["steps"] for r in results), "episodes": sum(r["episodes"] for r in results),
            "coverage": dict(sorted(cov.items())), "missing_actions": missing,
            "findings": [f for r in results for f in r["findings"]], "interrupted": False,
            "exit_code": int(code), "workers": results}


def _combine(by_sut: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Several SUTs: the findings of all, the worst verdict, each SUT's own merge."""
    rs = list(by_sut.values())
    return {"suts": by_sut, "findings": [f for r in rs for f in r["findings"]],
            "steps": sum(r["steps"] for r in rs), "interrupted": any(r.get("interrupted") for r in rs),
            "exit_code": max((r["exit_code"] for r in rs),
                             key=lambda c: (c != ExitCode.OK, c != ExitCode.INTERRUPTED, c))}
