"""Compound steps and the adapter side of shrinking: fewer, larger steps for a shrunk trace.

The generator draws SGLang's scheduler one call at a time (submit, match, one decoded token,
...). A failure usually needs a request to arrive and be matched, and the pool to fill by
decoding; one step per call makes a shrunk trace long though nothing in it is redundant. Two
compound forms say the same in fewer steps, and the adapter runs them as their parts (every
check after each part, so what is caught and where does not change):

  match(r, tokens=[...])   = submit(r, tokens); match(r)     (a request's arrival and match)
  decode(r, toks=[...])    = decode(r, tok) for each tok      (a burst of decoded tokens)

`fuse` rewrites a program into them; `shrink_steps` shrinks a failing program in that form
with the shared shrinker, deleting a request's whole lifecycle at once (`requests`) and trying
the one-step changes `alternatives` offers: a longer or shorter burst, an eviction of 1, 2, 4,
... tokens in place of any step (standing for the steps whose allocations pushed them out), and
a request that continues an earlier one's prompt (a next turn, ending its match on that
request's node).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from kvcheck.fuzz.lockstep import Finding
from kvcheck.fuzz.models import Act
from kvcheck.fuzz.shrink import shrink_finding
from .layouts import MAX_TOKENS


def expand(action: str, params: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The parts a (possibly compound) step runs as."""
    if action == "match" and "tokens" in params:
        return [("submit", {"r": params["r"], "tokens": params["tokens"]}), ("match", {"r": params["r"]})]
    if action == "decode" and "toks" in params:
        return [("decode", {"r": params["r"], "tok": t}) for t in params["toks"]]
    return [(action, params)]


def fuse(program: list[Act]) -> list[Act]:
    """A request's submit folded into its first match (when nothing else touched it between);
    adjacent decodes of one request made one burst."""
    out: list[Act] = []
    pending: dict[str, int] = {}                # r -> index in out of its unfolded submit
    for x in program:
        a, p = x.action, x.params
        r = p.get("r")
        if a == "submit":
            pending[r] = len(out)
            out.append(x)
            continue
        if a == "match" and r in pending and "tokens" not in p:
            i = pending.pop(r)
            sub = out.pop(i)
            pending.update({k: (v - 1 if v > i else v) for k, v in pending.items()})
            out.append(Act("match", {"r": r, "tokens": list(sub.params["tokens"])}))
            continue
        pending.pop(r, None)                    # abort of a waiting request: keep its submit
        if a == "decode" and out and out[-1].action == "decode" and out[-1].params.get("r") == r:
            prev = out.pop()
            out.append(Act("decode", {"r": r, "toks": _toks(prev.params) + _toks(p)}))
            continue
        out.append(x)
    return out


def _toks(p: dict[str, Any]) -> list[int]:
    return list(p["toks"]) if "toks" in p else [p["tok"]]


def alternatives(capacity: int):
    """Per step of a program, the steps that could stand there instead (for the shrinker)."""
    sizes = sorted({min(capacity, 1 << k) for k in range(capacity.bit_length() + 1)})
    evictions = [Act("evict", {"n": n}) for n in sizes]

    def alts(program: list[Act]) -> list[list[Act]]:
        out = []
        prompts: dict[str, list[int]] = {}     # each request's prompt
        done: list[list[int]] = []             # the prompts of the requests finished so far
        for x in program:
            a, p, mine = x.action, x.params, []
            if a == "match" and "tokens" in p:
                t = list(p["tokens"])
                # a next turn of a finished request this one shares a first token with (its
                # prompt, then this one's last token): the match then ends on that request's node
                mine += [Act("match", {"r": p["r"], "tokens": q + t[-1:]}) for q in done
                         if q[:1] == t[:1] and q + t[-1:] != t and len(q) + 1 < MAX_TOKENS]
                prompts[p["r"]] = t
            if a == "decode":
                t = _toks(p)
                mine += [Act("decode", {"r": p["r"], "toks": t * 2}), Act("decode", {"r": p["r"], "toks": t[:len(t) // 2]})]
            # an eviction of 1, 2, 4, ... tokens up to the whole pool in place of a step that
            # allocates, once something is in the tree (it can stand for the allocations that
            # pushed those tokens out; on FULL+SWA a partial SWA eviction is what tombstones some
            # nodes and not others), or of another size
            if a in ("match", "decode", "evict") and done:
                mine += [e for e in evictions if e != x]
            if a == "finish" and p.get("r") in prompts:
                done.append(prompts[p["r"]])
            out.append([m for m in mine if m.params.get("toks", [0])])
        return out
    return alts


def requests(program: list[Act]) -> list[list[int]]:
    """Per request, the indices of its steps (the shrinker deletes a request's whole lifecycle
    in one candidate: its arrival, decodes, finish or abort, wherever they interleave)."""
    by: dict[str, list[int]] = {}
    for i, x in enumerate(program):
        r = x.params.get("r")
        if isinstance(r, str):
            by.setdefault(r, []).append(i)
    return list(by.values())


def unfuse(program: list[Act]) -> list[Act]:
    """The compound steps back as their parts (each a step of its own)."""
    return [Act(a, p) for x in program for a, p in expand(x.action, x.params)]


def shrink_steps(viol: Finding, run: Callable[[list[Act]], Finding | None], capacity: int,
                 seconds: float) -> Finding:
    """The shared shrinker on the compound form of a failing program (`fuse`: fewer, larger
    steps from the start, so every candidate is cheaper and a request's arrival goes in one
    deletion), with whole request lifecycles (`requests`) and one-step `alternatives`; then
    once more on the parts of what is left (a part a compound step cannot lose alone, such as
    a match the pool refused before the one that admitted the request), fused again. Falls
    back to the generator's own steps when the compound form does not fail the same way.
    `seconds` is CPU time of this thread, as the shrinker counts it."""
    t0 = time.thread_time()

    def same(g: Finding) -> bool:
        return g.checks == viol.checks

    def fused(f: Finding) -> Finding:
        g = run(fuse(f.program))
        return g if g is not None and same(g) and len(g.program) < len(f.program) else f
    g = run(fuse(viol.program))
    start = g if g is not None and same(g) and len(g.program) <= len(viol.program) else viol
    small = fused(shrink_finding(start, run, same, seconds * 0.9, alternatives(capacity), requests))
    parts = run(unfuse(small.program))
    if parts is None or not same(parts):
        return small
    rest = max(0.0, seconds - (time.thread_time() - t0))
    again = fused(shrink_finding(parts, run, same, rest, related=requests))
    return again if len(again.program) < len(small.program) else small
