"""Exhaustive small scopes (`kvcheck fuzz --exhaustive DEPTH`): stateless model checking of a
system under test with state caching.

Why: a random campaign samples; on a small config every program up to a few steps can be run,
so "no finding" becomes "none within depth K" and a finding is a shortest one (breadth first).
A SUT cannot be snapshotted, so each program is re-run from `reset` through the one lockstep
loop (GuardedLockstep); a node whose (spec state, `sut.observe()`) pair was already reached at
an equal or smaller depth is not expanded again (the cache is only as sound as `observe()` is
complete: hidden SUT state it does not show is merged). The alphabet is the campaign's: the
spec's enabled instances of the actions the SUT declares (negative probes are not enumerated).
The first finding stops the search; a decision whose reasons alone differ is kept, like the
campaign does, and reported only when nothing worse is found.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable

from ..spec.config import Config
from ..spec.outputs import file_stem
from ..spec.system import Instance, Spec
from ..spec.verdict import FOR_FINDING, ExitCode
from . import shrink as shrinking
from .budget import Budget
from .campaign import machine_actions, save_finding
from .guard import GuardedLockstep, ValuedSpecModel, guard, raised
from .lockstep import Finding, lead
from .machine import drive_model
from .suts import SutError, resolve_sut

SHRINK_SECONDS = 5.0     # a BFS finding is already shortest in steps: only its parameters can shrink


def freeze(v: Any) -> Hashable:
    """An observation as a hashable value (a SUT may observe lists, dicts, sets)."""
    if isinstance(v, (tuple, list)):
        return tuple(freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted(((repr(k), freeze(x)) for k, x in v.items()), key=lambda kv: kv[0]))
    if isinstance(v, (set, frozenset)):
        return frozenset(freeze(x) for x in v)
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)


@dataclass
class Outcome:
    """One program run from reset: its finding, or the node it reached."""

    finding: Finding | None = None
    key: Hashable = None            # (spec state, frozen observation)
    state: tuple | None = None      # the spec state (for the next step's alphabet)
    soft: Finding | None = None     # only a decision's reasons differed
    steps: int = 0


@dataclass
class Search:
    """The counters of a search (what the report states)."""

    depth: int
    reached: int = 0                # levels fully explored
    programs: int = 0               # SUT runs from reset (the empty program included)
    edges: int = 0                  # transitions explored (one per program past the root)
    steps: int = 0                  # SUT steps over every program
    exhausted: bool = False         # no new state at some level: deeper programs add nothing
    stopped: str | None = None      # "budget", "interrupted", "finding"
    states: dict = field(default_factory=dict)     # node key -> depth first reached
    actions: dict = field(default_factory=dict)    # action -> edges taking it


class Runner:
    """Runs programs on fresh SUTs in lockstep with the model (the campaign's skipping rule: a
    step the model does not allow where it falls is skipped)."""

    def __init__(self, model: ValuedSpecModel, factory: Callable[[], Any], cfg: Config) -> None:
        self.model, self.factory, self.cfg = model, factory, cfg

    def run(self, program: list[Instance]) -> Outcome:
        out = Outcome()
        try:
            sut = guard(self.factory())
            sut.reset(self.cfg)
        except Finding as f:             # the SUT raised in reset: every program fails so
            f.program = f.program or list(program[:1])
            out.finding = f
            return out
        core = GuardedLockstep(self.model, sut)
        try:
            for x in program:
                if self.model.allows(core.s, x):
                    core.step(x)
            out.steps = len(core.trail)
            if core.diverged is None:
                out.state = core.s
                out.key = (core.s, freeze(sut.observe()))
            core.end()
        except Finding as f:
            out.finding = f
        except SutError:
            raise                        # a broken --sut: exit 2
        except Exception as e:  # noqa: BLE001 - the lockstep raised on the SUT's behalf
            out.finding = core.stamp(raised("a step", e))
        finally:
            try:
                core.close()
            except Finding as f:
                out.finding = out.finding or f
        if out.finding is None and core.soft is not None:
            out.soft = core.stamp(core.soft)
        out.steps = out.steps or len(core.trail)
        return out

    def alternatives(self, program: list[Instance]) -> list[list[Instance]]:
        """Per step, the other enabled instances of its action (on the spec alone): what the
        shrinker may substitute."""
        s, out = self.model.init(), []
        for x in program:
            out.append([i for i in self.model.instances if i.action == x.action and i is not x and i.guard(s)])
            if x.guard(s):
                s = x.effect(s)
        return out


def search(runner: Runner, depth: int, budget: Budget,
           progress: Callable[[int], None] | None = None) -> tuple[Search, Finding | None, Finding | None]:
    """Breadth first to `depth`. Returns the counters, the finding that stopped it (or None)
    and the shortest soft finding (only reasons differ) met on the way."""
    t0 = time.perf_counter()
    res = Search(depth)
    soft: Finding | None = None

    def out_of_budget() -> bool:
        if budget.steps is not None and res.steps >= budget.steps:
            return True
        return budget.seconds is not None and time.perf_counter() - t0 >= budget.seconds

    def one(program: list[Instance]) -> Outcome:
        nonlocal soft
        o = runner.run(program)
        res.programs += 1
        res.steps += o.steps
        if o.soft is not None and (soft is None or len(o.soft.trail) < len(soft.trail)):
            soft = o.soft
        return o

    root = one([])
    if root.finding is not None:
        res.stopped = "finding"
        return res, root.finding, soft
    res.states[root.key] = 0
    frontier: list[tuple[list[Instance], tuple]] = [([], root.state)]
    try:
        for d in range(1, depth + 1):
            nxt: list[tuple[list[Instance], tuple]] = []
            for prog, s in frontier:
                for x in (i for i in runner.model.instances if i.guard(s)):
                    if out_of_budget():
                        res.stopped = "budget"
                        return res, None, soft
                    o = one(prog + [x])
                    res.edges += 1
                    res.actions[x.action] = res.actions.get(x.action, 0) + 1
                    if o.finding is not None:
                        res.stopped = "finding"
                        return res, o.finding, soft
                    if o.key not in res.states:        # seen before: at an equal or smaller depth
                        res.states[o.key] = d
                        nxt.append((prog + [x], o.state))
                if progress:
                    progress(res.programs)
            res.reached = d
            frontier = nxt
            if not frontier:
                res.exhausted = True
                break
    except KeyboardInterrupt:
        res.stopped = "interrupted"
    return res, None, soft


def run_exhaustive(cfg: Config, sut: str, depth: int, budget: Budget, fault: str | None = None,
                   out: Path = Path("kvcheck-report"), seed: int = 0,
                   progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The search and its result (JSON-serialisable, with `exit_code`)."""
    spec = Spec(cfg, fault if sut == "spec" else None)
    factory = resolve_sut(sut, fault)
    actions = machine_actions(spec, factory)       # a SUT that cannot start: exit 2 now
    model = drive_model(spec, factory, actions)
    runner = Runner(model, factory, cfg)
    t0 = time.perf_counter()
    res, finding, soft = search(runner, depth, budget, progress)
    if finding is not None and finding.program:
        want = lead(finding.checks)
        try:
            finding = shrinking.shrink_finding(
                finding, lambda p: runner.run(p).finding,
                lambda g: (g.kind, g.soft) == (finding.kind, finding.soft) and want in g.checks,
                SHRINK_SECONDS, runner.alternatives)
        except KeyboardInterrupt:
            res.stopped = "interrupted"
    if finding is None and soft is not None and res.stopped != "interrupted":
        finding = soft
    seconds = time.perf_counter() - t0
    complete = res.stopped is None
    exh = {"depth": depth, "reached": res.reached if not complete else depth, "programs": res.programs,
           "states": len(res.states), "edges": res.edges, "steps": res.steps, "complete": complete,
           "exhausted_at": res.reached if res.exhausted else None, "stopped": res.stopped,
           "seconds": round(seconds, 2)}
    result: dict[str, Any] = {
        "sut": sut, "seed": seed, "fault": fault, "budget": budget.describe(), "seconds": round(seconds, 2),
        "steps": res.steps, "examples": res.programs, "exhaustive": exh, "findings": [],
        "coverage": {"actions": dict(sorted(res.actions.items())),
                     "actions_missing": sorted(set(actions) - set(res.actions))},
        "interrupted": res.stopped == "interrupted"}
    if finding is not None:
        stem = f"exhaustive-{file_stem(sut)}-{file_stem(fault or 'clean')}-depth{depth}"
        result["findings"].append(save_finding(spec, finding, finding.trail, finding.lockstep, sut, seed,
                                               fault, out, stem))
        code, verdict = FOR_FINDING[finding.kind], f"failed: a shortest finding at depth {len(finding.program)}"
    elif res.stopped == "interrupted":
        code, verdict = ExitCode.INTERRUPTED, f"interrupted: exhaustive to depth {res.reached}<{depth} only, nothing is claimed"
    elif res.stopped == "budget":
        code, verdict = ExitCode.UNDECIDED, (f"undecided: exhaustive to depth {res.reached}<{depth} only "
                                             f"(budget {budget.describe()} spent)")
    else:
        code = ExitCode.OK
        verdict = f"holds: exhaustive to depth {depth}, complete" + (
            f" (no new state past depth {res.reached - 1}: every depth holds)" if res.exhausted else "")
    result["verdict"], result["exit_code"] = verdict, int(code)
    return result


def summary(res: dict[str, Any]) -> str:
    """The report's one line of counts."""
    e = res["exhaustive"]
    to = f"depth {e['depth']}" if e["complete"] else f"depth {e['reached']}<{e['depth']} (incomplete)"
    n = len(res["findings"])
    return (f"exhaustive to {to}: {e['programs']} programs run, {e['states']} distinct states, "
            f"{e['edges']} edges, findings {n}, {e['steps']} SUT steps in {e['seconds']} s")
