"""The findings a report opens with, each with its trace as a timeline.

Owns collecting findings from a report directory: the gate's `findings` list when it wrote one,
else derived from what each engine writes today (the walk's `violation`, each fuzz campaign's
`findings`, explore's and Z3 BMC's `violation`). Each finding's trace file is read (found next
to the report when the directory moved) and replayed on the spec for its timeline; a trace file
that is not a kvcheck trace is bad input (one line, exit 2), a missing one falls back to the
recorded step labels.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..spec.config import Config, ConfigError
from ..spec.trace import Trace, TraceError
from . import timeline as tl
from .common import UsageError


class ShapeError(UsageError):
    """A report file kvcheck could not have written (exit 2)."""


def obj(x: Any, where: str) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise ShapeError(f"{where} must be a JSON object, got {type(x).__name__}")
    return x


def lst(x: Any, where: str) -> list[Any]:
    if not isinstance(x, list):
        raise ShapeError(f"{where} must be a list, got {type(x).__name__}")
    return x


def strs(x: Any, where: str) -> list[str]:
    if not isinstance(x, list) or not all(isinstance(s, str) for s in x):
        raise ShapeError(f"{where} must be a list of strings")
    return x


def text(x: Any, where: str) -> str:
    if not isinstance(x, str):
        raise ShapeError(f"{where} must be a string, got {type(x).__name__}")
    return x


@dataclass
class Finding:
    system: str
    engine: str
    kind: str
    check: str
    message: str
    replay: str
    trace_steps: list[str]
    trace: str | None = None                # the trace file as recorded
    config: dict[str, Any] | None = None    # the config it ran on (fallback for a lost trace)
    fault: str | None = None
    timeline: tl.Timeline | None = None


def _opt(v: dict[str, Any], key: str, where: str) -> str | None:
    return None if v.get(key) is None else text(v[key], f"{where}.{key}")


def _given(data: dict[str, Any]) -> list[Finding]:
    """The gate's own list: {system, engine, kind, check, message, replay, trace_steps}."""
    out = []
    for i, f in enumerate(lst(data["findings"], "report.json: findings")):
        w = f"report.json: findings[{i}]"
        f = obj(f, w)
        out.append(Finding(*(text(f.get(k, ""), f"{w}.{k}") for k in
                             ("system", "engine", "kind", "check", "message", "replay")),
                           strs(f.get("trace_steps", []), f"{w}.trace_steps"), _opt(f, "trace", w),
                           data.get("config"), data.get("fault")))
    return out


def _violation(v: Any, where: str, system: str, engine: str, steps_key: str,
               cfg: Any, fault: Any) -> Finding:
    v = obj(v, where)
    invs = strs(v.get("invariants", []), f"{where}.invariants")
    wh = strs(v.get("where", []), f"{where}.where")
    msg = "; ".join(wh[:3]) if wh else f"at {v.get('action', '?')}"
    return Finding(system, engine, "invariant", ", ".join(invs), msg, text(v.get("replay", ""), f"{where}.replay"),
                   strs(v.get(steps_key, []), f"{where}.{steps_key}"), _opt(v, "trace", where), cfg, fault)


def _derived(data: dict[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    rep = data.get("report", {})
    cfg, fault = rep.get("config"), rep.get("fault")
    if rep.get("violation"):
        out.append(_violation(rep["violation"], "report.json: violation", "spec", "walk", "trace_steps", cfg, fault))
    engines = obj(rep.get("engines", {}), "report.json: engines")
    for name, e in engines.items():
        e = obj(e, f"report.json: engines.{name}")
        if not name.startswith("fuzz") or e.get("findings") is None:
            continue
        system = name.split("_", 1)[1] if "_" in name else "spec"
        for i, f in enumerate(lst(e["findings"], f"report.json: engines.{name}.findings")):
            w = f"report.json: engines.{name}.findings[{i}]"
            f = obj(f, w)
            checks = strs(f.get("checks", []), f"{w}.checks")
            out.append(Finding(system, "fuzz", text(f.get("kind", ""), f"{w}.kind"), ", ".join(checks),
                               text(f.get("message", ""), f"{w}.message"), text(f.get("replay", ""), f"{w}.replay"),
                               strs(f.get("trace_steps", []), f"{w}.trace_steps"), _opt(f, "trace", w), cfg, fault))
    for key, label, steps_key in (("explore", "explore", "steps"),):
        src = data.get(key) or engines.get(key) or {}
        if src.get("violation"):
            out.append(_violation(src["violation"], f"{key}.json: violation", "spec", label, steps_key,
                                  src.get("config", cfg), src.get("fault", fault)))
    prove = data.get("prove") or engines.get("prove") or {}
    bmc = obj(prove.get("bmc") or {}, "prove.json: bmc")
    if bmc.get("violation"):
        out.append(_violation(bmc["violation"], "prove.json: bmc.violation", "spec", "prove (Z3 BMC)", "steps",
                              prove.get("config", cfg), prove.get("fault", fault)))
    return out


def trace_path(f: Finding) -> str | None:
    """The trace file: as recorded, else the path in the replay command."""
    if f.trace:
        return f.trace
    try:
        words = shlex.split(f.replay)
    except ValueError:
        return None
    if "replay" in words and words.index("replay") + 1 < len(words):
        return words[words.index("replay") + 1]
    return None


def _point_replay_at(f: Finding, old: str, new: str) -> None:
    """The replay command, for where the trace is now (the report directory was moved)."""
    try:
        words = shlex.split(f.replay)
    except ValueError:
        return
    if old in words:
        f.replay = shlex.join(new if w == old else w for w in words)
    f.trace = new


def load_trace(f: Finding, d: Path) -> tuple[Trace | None, str]:
    """(trace, note): read from where it was written or from the report directory (a report
    copied elsewhere keeps its traces next to it); rebuilt from the labels when neither exists."""
    p = trace_path(f)
    if p:
        for cand in (Path(p), d / Path(p).name):
            if cand.is_file():
                try:
                    tr = Trace.load(cand)
                except TraceError as e:
                    raise UsageError(f"{cand}: {e}") from None
                if str(cand) != p:
                    _point_replay_at(f, p, str(cand))
                    return tr, f"trace found next to the report (written to {p})"
                return tr, ""
    if not f.trace_steps:
        return None, "no trace recorded"
    try:
        cfg = Config.from_dict(obj(f.config or {}, "config"))
    except ConfigError as e:
        raise UsageError(f"report config: {e}") from None
    tr = tl.from_labels(f.trace_steps, cfg, f.fault if isinstance(f.fault, str) else None)
    note = f"trace file {p or '(none)'} not found: replayed from the recorded step labels"
    return tr, note


def collect(data: dict[str, Any], d: Path) -> list[Finding]:
    rep = data.get("report", {})
    found = _given(rep) if rep.get("findings") is not None else _derived(data)
    seen: set[str] = set()
    out = []
    for f in found:
        key = f.replay or f"{f.engine}:{f.check}:{len(out)}"
        if key in seen:
            continue
        seen.add(key)
        trace, note = load_trace(f, d)
        if trace is not None:
            try:
                f.timeline = tl.build(trace)
            except ConfigError as e:      # a config the spec refuses (two windows): as replay says
                raise UsageError(f"{trace_path(f) or 'report.json: config'}: {e}") from None
            if note:
                f.timeline.note = "; ".join(x for x in (note, f.timeline.note) if x)
        elif f.trace_steps:
            f.timeline = tl.Timeline([tl.Row(n, s) for n, s in enumerate(f.trace_steps)], note, replayed=False)
        out.append(f)
    return out
