"""Fuzz campaigns: Hypothesis stateful runs against a system under test, within a budget.

Owns the campaign loop (rounds of examples with seeds derived from the campaign seed, until
the budget of time or steps is spent or a failure is found), the shared example database
(workers and later runs replay each other's failures first), Ctrl-C that keeps what was
found, and the artefacts of a failure: the shrunk trace, a runnable Python reproducer and the
`kvcheck replay` command.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from ..spec.outputs import file_stem
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hyp_seed
from hypothesis.errors import HypothesisException
from hypothesis.internal.conjecture import engine as hyp_engine
from hypothesis.reporting import with_reporter
from hypothesis.stateful import get_state_machine_test

from ..spec.config import Config, ConfigError
from ..spec.objects import DECISION_KINDS
from ..spec.outputs import kvcheck_command, python_command, write_atomic
from ..spec.system import Spec
from ..spec.severity import rank
from ..spec.trace import Trace
from ..spec.verdict import FOR_FINDING, ExitCode
from .exampledb import namespace, open_database
from .lockstep import Finding, lead
from .machine import BudgetSpent, Tally, make_machine, shrink_finding
from .pool import Interrupted, run_jobs
from .guard import raised
from .suts import SutError, resolve_sut
from .traces import to_trace
from .budget import MIN_SECONDS, Budget  # noqa: F401 - where callers have always found them


def run_campaign(cfg: Config, sut: str = "spec", budget: Budget = Budget(seconds=60), seed: int = 0,
                 fault: str | None = None, db: str | None = None, out: Path = Path("kvcheck-report"),
                 steps_per_example: int = 200, examples_per_round: int = 25, shrink_seconds: float = 60.0,
                 progress: Callable[[int], None] | None = None,
                 observability: Path | None = None) -> dict[str, Any]:
    """One worker's campaign. Returns a JSON-serialisable result with `exit_code`.
    `observability`: append Hypothesis's observations (one JSON object per test case and per
    info/alert message) to this JSONL file."""
    if observability is None:
        return _campaign(cfg, sut, budget, seed, fault, db, out, steps_per_example,
                         examples_per_round, shrink_seconds, progress)
    from hypothesis.internal import observability as hyp_obs
    observability.parent.mkdir(parents=True, exist_ok=True)
    # line coverage would put a tracer under every step (10x slower): off for campaigns
    saved, hyp_obs.OBSERVABILITY_COLLECT_COVERAGE = hyp_obs.OBSERVABILITY_COLLECT_COVERAGE, False
    try:
        with observability.open("a") as fh:
            def write(obs: Any) -> None:
                fh.write(json.dumps(dataclasses.asdict(obs), default=repr) + "\n")
            with hyp_obs.with_observability_callback(write):
                res = _campaign(cfg, sut, budget, seed, fault, db, out, steps_per_example,
                                examples_per_round, shrink_seconds, progress)
    finally:
        hyp_obs.OBSERVABILITY_COLLECT_COVERAGE = saved
    res["observability"] = str(observability)
    return res


@contextmanager
def _no_local_constants() -> Iterator[None]:
    """Make a campaign depend on its seed only. Hypothesis draws 5% of its values from constants
    it harvests from every local module loaded so far, so the same seed generated another
    campaign under pytest than in `kvcheck fuzz` (a planted fault found at step 15,828 in one,
    62,771 in the other). Its global constants (0, 1, the bounds, ...) stay. A Hypothesis without
    this internal is left as it is."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:
        yield
        return
    get = getattr(providers, "_get_local_constants", None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if get is None or cache is None:
        yield
        return
    providers._get_local_constants = Constants
    cache.cache.clear()              # cached (global, local) pools per draw type
    try:
        yield
    finally:
        providers._get_local_constants = get
        cache.cache.clear()


def _campaign(cfg: Config, sut: str, budget: Budget, seed: int, fault: str | None, db: str | None,
              out: Path, steps_per_example: int, examples_per_round: int, shrink_seconds: float,
              progress: Callable[[int], None] | None) -> dict[str, Any]:
    spec_fault = fault if sut == "spec" else None
    spec = Spec(cfg, spec_fault)
    factory = resolve_sut(sut, fault)
    actions = machine_actions(spec, factory)   # constructs one SUT: a broken one is exit 2 now
    tally = Tally()
    t0 = time.perf_counter()
    # Shrinking time: a quarter to Hypothesis (its shrinker is slow on long stateful runs and
    # often gives back 100+ steps), the rest to shrinking the chosen steps (fast; it stops early
    # when nothing more comes off).
    hyp_shrink = min(shrink_seconds, max(2.0, shrink_seconds / 4))
    tally.shrink_seconds = hyp_shrink
    if budget.seconds is not None:
        tally.deadline = t0 + budget.seconds
    tally.max_steps = budget.steps        # both end Hypothesis's target phase too (no bound of its own)
    machine = make_machine(spec, factory, tally, actions)
    database = open_database(db, namespace(sut, fault))     # a directory or a Redis URL
    finding: Finding | None = None
    error: str | None = None
    interrupted = False
    rnd = 0
    reports: list[str] = []
    saved_shrink = getattr(hyp_engine, "MAX_SHRINKING_SECONDS", None)
    if saved_shrink is not None:      # bound shrinking so that a campaign stays near its budget
        hyp_engine.MAX_SHRINKING_SECONDS = hyp_shrink
    while True:
        if budget.seconds is not None and time.perf_counter() - t0 >= budget.seconds:
            break
        if budget.steps is not None and tally.steps >= budget.steps:
            break
        s = settings(max_examples=examples_per_round, stateful_step_count=steps_per_example,
                     deadline=None, database=database, derandomize=False,
                     suppress_health_check=list(HealthCheck), print_blob=False,
                     phases=[Phase.reuse, Phase.generate, Phase.target, Phase.shrink])
        test = _seeded(get_state_machine_test(machine, settings=s), seed * 100_003 + rnd, database)
        rnd += 1
        try:
            with with_reporter(reports.append), _no_local_constants():   # prints never reach stdout
                test()
        except Finding as f:
            finding = f
            break
        except BaseExceptionGroup as g:   # several distinct failures: report the first finding
            found = [e for e in _leaves(g) if isinstance(e, Finding)]
            if not found:
                raise
            # the most specific first: what a divergence breaks, before the divergence itself
            finding = min(found, key=Finding.rank)
            break
        except BudgetSpent:
            finding = tally.best       # a failure whose shrinking ran out of time: the best so far
            break
        except KeyboardInterrupt:
            interrupted = True
            break
        except HypothesisException as e:
            if _after_interrupt(e):
                interrupted = True
            elif tally.out_of_time():
                # BudgetSpent stopped a replay (in the target phase or mid-shrink) and Hypothesis
                # calls that flaky: the budget is spent; report the best failure raised, if any
                finding = tally.best
            else:
                error = f"{type(e).__name__}: {e}"
            break
        except SutError:
            raise                      # a constructor that fails later: a broken --sut (exit 2)
        except Exception as e:  # noqa: BLE001 - the SUT raised: that is a finding too
            if _after_interrupt(e):    # Hypothesis failing while it unwinds a Ctrl-C: not the SUT's
                interrupted = True
                break
            finding = raised("a step", e)
            break
        if progress:
            progress(tally.steps)
    if saved_shrink is not None:
        hyp_engine.MAX_SHRINKING_SECONDS = saved_shrink
    if finding is not None and tally.best is not None and tally.best.rank()[:2] < finding.rank()[:2]:
        finding = tally.best          # Hypothesis reports the failure it shrank; a more serious one leads
    if finding is None and error is None and tally.soft is not None:
        finding = tally.soft          # decisions whose reasons differ, and nothing worse found
        tally.found(finding)
    if finding is not None and finding.program and not interrupted:
        try:
            finding = shrink_finding(machine, tally, finding, max(1.0, shrink_seconds - hyp_shrink))
        except KeyboardInterrupt:      # keep the finding unshrunk
            interrupted = True
    seconds = time.perf_counter() - t0
    result: dict[str, Any] = {
        "sut": sut, "seed": seed, "fault": fault, "budget": budget.describe(),
        "seconds": round(seconds, 2), "steps": tally.steps, "examples": tally.runs,
        "steps_per_s": round(tally.steps / max(seconds, 1e-9)),
        "coverage": {"actions": dict(sorted(tally.actions.items())),
                     "actions_missing": sorted(set(actions) - set(tally.actions)),
                     # declared, but the spec never enabled them in any state the run reached
                     "actions_never_enabled": sorted(set(actions) - tally.enabled),
                     "decisions": {k: tally.decisions.get(k, 0) for k in DECISION_KINDS}},
        "interrupted": interrupted, "findings": [],
        # the first failure of the campaign, whichever check it was (named: first_failure_check)
        "seconds_to_first_failure": (round(tally.first_failure_at - t0, 2)
                                     if tally.first_failure_at is not None else None),
        "steps_to_first_failure": tally.steps_to_first_failure,
        "first_failure_check": tally.first_check,
        # every distinct check raised, most serious first (spec/severity.py), then the reported one
        "checks_raised": tally.checks_raised(t0),
    }
    if finding is not None and finding.checks:
        # the first failure by the check that is reported (the most serious raised, which is not
        # always the first; shrinking keeps its leading check): named by detection_check
        want = lead(finding.checks)
        result["reported_check"] = result["detection_check"] = want
        if want in tally.first_by_check:
            at, n = tally.first_by_check[want]
            result["seconds_to_detection"], result["steps_to_detection"] = round(at - t0, 2), n
    if error:
        result["error"] = error
    if any("slow progress" in str(r) for r in reports):
        result["shrink_note"] = f"shrinking stopped at its time bound ({shrink_seconds:g}s)"
    code = ExitCode.OK
    if finding is not None:
        trail = finding.trail or list(tally.last_trail)
        result["findings"].append(save_finding(spec, finding, trail, finding.lockstep if finding.trail else tally.lockstep,
                                               sut, seed, fault, out, f"fuzz-{file_stem(sut)}-{file_stem(fault or 'clean')}-seed{seed}"))
        code = FOR_FINDING[finding.kind]
    elif interrupted:
        code = ExitCode.INTERRUPTED     # stopped early: nothing is claimed
    elif error:
        code = ExitCode.UNDECIDED
    result["exit_code"] = int(code)
    return result


def _after_interrupt(e: BaseException) -> bool:
    """Was `e` raised while a Ctrl-C unwound? Hypothesis 6.170 interrupted inside its engine's
    setup raises `assert state._runner is not None` while handling the KeyboardInterrupt (seen
    once in a few hundred stops): that AssertionError is the interruption, not a SUT's bug."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [e.__context__, e.__cause__]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, KeyboardInterrupt):
            return True
        stack += [x.__context__, x.__cause__]
    return False


def _seeded(test: Callable[[], None], seed: int, database: Any) -> Callable[[], None]:
    """`@seed(seed)` that keeps the example database: Hypothesis's decorator also sets
    `database=None` (a seeded test neither replays nor saves examples), which silently turned
    off the shared database of `--workers`, `--db` and `--redis`."""
    test = hyp_seed(seed)(test)
    test._hypothesis_internal_use_settings = settings(   # type: ignore[attr-defined]
        test._hypothesis_internal_use_settings, database=database)   # type: ignore[attr-defined]
    return test


def _leaves(g: BaseException) -> list[BaseException]:
    if isinstance(g, BaseExceptionGroup):
        return [x for e in g.exceptions for x in _leaves(e)]
    return [g]


def machine_actions(spec: Spec, factory: Callable[[], Any]) -> list[str]:
    """The actions the campaign drives. Constructs and resets one SUT first: a SUT that cannot
    even start (its constructor or reset raises) is a broken --sut, one line and exit 2."""
    sut = factory()
    try:
        sut.reset(spec.cfg)
        close = getattr(sut, "close", None)
        if close is not None:
            close()
    except ConfigError:
        raise                           # a config the SUT does not implement: its own one line
    except Exception as e:  # noqa: BLE001 - any failure is the user's adapter
        raise SutError(f"{getattr(sut, 'name', type(sut).__name__)}: reset() raised "
                       f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    supported = getattr(sut, "actions", None)    # after reset: a SUT may declare per config
    return [a for a in spec.actions if supported is None or a in supported]


def save_finding(spec: Spec, finding: Finding, trail: list[tuple[str, dict[str, Any]]], lockstep: int, sut: str,
                 seed: int, fault: str | None, out: Path, stem: str) -> dict[str, Any]:
    """A finding's artefacts (the trace, a Python reproducer) under `out` as STEM.json/.py, and
    its entry in a result's findings with the `kvcheck replay` command: one writer for every
    search (the random campaign, the exhaustive one)."""
    trace = _trace(spec, trail, sut, seed, finding, fault, lockstep)
    path = trace.save(out / f"{stem}.json")
    repro = write_atomic(out / f"{stem}.py", reproducer_text(path, sut))
    return {"kind": finding.kind, "checks": finding.checks, "message": finding.message,
            "trace": str(path), "trace_steps": [s.label() for s in trace.steps],
            "reproducer": python_command(repro),
            "replay": kvcheck_command("replay", path, *([] if sut == "spec" else ["--sut", sut]))}


def _trace(spec: Spec, trail: list[tuple[str, dict[str, Any]]], sut: str, seed: int,
           finding: Finding, sut_fault: str | None, lockstep: int) -> Trace:
    return to_trace(spec, trail, seed, engine="fuzz", expect_upto=lockstep, sut=sut, finding=finding,
                    meta={"sut_fault": sut_fault})


def reproducer_text(trace: Path, sut: str) -> str:
    """The generated Python reproducer: replays the trace and exits with its code. The one place
    that names the replay entry point (it must not be the command line's module)."""
    return f'''"""kvcheck reproducer: replays the shrunk failing trace and exits with its code."""
import sys

sys.path.insert(0, {os.getcwd()!r})      # where `--sut MODULE:CLASS` was imported from
from kvcheck.fuzz.suts import resolve_sut
from kvcheck.fuzz.traces import replay
from kvcheck.spec.trace import Trace

trace = Trace.load({str(trace)!r})
sut = None if {sut!r} == "spec" else resolve_sut({sut!r}, trace.meta.get("sut_fault"))()
code, out = replay(trace, sut)
print(out)
sys.exit(code)
'''


def _worker(cfg_dict: dict, sut: str, budget: Budget, seed: int, fault: str | None, db: str,
            out: str, obs: str | None) -> dict[str, Any]:
    return run_campaign(Config.from_dict(cfg_dict), sut, budget, seed, fault, db, Path(out),
                        observability=Path(obs) if obs else None)


def run_workers(cfg: Config, sut: str, budget: Budget, seed: int, fault: str | None, db: str | None,
                out: Path, workers: int, observability: Path | None = None) -> dict[str, Any]:
    """N processes with seeds seed..seed+N-1 sharing one example database directory (and, with
    `observability`, one JSONL file each: NAME.wK.jsonl). Ctrl-C: every worker stops, those
    that answer within the grace period are merged, and the result is `interrupted`."""
    db = db or str(out / "hypothesis-db")

    def obs(w: int) -> str | None:
        return None if observability is None else str(observability.with_suffix(f".w{w}.jsonl"))
    jobs = {w: (cfg.to_dict(), sut, budget, seed + w, fault, db, str(out), obs(w)) for w in range(workers)}
    got: dict[int, dict[str, Any]] = {}
    interrupted = False
    try:
        for w, r in run_jobs(_worker, jobs, workers):
            if isinstance(r, BaseException):
                raise r
            got[w] = r
    except Interrupted:
        interrupted = True
    results = [got[w] for w in sorted(got)]
    merged = merge_results(results, cfg, sut, seed, fault, budget)
    if interrupted or len(results) < workers:
        merged["interrupted"] = True
        merged["workers_answered"] = len(results)
        if not merged["findings"]:
            merged["exit_code"] = int(ExitCode.INTERRUPTED)
    return merged


def merge_results(results: list[dict[str, Any]], cfg: Config, sut: str, seed: int,
                  fault: str | None, budget: Budget) -> dict[str, Any]:
    """One result from the workers' (possibly none, after an early Ctrl-C)."""
    if not results:
        spec = Spec(cfg, fault if sut == "spec" else None)
        return {"sut": sut, "seed": seed, "fault": fault, "budget": budget.describe(), "seconds": 0.0,
                "steps": 0, "examples": 0, "steps_per_s": 0, "workers": [], "findings": [],
                "coverage": {"actions": {}, "actions_missing": sorted(spec.actions), "actions_never_enabled": [],
                             "decisions": {k: 0 for k in DECISION_KINDS}},
                "interrupted": True, "exit_code": int(ExitCode.INTERRUPTED)}
    merged = dict(results[0])
    merged["workers"] = results
    merged["steps"] = sum(r["steps"] for r in results)
    merged["findings"] = [f for r in results for f in r["findings"]]
    # a finding first, then an interruption, then the rest: the worst verdict stands
    merged["exit_code"] = max((r["exit_code"] for r in results),
                              key=lambda c: (c != ExitCode.OK, c != ExitCode.INTERRUPTED, c))
    merged["interrupted"] = any(r.get("interrupted") for r in results)
    acts: dict[str, int] = {}
    for r in results:
        for k, v in r["coverage"]["actions"].items():
            acts[k] = acts.get(k, 0) + v
    merged["coverage"] = {"actions": acts,
                          "actions_missing": sorted(set.intersection(*[set(r["coverage"]["actions_missing"]) for r in results])),
                          "actions_never_enabled": sorted(set.intersection(
                              *[set(r["coverage"].get("actions_never_enabled", ())) for r in results])),
                          "decisions": {k: sum(r["coverage"]["decisions"][k] for r in results) for k in DECISION_KINDS}}
    merged["steps_per_s"] = sum(r["steps_per_s"] for r in results)
    raised: dict[str, dict[str, Any]] = {}
    for r in results:                  # each worker's own steps and seconds: the earliest stands
        for c in r.get("checks_raised", ()):
            got = raised.setdefault(c["check"], {**c, "count": 0})
            got["count"] += c["count"]
            if c["first_seconds"] < got["first_seconds"]:
                got.update(first_seconds=c["first_seconds"], first_step=c["first_step"])
    merged["checks_raised"] = sorted(raised.values(), key=lambda d: (*rank(d["kind"], [d["check"]]), d["first_seconds"]))
    return merged
