"""The one shrinker: a failing program made small while it still fails the same way.

Every driver shrinks with it (random walks, the Hypothesis machine's chosen steps, `kvcheck
diff` scenarios, vLLM and SGLang campaigns); what "the same way" means is the caller's predicate.

"Small" is shortlex: fewer steps first, then fewer parameter atoms (list items, scalars), then
smaller integers. Deletion only ever shortens; a one-step change is kept when the program it
leaves is smaller in that order (a later deletion may need two such changes, neither of which
shortens by itself: an eviction standing for the requests that filled the pool, then a prompt
that makes the locked node a leaf), or when deleting again after it gives a shorter program.
Every accepted candidate is smaller than the last, so shrinking ends; it is deterministic but
for where the time runs out (each distinct candidate runs once).
"""
from __future__ import annotations

import time
from typing import Any, Callable

Program = list[Any]
WALL_FACTOR = 10       # a backstop for programs that wait rather than compute: wall time <= 10x the budget


def budget(seconds: float) -> Callable[[], bool]:
    """`left()`: whether time is left. Shrinking is budgeted in CPU time of this thread, so a
    loaded machine (other processes taking the cores) does not cut it short: the result is the
    same as on an idle one, as long as the wall time stays within WALL_FACTOR x the budget."""
    cpu_end = time.thread_time() + seconds
    wall_end = time.monotonic() + WALL_FACTOR * seconds
    return lambda: time.thread_time() < cpu_end and time.monotonic() < wall_end


def size(program: Program) -> tuple[int, int, int]:
    """The shortlex key: (steps, parameter atoms, sum of integer magnitudes)."""
    atoms = mag = 0
    for x in program:
        a, m = _atoms(getattr(x, "params", x))
        atoms, mag = atoms + a, mag + m
    return len(program), atoms, mag


def _atoms(v: Any) -> tuple[int, int]:
    if isinstance(v, bool) or v is None or isinstance(v, (str, float)):
        return 1, 0
    if isinstance(v, int):
        return 1, abs(v)
    if isinstance(v, dict):
        v = list(v.values())
    if isinstance(v, (list, tuple)):
        out = [_atoms(y) for y in v]
        return sum(a for a, _ in out), sum(m for _, m in out)
    return 1, 0


def shrink(program: Program, fails: Callable[[Program], Program | None], seconds: float,
           alternatives: Callable[[Program], list[list[Any]]] | None = None,
           related: Callable[[Program], list[list[int]]] | None = None) -> Program:
    """Delete steps while `fails(candidate)` still returns a program (the steps that ran up to
    the failure: it may be shorter than the candidate): with `related` (groups of step indices
    that only make sense together, e.g. one request's steps, which no contiguous chunk holds),
    each whole group first, then chunks (halves, quarters, ... single steps); then, with `alternatives` (per step, the other steps that could stand there), try each
    one-step change and keep it when the failing program it leaves is smaller (`size`), or
    when deleting again gives a shorter program. Returns the smallest failing program found
    within `seconds`. Deterministic but for where the time runs out."""
    left = budget(seconds)
    seen: dict[tuple[str, ...], Program | None] = {}

    def test(cand: Program) -> Program | None:
        """`fails`, once per distinct candidate (passes revisit the same ones often)."""
        if not cand:
            return None
        key = tuple(map(repr, cand))
        if key not in seen:
            got = fails(cand)
            seen[key] = None if got is None else list(got)
        return seen[key]

    def delete(prog: Program, largest: int | None = None) -> Program:
        """Whole related groups, then chunks (at most `largest` steps); again while either
        made the program shorter."""
        while left():
            n = len(prog)
            if related is not None:
                prog = drop_groups(prog)
            prog = chunks(prog, largest)
            if related is None or len(prog) == n:
                break
        return prog

    def chunks(prog: Program, largest: int | None = None) -> Program:
        """Delete chunks of steps: halves, quarters, ... single steps."""
        chunk = max(1, min(len(prog) // 2, largest or len(prog)))
        while chunk >= 1 and left():
            i, changed = 0, False
            while i < len(prog) and left():
                got = test(prog[:i] + prog[i + chunk:])
                if got is not None:
                    prog, changed = list(got), True
                else:
                    i += chunk
            if not changed:
                chunk //= 2
        return prog

    def drop_groups(prog: Program) -> Program:
        """Delete each related group whole, first to last (a request's whole lifecycle goes
        in one candidate, however its steps interleave with others')."""
        assert related is not None
        k = 0
        while left():
            groups = [sorted(set(g)) for g in related(prog) if 0 < len(set(g)) < len(prog)]
            if k >= len(groups):
                break
            drop = set(groups[k])
            got = test([x for i, x in enumerate(prog) if i not in drop])
            if got is not None and len(got) < len(prog):
                prog = list(got)         # the groups are recomputed; k is now the next one
            else:
                k += 1
        return prog

    def substitute(prog: Program) -> Program:
        """One-step changes, position by position: keep one when the failing program it leaves
        is smaller (then try that position again), or when deleting again after it gives a
        shorter program; after a pass that changed anything, delete again and repeat."""
        assert alternatives is not None
        while left():
            changed, alts = False, alternatives(prog)
            i = 0
            while i < len(prog) and left():
                kept = None
                for x in (alts[i] if i < len(alts) else []):
                    if not left():
                        break
                    got = test(prog[:i] + [x] + prog[i + 1:])
                    if got is None:
                        continue
                    if size(got) < size(prog):
                        kept = got
                        break
                    got = delete(list(got), 1)      # (the rest was minimal: single steps and groups)
                    if len(got) < len(prog):
                        kept = got
                        break
                if kept is None:
                    i += 1
                else:
                    prog, changed = list(kept), True
                    alts = alternatives(prog)
                    i = min(i, len(prog) - 1)
            if not changed:
                return prog
            prog = delete(prog)
        return prog

    prog = delete(list(program))
    return substitute(prog) if alternatives is not None else prog


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
