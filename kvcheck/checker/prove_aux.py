"""The auxiliary invariants of `kvcheck prove`: what makes the named invariants inductive.

Each is proved by the same induction as the named ones (they are part of the hypothesis, and
each is itself an obligation); docs/checker.md says which CTI each one removes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..spec.actions import Ctx
from ..spec.objects import R_BOUND


@dataclass(frozen=True)
class Aux:
    name: str
    doc: str
    conjuncts: Callable[[Ctx], list[tuple[str, Any]]]
    when: Callable[[Any], bool] = lambda cfg: True      # the semantic it is about is on


def aux_for(cfg: Any) -> dict[str, "Aux"]:
    """The auxiliary invariants of a config (those of a configurable semantic where it is on)."""
    return {n: a for n, a in AUX.items() if a.when(cfg)}


def _type_ok(c: Ctx) -> list[tuple[str, Any]]:
    vec, L = c.v.vec, c.L
    out = []
    for key, (lo, hi), x in zip(c.lay.names, c.lay.domains(), vec):
        out.append((".".join(map(str, key[1:])), L.And(lo <= x, x <= hi)))
    return out


def _bound_pins_lease(c: Ctx) -> list[tuple[str, Any]]:
    L, out = c.L, []
    for r in range(c.cfg.requests):
        q = c.v.req(r)
        out.append((f"request {r}", L.Implies(q.rst == R_BOUND,
                                              L.And(q.rpos == q.rk, q.rwin == c.window_step(q.rk)))))
    return out


def _lease_not_ahead(c: Ctx) -> list[tuple[str, Any]]:
    L, v, out = c.L, c.v, []
    for r in range(c.cfg.requests):
        q = v.req(r)
        out.append((f"request {r}", L.And(q.rver <= v.cur_ver, q.rix <= v.cur_ix,
                                          q.rabi <= v.cur_abi, q.rcmp <= v.cur_cmp)))
    return out


def _hash_names_content(c: Ctx) -> list[tuple[str, Any]]:
    v = c.v
    return [(f"block {j}", v.disk(j).bkey == v.disk(j).bcid) for j in range(c.cfg.blocks)]


def _blocks_whole(c: Ctx) -> list[tuple[str, Any]]:
    return [(f"block {j}", c.v.disk(j).bpart == 0) for j in range(c.cfg.blocks)]


AUX: dict[str, Aux] = {a.name: a for a in (
    Aux("type_ok", "TypeOK: every slot stays in its declared range (Layout.domains). Assumed by "
        "every induction step, so it must be proved too.", _type_ok),
    Aux("bound_pins_lease", "A bound request is positioned at its lease and pins exactly what a "
        "resume there reads: rpos == rk and rwin == window_step(rk) (every group's window "
        "retained from its own start at rk). Without it a CTI has a bound "
        "request whose needed pages have ref 0, so `evict` may take them.", _bound_pins_lease),
    Aux("lease_not_ahead", "A lease never records a version newer than the current one "
        "(rver <= cur_ver, rix <= cur_ix, rabi <= cur_abi, rcmp <= cur_cmp). Without it a CTI "
        "has a stale lease from 'the future' that a version bump makes current again.",
        _lease_not_ahead),
    Aux("hash_names_content", "prompts > 1: a block's published hash names the content it holds "
        "(bkey == bcid). Without it a CTI binds a hit whose hashes match but whose slots hold "
        "another prompt's blocks.", _hash_names_content, lambda cfg: cfg.prompts > 1),
    Aux("blocks_whole", "decode = true: no block's objects were written from a partial block "
        "(bpart == 0: decode writes a block when it fills). Without it a CTI binds a hit on a "
        "block marked partial that no reachable state has.", _blocks_whole, lambda cfg: cfg.decode),
)}
