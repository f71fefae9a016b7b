"""Compound steps and the adapter side of shrinking: fewer, larger steps for a shrunk trace.

The generator draws SGLang's scheduler one call at a time (submit, match, one decoded token,
...). A failure usually needs a request to arrive and be matched, and the pool to fill by
decoding; one step per call makes a shrunk trace long though nothing in it is redundant. Two
compound forms say the same in fewer steps, and the adapter runs them as their parts (every
check after each part, so what is caught and where does not change):

  match(r, tokens=[...])   = submit(r, tokens); match(r)     (a request's arrival and match)
  decode(r, toks=[...])    = decode(r, tok) for each tok      (a burst of decoded tokens)

`fuse` rewrites a program into them; `alternatives` offers one-step changes (a longer or
shorter burst, a larger eviction, an eviction in place of a step) to the shared shrinker.
"""
from __future__ import annotations

from typing import Any

from ..models import Act
from .sglang_layouts import MAX_TOKENS


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
    def alts(program: list[Act]) -> list[list[Act]]:
        out = []
        prompts: list[list[int]] = []          # the earlier arrivals' prompts, first seen first
        for x in program:
            a, p, mine = x.action, x.params, []
            if a == "match" and "tokens" in p:
                t = list(p["tokens"])
                # a next turn of an earlier request (its prompt, then this one's last token): the
                # match then ends on that request's node, which a shorter program may need
                mine += [Act("match", {"r": p["r"], "tokens": q + t[-1:]}) for q in prompts
                         if q + t[-1:] != t and len(q) + 1 < MAX_TOKENS]
                prompts.append(t)
            if a == "decode":
                t = _toks(p)
                mine += [Act("decode", {"r": p["r"], "toks": t * 2}), Act("decode", {"r": p["r"], "toks": t[:len(t) // 2]})]
            elif a == "evict":
                mine.append(Act("evict", {"n": capacity}))
            if a != "evict":
                mine.append(Act("evict", {"n": capacity}))
            out.append([m for m in mine if m.params.get("toks", [0])])
        return out
    return alts
