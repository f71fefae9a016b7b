"""A finding's trace as a step-by-step timeline, for people to read.

Owns the replay of a trace on the spec for display: per step the action, what a lookup decided
and why it degraded, the invariants that broke, and the object states after the step. The
engines store only the steps; everything else comes from running them on the spec here, so a
report of any engine (and any past run) gets the same timeline.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..spec import faults as specfaults
from ..spec.config import Config
from ..spec.state import REQ_FIELDS
from ..spec.system import Spec, spec_for
from ..spec.trace import OWN_ACTIONS, Step, Trace

_LABEL = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\((.*)\))?$")


@dataclass
class Row:
    """One step: what happened, and the state it left (as the spec computes it)."""

    n: int
    action: str
    enabled: bool = True
    decision: dict[str, Any] | None = None       # {"kind", "k", "logical", "reasons"} for lookups
    violations: list[str] = field(default_factory=list)
    where: list[str] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)   # "slot: old -> new"
    objects: list[tuple[str, str, int]] = field(default_factory=list)   # (object, state, ref) not free
    requests: list[tuple[str, str]] = field(default_factory=list)       # (request, state) not idle
    disk: list[tuple[str, str]] = field(default_factory=list)           # (block, copy state) not none


@dataclass
class Timeline:
    rows: list[Row]
    note: str = ""          # why the states are missing or come from the clean spec
    replayed: bool = True   # False: the steps are shown as recorded, without states


def parse_label(label: str) -> tuple[str, dict[str, Any]]:
    """`lookup(r=0)` -> ("lookup", {"r": 0}): the inverse of Step.label for spec actions."""
    m = _LABEL.match(label.strip())
    if m is None:
        raise ValueError(f"not an action label: {label!r}")
    params: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in (m.group(2) or "").split(","))):
        k, sep, v = part.partition("=")
        if not sep:
            raise ValueError(f"not an action label: {label!r}")
        params[k.strip()] = int(v) if re.fullmatch(r"-?\d+", v.strip()) else v.strip()
    return m.group(1), params


def from_labels(labels: list[str], cfg: Config, fault: str | None) -> Trace | None:
    """A trace rebuilt from step labels (the trace file is gone); None if they do not parse."""
    try:
        steps = [Step(*parse_label(s)) for s in labels]
    except ValueError:
        return None
    return Trace(cfg, steps, fault)


def _spec(trace: Trace) -> tuple[Spec, str]:
    """The spec with the trace's fault planted when it is a spec fault; the clean spec for a
    system-under-test fault (then the timeline shows what should have happened)."""
    fault = trace.fault
    if fault is not None:
        try:
            return spec_for(trace.config, fault), ""
        except (specfaults.UnknownFault, specfaults.FaultError):
            pass
    note = ""
    sut_fault = (trace.meta or {}).get("sut_fault") or (fault if fault else None)
    if sut_fault or trace.sut != "spec":
        note = (f"states are the spec's (what {trace.sut} should have done"
                + (f"; fault {sut_fault} is planted in {trace.sut}, not in the spec" if sut_fault else "")
                + ")")
    return spec_for(trace.config, None), note


def _named(key: str) -> str:
    """`1.tail.0.st` -> `g1 tail b0`."""
    g, kind, j, _ = key.split(".")
    return f"g{g} {kind} b{j}"


def _snapshot(desc: dict[str, Any]) -> tuple[list[tuple[str, str, int]], list[tuple[str, str]], list[tuple[str, str]]]:
    objs, reqs, disk = [], [], []
    for key, val in desc.items():
        parts = key.split(".")
        if len(parts) == 4 and parts[3] == "st" and val != "free":
            objs.append((_named(key), str(val), int(desc[key[:-2] + "ref"])))
        elif len(parts) == 2 and parts[1] == "rst" and val != "idle":
            reqs.append((f"r{parts[0]}", str(val)))
        elif len(parts) == 2 and parts[1] == "dst" and val != "none":
            disk.append((f"b{parts[0]}", str(val)))
    return objs, reqs, disk


def _subject(key: str) -> tuple[str, str]:
    """(what, field): `1.tail.0.ref` -> ("g1 tail b0", "ref"); `0.rst` -> ("r0", "rst")."""
    parts = key.split(".")
    if len(parts) == 4:
        return f"g{parts[0]} {parts[1]} b{parts[2]}", parts[3]
    if len(parts) == 2:
        return (f"r{parts[0]}" if parts[1] in REQ_FIELDS else f"b{parts[0]} copy"), parts[1]
    return "globals", key


def _changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What a step changed, one line per object: `g1 tail b0: st free \u2192 ready, ref 0 \u2192 1`."""
    by: dict[str, list[str]] = {}
    for k, v in after.items():
        if before.get(k) != v:
            what, f = _subject(k)
            by.setdefault(what, []).append(f"{f} {before.get(k)} \u2192 {v}")
    return [f"{what}: {', '.join(parts)}" for what, parts in by.items()]


def build(trace: Trace, limit: int = 200) -> Timeline:
    """Replay `trace` on the spec, step by step (at most `limit` steps: shrunk traces are short)."""
    if trace.sut in OWN_ACTIONS:
        return Timeline([Row(n, s.label()) for n, s in enumerate(trace.steps[:limit])],
                        f"{trace.sut} traces name the adapter's own actions: replay them with the "
                        "command below to see the states", replayed=False)
    spec, note = _spec(trace)
    lay = spec.lay
    s = spec.init()
    prev = lay.describe(s)
    rows: list[Row] = []
    for n, step in enumerate(trace.steps[:limit]):
        row = Row(n, step.label())
        try:
            inst = spec.instance(step.action, step.params)
        except KeyError:
            row.enabled = False
            rows.append(row)
            return Timeline(rows, f"step {n} is not an action of this config: replay stopped there")
        if not inst.guard(s):
            row.enabled = False          # refused: the state does not change (as replay probes it)
        else:
            if step.action == "lookup":
                row.decision = spec.decide(s, step.params["r"])
            s = inst.effect(s)
            bad = spec.check(s)
            row.violations = sorted({inv for inv, _ in bad})
            row.where = [f"{inv}: {w}" for inv, w in bad][:12]
        desc = lay.describe(s)
        row.changes = _changes(prev, desc)
        row.objects, row.requests, row.disk = _snapshot(desc)
        prev = desc
        rows.append(row)
    if len(trace.steps) > limit:
        note = (note + "; " if note else "") + f"first {limit} of {len(trace.steps)} steps shown"
    return Timeline(rows, note)
