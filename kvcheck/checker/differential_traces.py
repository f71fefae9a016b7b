"""`kvcheck matrix --differential --traces PATH`: the workloads to replay, read and checked.

PATH is a file or a directory (every *.json in it, sorted by name). A file is a JSON list of
workloads (fuzz/reuse_workloads.py), a saved difference (`differences/NAME.json`), or a kvcheck
campaign trace (spec/trace.py: `kvcheck fuzz --sut ENGINE` findings, the gate's corpus), which
its engine turns into one workload named after the file (`Engine.trace_workload`; the core only
calls it). Anything else (unreadable, not JSON, malformed, a trace of another engine, one with no
request) is bad input: one line naming the file, exit 2. Workload names are made unique (the
records are keyed by them): a repeated name gets -2, -3, ...
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..fuzz.reuse_workloads import check_workloads
from ..spec.trace import FORMAT, Trace, TraceError
from .common import UsageError


def read_traces(arg: str, eng: Any) -> list[dict[str, Any]]:
    """Every workload under `arg` (a file or a directory of *.json), checked; UsageError if bad."""
    path = Path(arg)
    try:
        if path.is_dir():
            files = sorted(p for p in path.glob("*.json") if p.is_file())
            if not files:
                raise UsageError(f"--traces {arg}: no *.json file in this directory")
        elif path.exists():
            files = [path]
        else:
            raise UsageError(f"--traces {arg}: no such file or directory")
    except OSError as e:
        raise UsageError(f"--traces {arg}: cannot read it ({e.strerror or type(e).__name__})") from None
    out: list[dict[str, Any]] = []
    for f in files:
        out += _workloads(f, eng)
    return _unique(out)


def _workloads(f: Path, eng: Any) -> list[dict[str, Any]]:
    where = f"--traces {f}"
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{where}: cannot read it ({getattr(e, 'strerror', None) or type(e).__name__})") from None
    except ValueError as e:
        raise UsageError(f"{where}: not JSON ({' '.join(str(e).split())[:80]})") from None
    try:
        if isinstance(data, dict) and "format" in data:      # a campaign trace
            return check_workloads([_from_trace(data, f, eng)], where)
        return check_workloads(data, where)
    except (TraceError, ValueError) as e:
        raise UsageError(" ".join(f"{where}: {e}".split())) from None


def _from_trace(data: dict[str, Any], f: Path, eng: Any) -> dict[str, Any]:
    """The trace's requests as one workload, converted by its engine (`Engine.trace_workload`)."""
    if data.get("format") != FORMAT:
        raise ValueError(f"not a workload list nor a kvcheck trace (format {str(data.get('format'))[:40]!r}, "
                         f"expected {FORMAT!r})")
    trace = Trace.from_dict(data)
    if trace.sut != eng.name:
        raise ValueError(f"a trace of {trace.sut!r}, not of {eng.name} (its requests replay on its own engine: "
                         f"--sut {trace.sut})")
    if not eng.has_trace_workload():
        raise ValueError(f"engine {eng.name}'s traces cannot be replayed as a workload (no trace_workload)")
    w = eng.trace_workload(trace)
    if w is None:
        raise ValueError(f"this {eng.name} trace schedules no request: nothing to replay")
    return dict(w, name=f.stem, source=str(f))


def _unique(ws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: set[str] = set()
    out = []
    for w in ws:
        name = w["name"]
        if name in seen:
            name = next(f"{w['name']}-{n}" for n in range(2, 10**6) if f"{w['name']}-{n}" not in seen)
            w = dict(w, name=name)
        seen.add(name)
        out.append(w)
    return out
