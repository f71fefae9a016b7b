"""Which drive a vLLM campaign runs, decided once, before its first episode (`plan`).

`--drive auto`, the default, runs vLLM's own v1 Scheduler (the engine drive: engine_sched.py):
the ground truth of what vLLM does is vLLM's code. Where that drive cannot run what was asked it
runs kvcheck's step generator over the release's KV cache manager (the manager drive, `mixed`),
and says why in one line (the result's `drive_reason`). The engine drive does not run:
`--layout generated` (the grammar's layouts), a `--workload` other than random (it draws its own
arrivals), the dense twin (a layout with a retention interval, the fault retention_drops_tail,
twin=True), the Ray shards (cli.py resolves auto there), and a layout whose block sizes the
installed release derives otherwise (sched_build.build raises CannotExpress: probed by building
the scheduler once, in the pre-flight). Only auto falls back: `--drive engine` asked explicitly
keeps its errors (exit 2; a JSON `cannot_express`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvcheck.fuzz.boundary import CannotExpress, setting_up

from . import engine_gen
from . import generator as gen_layouts
from .build import make_adapter
from .layouts import (GENERATED, LAYOUTS, RETENTION_DROPS_TAIL, ENGINE_FAULTS, VllmUnavailable,
                      vllm_version)
from .sched import POLICIES
from .twin import wants_twin
from .workloads import WORKLOADS

AUTO = "auto"
DRIVES = (AUTO, "mixed", "single", "scheduler", "engine")
ENGINE_WHY = "auto: vLLM's own scheduler"
GENERATED_WHY = ("auto: --layout generated runs the dense twin where a sampled layout retains sparsely (the "
                 "manager drive's oracle); --drive engine runs the sampled layouts through vLLM's own scheduler")
TWIN_WHY = "auto: the dense twin runs on the manager drive only"
RAY_WHY = "auto: the Ray shards run the manager drive only"
ENGINE_FAULT_NAMES = {f.name for f in ENGINE_FAULTS}


def engine_fault_why(fault: str) -> str:
    return f"auto: vLLM's own scheduler (fault {fault} is planted in what only that drive runs)"


def workload_why(workload: str) -> str:
    return f"auto: --workload {workload} is not on the engine drive (it draws its own arrivals)"


def cannot_express_why(layout: str, e: Exception) -> str:
    return f"auto: vLLM's own scheduler cannot express {layout!r} on this release ({e})"


def explicit_why(drive: str) -> str:
    return f"--drive {drive} given"


@dataclass(frozen=True)
class Plan:
    """A campaign's drive, resolved (never auto), and what follows from it."""

    drive: str                   # engine | mixed | single | scheduler
    reason: str                  # one line: why this drive
    first: str                   # the first episode's layout (--layout generated: sampled)
    twin: bool                   # the dense twin beside the manager (the first episode's)
    twin_arg: bool | None        # as asked (None: where the layout retains sparsely); engine: False
    sched_policy: str | None     # None: drawn per episode (the engine drive only)

    @property
    def engine(self) -> bool:
        return self.drive == "engine"


def static_choice(layout: str, fault: str | None, twin: bool | None, workload: str) -> tuple[str, str]:
    """What auto resolves to before anything is built: (drive, reason)."""
    if layout == GENERATED:
        return "mixed", GENERATED_WHY
    if workload != "random":
        return "mixed", workload_why(workload)
    if fault in ENGINE_FAULT_NAMES and not twin:
        return "engine", engine_fault_why(fault)
    if twin or (twin is None and wants_twin(layout, fault)):
        return "mixed", TWIN_WHY
    return "engine", ENGINE_WHY


def _twin(first: str, fault: str | None, twin_arg: bool | None, engine: bool) -> bool:
    """Whether the dense twin runs (twin.py), with the drive's and the faults' refusals."""
    twin = wants_twin(first, fault) if twin_arg is None else twin_arg
    if engine and twin:
        if twin_arg or fault == RETENTION_DROPS_TAIL.name:
            raise ValueError("the dense twin runs on the manager drive only (drop --drive engine)")
        twin = False
    if fault in ENGINE_FAULT_NAMES and not engine:
        raise ValueError(f"fault {fault!r} is planted in what only vLLM's own scheduler drive runs: "
                         "run with --drive engine")
    if fault == RETENTION_DROPS_TAIL.name and not twin:
        raise ValueError("fault 'retention_drops_tail' is caught by the dense twin only: run with the twin on")
    return twin


def plan(layout: str, fault: str | None, twin: bool | None, workload: str, drive: str,
         sched_policy: str | None, seed: int) -> Plan:
    """Check the campaign's arguments (ValueError: one line, exit 2), resolve `drive`, and build
    the first episode's adapter once (the pre-flight: the layout, the fault, the release; under
    auto the engine drive's probe). `sched_policy` None: drawn per episode on the engine drive,
    FCFS on the others."""
    if drive not in DRIVES:
        raise ValueError(f"unknown drive {drive!r}; known: {', '.join(DRIVES)}")
    if sched_policy is not None and sched_policy not in POLICIES:
        raise ValueError(f"unknown scheduling policy {sched_policy!r}; known: {', '.join(POLICIES)}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown vLLM layout {layout!r}; known: {', '.join(LAYOUTS)}")
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    auto = drive == AUTO
    drive, reason = static_choice(layout, fault, twin, workload) if auto else (drive, explicit_why(drive))
    if drive == "engine" and workload != "random":
        raise ValueError("--workload: the engine drive draws its own arrivals (fresh prompts, resends, "
                         "multi-turn continuations): drop --workload")
    first = gen_layouts.sample_layout(seed, fault, drive == "engine") if layout == GENERATED else layout
    with setting_up("vllm", vllm_version, ("vllm",), (VllmUnavailable, ValueError)):
        if drive == "engine":
            on = _twin(first, fault, twin, True)
            try:                  # builds vLLM's Scheduler (sched_build.build) as an episode will
                make_adapter(first, 24, fault, False, False,
                             engine_gen.draw_knobs(random.Random(seed), first, sched_policy))
            except CannotExpress as e:
                if not auto:
                    raise
                drive, reason = "mixed", cannot_express_why(first, e)
            else:
                return Plan(drive, reason, first, on, False, sched_policy)
        on = _twin(first, fault, twin, False)
        make_adapter(first, 24, fault, False, on, "fcfs")    # validate layout/fault early (and import vLLM)
    return Plan(drive, reason, first, on, twin, sched_policy or "fcfs")
