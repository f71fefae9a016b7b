"""Building the vLLM adapter for a layout (with its dense twin where the layout retains sparsely)
and finding a saved trace's layout again: shared by the drivers, known-defect recognition and
the reproducer writer, below all three."""
from __future__ import annotations

from kvcheck.spec.trace import Trace

from .adapter import VllmAdapter
from .layouts import LAYOUTS, register_layout
from .sched_build import SchedKnobs
from .twin import TwinAdapter


def make_adapter(layout: str, num_blocks: int, fault: str | None, strict: bool, twin: bool,
             sched_policy: "str | SchedKnobs" = "fcfs") -> VllmAdapter:
    """The manager drive's adapter; `sched_policy` given as scheduler knobs: vLLM's own Scheduler
    drives (engine_sched.py; it takes its block count from the knobs, and runs no twin yet)."""
    if isinstance(sched_policy, SchedKnobs):
        from .engine_sched import EngineAdapter
        return EngineAdapter(layout, sched_policy, fault, strict)
    ad = (TwinAdapter if twin else VllmAdapter)(layout, num_blocks, fault, strict)
    ad.sched_policy = sched_policy          # (what a preemption may take back: vllm_adapter._a_preempt)
    return ad


def resolve_layout(trace: Trace) -> str:
    """The trace's layout, registered again from its meta when a file or the generator made it."""
    layout = trace.meta.get("layout")
    if isinstance(layout, str) and layout.split(":")[0] in ("file", "gen") and "layout_file" in trace.meta:
        kind, _, where = layout.partition(":")
        layout = register_layout(trace.meta["layout_file"], where, prefix=kind)
    if layout not in LAYOUTS:
        raise ValueError(f"trace has no known vLLM layout in meta.layout (got {layout!r})")
    return layout
