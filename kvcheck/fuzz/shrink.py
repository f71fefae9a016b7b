"""The one shrinker: a failing program made short while it still fails the same way.

Every driver shrinks with it (random walks, the Hypothesis machine's chosen steps, `kvcheck
diff` scenarios, vLLM campaigns); what "the same way" means is the caller's predicate.
"""
from __future__ import annotations

import time
from typing import Any, Callable

Program = list[Any]


def shrink(program: Program, fails: Callable[[Program], Program | None], seconds: float,
           alternatives: Callable[[Program], list[list[Any]]] | None = None,
           related: Callable[[Program], list[list[int]]] | None = None) -> Program:
    """Delete chunks of steps (halves, quarters, ... single steps) while `fails(candidate)`
    still returns a program (the steps that ran up to the failure: it may be shorter than
    the candidate); with `related` (groups of step indices that only make sense together,
    e.g. one request's steps, which no contiguous chunk holds), delete each whole group too;
    then, with `alternatives` (per step, the other steps that could stand there), try each
    one-step change and keep it when deleting again gives a shorter program.
    Returns the shortest failing program found within `seconds`. Deterministic but for
    where the time runs out."""
    deadline = time.perf_counter() + seconds

    def delete(prog: Program) -> Program:
        chunk = max(1, len(prog) // 2)
        while chunk >= 1 and time.perf_counter() < deadline:
            i, changed = 0, False
            while i < len(prog) and time.perf_counter() < deadline:
                cand = prog[:i] + prog[i + chunk:]
                got = fails(cand) if cand else None
                if got is not None:
                    prog, changed = list(got), True
                else:
                    i += chunk
            if not changed:
                chunk //= 2
        return drop_groups(prog) if related is not None else prog

    def drop_groups(prog: Program) -> Program:
        """Delete each related group whole (first to last), deleting chunks again after."""
        assert related is not None
        k = 0
        while time.perf_counter() < deadline:
            groups = [sorted(set(g)) for g in related(prog) if 0 < len(set(g)) < len(prog)]
            if k >= len(groups):
                return prog
            drop = set(groups[k])
            got = fails([x for i, x in enumerate(prog) if i not in drop])
            if got is not None and len(got) < len(prog):
                return delete(list(got))
            k += 1
        return prog

    def substitute(prog: Program) -> Program | None:
        """The first one-step change after which deleting gives a shorter program."""
        assert alternatives is not None
        for i, alts in enumerate(alternatives(prog)):
            for x in alts:
                if time.perf_counter() >= deadline:
                    return None
                got = fails(prog[:i] + [x] + prog[i + 1:])
                if got is not None:
                    got = delete(list(got))
                    if len(got) < len(prog):
                        return got
        return None

    best: Program | None = delete(list(program))
    cur = program
    while best is not None:
        cur = best
        best = substitute(best) if alternatives is not None else None
    return cur


def shrink_finding(f: Any, run: Callable[[Program], Any], same: Callable[[Any], bool], seconds: float,
                   alternatives: Callable[[Program], list[list[Any]]] | None = None,
                   related: Callable[[Program], list[list[int]]] | None = None) -> Any:
    """`shrink` for a finding of the lockstep core: `run(program)` replays a program and returns
    its finding (or None); a candidate counts when `same(finding)`. Returns the finding of the
    shortest program (`f` itself when nothing shorter fails the same way)."""
    found: dict[tuple[int, ...], Any] = {}

    def fails(prog: Program) -> Program | None:
        g = run(prog)
        if g is None or not same(g):
            return None
        found[tuple(map(id, g.program))] = g
        return g.program
    best = shrink(f.program, fails, max(0.0, seconds), alternatives, related)
    return found.get(tuple(map(id, best)), f)
