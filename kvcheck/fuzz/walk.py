"""Seeded random walks of the spec with every invariant checked after every step.

Owns the cheapest engine: episodes from Init, swarm-style (each episode enables a random
subset of the non-core actions, so rare interleavings get room), choosing uniformly among
enabled action names. Collects coverage (actions, decisions, object states, transitions) and
the metrics of brief §3; on a violation, the episode is shrunk (kvcheck.fuzz.shrink) to a
short replayable trace (kvcheck.fuzz.traces).
"""
from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from ..spec.objects import DECISION_KINDS, POOL, state_name
from ..spec.system import Spec
from .shrink import shrink as one_shrinker
from .traces import to_trace  # noqa: F401  (the one trace builder; walks' traces are built there)

CORE = ("submit", "lookup", "bind", "use", "append", "finish")
# Disruptive actions are rarer so that episodes build state before it is disturbed
# (a version bump in the first steps of an episode only ever meets empty pools).
WEIGHTS = {"bump_model": 0.04, "bump_indexer": 0.04, "bump_abi": 0.04, "bump_compressor": 0.04, "preempt": 0.3,
           "corrupt": 0.3, "release_graph": 0.5}


@dataclass
class Coverage:
    steps: int = 0
    episodes: int = 0
    actions: Counter = field(default_factory=Counter)
    decisions: Counter = field(default_factory=Counter)
    object_states: Counter = field(default_factory=Counter)   # "kind:state"
    transitions: Counter = field(default_factory=Counter)     # "kind:from->to"

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "episodes": self.episodes,
                "actions": dict(sorted(self.actions.items())),
                "decisions": {k: self.decisions.get(k, 0) for k in DECISION_KINDS},
                "object_states": dict(sorted(self.object_states.items())),
                "transitions": dict(sorted(self.transitions.items()))}


@dataclass
class Metrics:
    lookups: int = 0
    requested_blocks: int = 0
    logical_blocks: int = 0
    usable_blocks: int = 0
    logical_hits: int = 0
    usable_hits: int = 0
    degradations: Counter = field(default_factory=Counter)

    def record(self, d: dict[str, Any], rlen: int) -> None:
        self.lookups += 1
        self.requested_blocks += rlen
        self.logical_blocks += d["logical"]
        self.logical_hits += d["logical"] > 0
        if d["kind"] in ("REUSE", "PARTIAL"):
            self.usable_blocks += d["k"]
            self.usable_hits += d["k"] > 0
        for r in d["reasons"]:
            self.degradations[r] += 1

    def to_dict(self) -> dict[str, Any]:
        rb = max(self.requested_blocks, 1)
        lk = max(self.lookups, 1)
        return {"lookups": self.lookups,
                "logical_hit_rate": round(self.logical_blocks / rb, 4),
                "usable_hit_rate": round(self.usable_blocks / rb, 4),
                "logical_hit_share": round(self.logical_hits / lk, 4),
                "usable_hit_share": round(self.usable_hits / lk, 4),
                "degradations": dict(sorted(self.degradations.items()))}


@dataclass
class Violation:
    step: int
    action: str
    violations: list[tuple[str, str]]
    trace: list[tuple[str, dict[str, Any]]]

    @property
    def invariants(self) -> list[str]:
        return sorted({inv for inv, _ in self.violations})


@dataclass
class WalkResult:
    seed: int
    coverage: Coverage
    metrics: Metrics
    violation: Violation | None
    seconds: float
    full_check: bool


class Walker:
    def __init__(self, spec: Spec, seed: int = 0, episode_len: int = 400, swarm: bool = True,
                 full_check: bool = False) -> None:
        self.spec, self.seed = spec, seed
        self.episode_len, self.swarm, self.full_check = episode_len, swarm, full_check
        self.rng = random.Random(seed)
        self.coverage, self.metrics = Coverage(), Metrics()
        self._rlen = [spec.lay.r(r, "rlen") for r in range(spec.cfg.requests)]

    def _episode_actions(self) -> set[str]:
        names = sorted(self.spec.actions)          # sorted: a set of str iterates by PYTHONHASHSEED
        if not self.swarm or self.coverage.episodes % 4 == 0:   # every 4th episode: everything
            return names
        return {a for a in names if a in CORE or self.rng.random() < 0.5}

    def run(self, steps: int, seconds: float | None = None,
            progress: Callable[[int], None] | None = None) -> WalkResult:
        spec, rng, cov = self.spec, self.rng, self.coverage
        t0 = time.perf_counter()
        deadline = t0 + seconds if seconds else None
        violation = None
        init = spec.init()
        bad = spec.check(init)
        if bad:
            violation = Violation(0, "init", bad, [])
        while violation is None and cov.steps < steps:
            if deadline and time.perf_counter() > deadline:
                break
            allowed = self._episode_actions()
            cov.episodes += 1
            s, trail = init, []
            for _ in range(self.episode_len):
                enabled = [i for i in spec.instances if i.action in allowed and i.guard(s)]
                if not enabled:
                    break
                names = sorted({i.action for i in enabled})
                pick = rng.choices(names, [WEIGHTS.get(n, 1.0) for n in names])[0]
                inst = rng.choice([i for i in enabled if i.action == pick])
                if inst.action == "lookup":
                    r = inst.params["r"]
                    d = spec.decide(s, r)
                    cov.decisions[d["kind"]] += 1
                    self.metrics.record(d, s[self._rlen[r]])
                s2 = inst.effect(s)
                for slot, kind in inst.state_slots:
                    if s[slot] != s2[slot]:
                        a, b = state_name(kind, s[slot]), state_name(kind, s2[slot])
                        cov.transitions[f"{kind}:{a}->{b}"] += 1
                        cov.object_states[f"{kind}:{b}"] += 1
                s = s2
                cov.steps += 1
                cov.actions[inst.action] += 1
                trail.append(inst)
                bad = spec.check(s) if self.full_check else spec.check_after(inst, s)
                if bad:
                    violation = Violation(cov.steps, inst.label(), bad,
                                          [(i.action, i.params) for i in trail])
                    break
                if progress and cov.steps % 1000 == 0:
                    progress(cov.steps)
                if cov.steps >= steps:
                    break
        for kind, _ in POOL.items():
            cov.object_states[f"{kind}:free"] += 0
        cov.object_states["on_disk:none"] += 0
        return WalkResult(self.seed, cov, self.metrics, violation,
                          time.perf_counter() - t0, self.full_check)


# ---- replay and shrinking --------------------------------------------------------------

def replay(spec: Spec, steps: list[tuple[str, dict[str, Any]]]) -> tuple[int, list[tuple[str, str]], str | None]:
    """Run steps from Init. Returns (index of the first violating step or -1, violations,
    error if a step is not enabled / unknown)."""
    s = spec.init()
    for n, (action, params) in enumerate(steps):
        try:
            inst = spec.instance(action, params)
        except KeyError as e:
            return -1, [], str(e.args[0])
        if not inst.guard(s):
            return -1, [], f"step {n}: {inst.label()} is not enabled"
        s = inst.effect(s)
        bad = spec.check(s)
        if bad:
            return n, bad, None
    return -1, [], None


def shrink(spec: Spec, steps: list[tuple[str, dict[str, Any]]], keep: set[str],
           budget_s: float = 5.0) -> list[tuple[str, dict[str, Any]]]:
    """The one shrinker, while the trace still reaches a state violating one of the invariants
    in `keep` (the ones first seen); each candidate is cut after its violating step."""
    def still_fails(cand: list) -> list | None:
        n, bad, err = replay(spec, cand)
        return cand[: n + 1] if err is None and n >= 0 and {inv for inv, _ in bad} & keep else None

    cur = still_fails(list(steps))
    return list(steps) if cur is None else one_shrinker(cur, still_fails, budget_s)
