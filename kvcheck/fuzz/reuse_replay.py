"""Replaying the cross-release differential's workloads (reuse_workloads.py) on an engine's
adapter, written once for every engine's `replay_reuse` (engines/*/reuse_replay.py).

A workload runs step by step on one fresh adapter: a finish is the adapter's `finish` (a broken
check on it goes on the last record), a send gets one record, which the engine's `send` fills
(its lookup, hit, usable hit, the rest of the prompt, the output). Every action goes through
`Acts`: the adapter's `apply`, None where the engine refused it (a shrunk workload's step may not
apply), and its `extra_checks`: a broken check is written on the record with the known defect
of the release behind it, and the workload's replay ends there (the cache's state is then
undefined, so nothing after it is compared).
"""
from __future__ import annotations

from typing import Any, Callable

from ..spec.sut import ActionRejected

Broken = tuple[str, str, str]          # (kind, check, message), as extra_checks returns it


class Stop(Exception):
    """A step broke one of the adapter's checks: this workload's replay ends there."""


def new_record(w: dict[str, Any], step: int, r: str, tokens: list[int]) -> dict[str, Any]:
    """A lookup's record before its lookup ran (refused until the engine says otherwise)."""
    return {"trace": w["name"], "step": step, "request": r, "prompt_tokens": len(tokens), "hit": 0,
            "usable": None, "decision": "refused", "served": None, "violation": None}


class Acts:
    """One workload's actions on `ad`. `known(broken, action, params)`: the release's known defect
    behind a broken check (None: none); `on_broken(rec, action)`: the engine fills the lookup's
    fields that a broken check left unset."""

    def __init__(self, ad: Any, known: Callable[[Broken, str, dict[str, Any]], str | None],
                 on_broken: Callable[[dict[str, Any], str], None] | None = None) -> None:
        self.ad, self.known, self.on_broken = ad, known, on_broken

    def __call__(self, action: str, params: dict[str, Any], rec: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            obs = self.ad.apply(action, params)
        except ActionRejected:
            return None
        broken = self.ad.extra_checks(action, params)
        if broken is not None:
            if rec is not None:
                rec["violation"] = {"kind": broken[0], "check": broken[1], "message": broken[2][:300],
                                    "known": self.known(broken, action, params)}
                if self.on_broken is not None:
                    self.on_broken(rec, action)
            raise Stop
        return obs


def replay(w: dict[str, Any], act: Acts, send: Callable[[dict[str, Any], dict[str, Any]], None]) -> list[dict[str, Any]]:
    """The workload's records: `send(rec, step)` runs a send step and fills its record."""
    records: list[dict[str, Any]] = []
    try:
        for i, st in enumerate(w["steps"]):
            if st["op"] == "finish":
                act("finish", {"r": st["r"]}, records[-1] if records else None)
                continue
            rec = new_record(w, i, st["r"], list(st["tokens"]))
            records.append(rec)
            if act("submit", {"r": st["r"], "tokens": list(st["tokens"])}, rec) is None:
                rec["decision"] = "rejected"
                continue
            send(rec, st)
    except Stop:
        pass
    return records
