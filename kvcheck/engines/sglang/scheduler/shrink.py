"""Shrinking a scheduler-drive failure: the shared shrinker (fuzz/shrink.py) with the drive's own
one-step alternatives. A failure under SGLang's scheduler usually needs pool pressure, which a
smaller serving configuration gives in fewer steps than the episode took: so `start` may become
the same configuration with half the pool, one running request, chunked prefill off or on at
the smallest chunk; a `submit` may ask for fewer new tokens or a shorter prompt; a request's
whole lifecycle (its submit and abort) goes in one deletion; a run of steps becomes one step of
as many passes."""
from __future__ import annotations

import time
from typing import Any, Callable

from kvcheck.fuzz.lockstep import Finding
from kvcheck.fuzz.models import Act
from kvcheck.fuzz.shrink import shrink_finding


def _starts(p: dict[str, Any], page: int) -> list[dict[str, Any]]:
    c = dict(p["config"])
    out = []
    if c.get("capacity", 0) // 2 >= 8 * page:
        out.append(dict(c, capacity=c["capacity"] // 2 // page * page))
    if c.get("max_running_requests", 1) > 1:
        out.append(dict(c, max_running_requests=1))
    out.append(dict(c, chunked_prefill_size=-1 if c.get("chunked_prefill_size", -1) > 0 else page))
    return [x for x in out if x != c]


def alternatives(page: int) -> Callable[[list[Act]], list[list[Act]]]:
    def alts(program: list[Act]) -> list[list[Act]]:
        out = []
        for x in program:
            a, p = x.action, x.params
            mine: list[Act] = []
            if a == "start":
                mine = [Act("start", {"config": c}) for c in _starts(p, page)]
            elif a == "submit":
                toks, n = list(p["tokens"]), int(p["max_new"])
                if n > 1:
                    mine.append(Act("submit", dict(p, max_new=max(1, n // 2))))
                if len(toks) > 2:
                    mine.append(Act("submit", dict(p, tokens=toks[:len(toks) // 2])))
            out.append(mine)
        return out
    return alts


def requests(program: list[Act]) -> list[list[int]]:
    """Per request, the indices of its steps (submit, abort)."""
    by: dict[str, list[int]] = {}
    for i, x in enumerate(program):
        r = x.params.get("r")
        if r is not None:
            by.setdefault(r, []).append(i)
    return list(by.values())


def shrink_sched(viol: Finding, run: Callable[[list[Act]], Finding | None], page: int, seconds: float) -> Finding:
    """The smallest program that fails with the same checks, within `seconds` of CPU time."""
    t0 = time.thread_time()

    def same(g: Finding) -> bool:
        return g.checks == viol.checks
    small = shrink_finding(viol, run, same, seconds * 0.7, alternatives(page), requests)
    small = _fuse_steps(small, run, same)
    rest = max(0.0, seconds - (time.thread_time() - t0))
    again = shrink_finding(small, run, same, rest, None, requests)      # deletions only, to the fixpoint
    return again if len(again.program) < len(small.program) else small


def _fuse_steps(f: Finding, run: Callable[[list[Act]], Finding | None], same: Callable[[Finding], bool]) -> Finding:
    """Each run of consecutive steps as one step of that many passes (the first one's samples),
    where the program still fails the same way: a pool filled by decoding is one step."""
    best = f
    i = 0
    while i < len(best.program):
        prog = best.program
        j = i
        while j < len(prog) and prog[j].action == "step":
            j += 1
        if j - i > 1:
            times = sum(int(x.params.get("times", 1)) for x in prog[i:j])
            cand = prog[:i] + [Act("step", {"toks": list(prog[i].params["toks"]), "times": times})] + prog[j:]
            g = run(cand)
            if g is not None and same(g):
                best = g
        i += 1
    return best
