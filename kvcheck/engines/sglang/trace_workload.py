"""An SGLang campaign trace as a workload of the cross-release differential
(`SglangEngine.trace_workload`; no SGLang import: the trace only).

`submit` gives a request its prompt; its first `match` (the whole prompt at once) or `chunk`
(the scheduler path: its `n`, the first chunk's tokens, becomes the send's chunk) schedules it;
its `decode` tokens are its output; `finish` or `abort` ends it. Dropped: chunks after the first
(the send repeats the first one's size), `evict` (eviction under pressure: the differential's
pool holds six requests of the longest length), and requests that were never scheduled.
"""
from __future__ import annotations

from typing import Any

from kvcheck.fuzz.reuse_workloads import FromTrace


def trace_workload(trace: Any) -> dict[str, Any] | None:
    """The trace's requests as one workload (None: it schedules no request)."""
    b = FromTrace()
    for i, s in enumerate(trace.steps):
        b.step(i, s.action)
        p = s.params
        if s.action == "submit":
            b.submit(p.get("r"), p.get("tokens"))
        elif s.action == "match":
            b.schedule(p.get("r"))
        elif s.action == "chunk":
            b.schedule(p.get("r"), p.get("n"))
        elif s.action == "decode":
            b.output(p.get("r"), p.get("tok"))
        elif s.action in ("finish", "abort"):
            b.finish(p.get("r"))
    return b.workload(f"sglang-{trace.engine}", trace.seed)
