"""A vLLM campaign trace as a workload of the cross-release differential (`VllmEngine.trace_workload`).

Both kinds of drive are read (no vLLM import: the trace only):
- the manager drives (`--drive single|mixed|scheduler`, kvcheck schedules): `submit` gives a
  request its prompt, its first `lookup` schedules it (the lookup's `chunk`, the token budget
  kvcheck gave that step, becomes the send's chunk), its `decode` tokens are its output, `finish`
  ends it. `prefill` chunks after the first, `preempt` and the lookup that resumes it,
  `begin_step`/`forward` (several requests in one step), `reset_prefix_cache`, `evict_blocks`,
  lookahead and Mamba-prefix knobs, and cache salts are dropped.
- the engine drive (`--drive engine`: vLLM's own Scheduler decides): the trace does not record
  which requests a `step` scheduled, so every request submitted before a `step` is sent at that
  step, in submission order (FCFS admission; PRIORITY's order and the chunk sizes the scheduler
  chose are dropped: the send computes the whole prompt at once). Its output is the fake model's,
  not in the trace: no output. A request the trace `abort`s is finished there; one the scheduler
  ended by itself (max_tokens, not recorded in the trace) is finished right after its send.
  Drafts (EAGLE/MTP), preemption, `reset_prefix_cache`, `evict_blocks`, salts and priorities are
  dropped.
"""
from __future__ import annotations

from typing import Any

from kvcheck.fuzz.reuse_workloads import FromTrace

ENGINE_DRIVE = frozenset({"step", "abort"})     # actions only the engine drive has


def trace_workload(trace: Any) -> dict[str, Any] | None:
    """The trace's requests as one workload (None: it schedules no request)."""
    steps = trace.steps
    engine = trace.meta.get("drive") == "engine" or any(s.action in ENGINE_DRIVE for s in steps)
    b, auto = FromTrace(), 0
    aborted = {s.params.get("r") for s in steps if s.action == "abort" and isinstance(s.params.get("r"), str)}
    waiting: list[str] = []
    for i, s in enumerate(steps):
        b.step(i, s.action)
        p = s.params
        if s.action == "submit":
            r = p.get("r") or f"r{auto}"            # (old traces: the adapter's own numbering)
            auto += 1
            b.submit(r, p.get("tokens"))
            waiting.append(b.rid(r))
        elif engine and s.action == "step":
            for r in waiting:
                b.schedule(r)
                if r not in aborted:
                    b.finish(r)
            waiting = []
        elif engine and s.action == "abort":
            b.finish(p.get("r"))
        elif not engine and s.action == "lookup":
            b.schedule(p.get("r"), p.get("chunk"))
        elif not engine and s.action == "decode":
            b.output(p.get("r"), p.get("tok"))
        elif not engine and s.action == "finish":
            b.finish(p.get("r"))
    return b.workload(f"vllm-{trace.engine}", trace.seed)
