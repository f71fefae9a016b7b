"""One pass of the release's own event loop, as each release writes it.

A step of the scheduler drive is the body of `Scheduler.event_loop_normal` or, with the overlap
scheduler, of `event_loop_overlap` (0.5.23 scheduler.py:2061; 0.5.15 scheduler.py:1572), minus
receiving requests (kvcheck hands them to `handle_generate_request` itself). Releases differ in
how the loop asks for a batch, and the pass follows the installed release's own signatures:

* 0.5.16+: `get_next_batch_to_run(running_batch=, last_batch=)` returns a plan (the batch to run
  and the new running batch); `is_disable_overlap_for_batch(batch, last_batch=)`;
  `launch_batch_sample_if_needed(result, batch)`; `_sched_idled` set when nothing ran;
* 0.5.7-0.5.15: `get_next_batch_to_run()` returns the batch and keeps `running_batch` itself;
  `cur_batch` is set; `is_disable_overlap_for_batch(batch)`; `launch_batch_sample_if_needed(result)`;
  before 0.5.14 the idle hook is `self_check_during_idle` (0.5.7 scheduler.py:1091), and no
  write-after-read barrier is applied after a launch.

`on_batch(batch)` is called for every batch launched (the drive's coverage). Nothing here decides
what SGLang schedules.
"""
from __future__ import annotations

import inspect
from collections import deque
from functools import lru_cache
from typing import Any, Callable


@lru_cache(maxsize=None)
def _takes(fn: Any, name: str) -> bool:
    return name in inspect.signature(inspect.unwrap(fn)).parameters


@lru_cache(maxsize=None)
def _arity(fn: Any) -> int:
    """Parameters besides self."""
    return len(inspect.signature(inspect.unwrap(fn)).parameters) - 1


def _next_batch(s: Any) -> Any:
    get = type(s).get_next_batch_to_run
    if _takes(get, "running_batch"):
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        return plan.batch_to_run
    batch = s.get_next_batch_to_run()
    s.cur_batch = batch
    return batch


def _idled(s: Any) -> None:
    s._sched_idled = True       # read by the next pass (0.5.16+; harmless before)


def _on_idle(s: Any) -> None:
    """The idle hook: `on_idle` (0.5.14+) or `self_check_during_idle` (0.5.7-0.5.13)."""
    hook = getattr(type(s), "on_idle", None) or type(s).self_check_during_idle
    hook(s)


def normal(s: Any, on_batch: Callable[[Any], None]) -> Any:
    """One pass of `event_loop_normal`; the batch it ran (None: idle)."""
    batch = _next_batch(s)
    if batch:
        on_batch(batch)
        s.process_batch_result(batch, s.run_batch(batch))
    else:
        _idled(s)
        _on_idle(s)
    s.last_batch = batch
    return batch


def overlap(s: Any, on_batch: Callable[[Any], None]) -> Any:
    """One pass of `event_loop_overlap`: the batch is launched before the previous one's result is
    processed, unless SGLang says this batch may not overlap (`is_disable_overlap_for_batch`); the
    batch it launched (None: idle)."""
    if s.__dict__.get("result_queue") is None:      # what event_loop_overlap sets up before its loop
        s.enable_skip_finishing_decode = True
        s.result_queue = deque()
    batch = _next_batch(s)
    cls = type(s)
    off = (s.is_disable_overlap_for_batch(batch, last_batch=s.last_batch)
           if _arity(cls.is_disable_overlap_for_batch) >= 2 else s.is_disable_overlap_for_batch(batch))
    if off and s.result_queue:
        _pop_and_process(s)
    result = None
    if batch:
        on_batch(batch)
        result = s.run_batch(batch)
        if hasattr(type(s), "_apply_war_barrier"):      # (where the release has one)
            s._apply_war_barrier()
        s.result_queue.append((batch.copy(), result))
    else:
        _idled(s)
    if s.last_batch:
        if not off and s.result_queue:
            _pop_and_process(s)
    elif batch is None:
        _on_idle(s)
    if _arity(cls.launch_batch_sample_if_needed) >= 2:      # (result, the batch: cur_batch on 0.5.23)
        s.launch_batch_sample_if_needed(result, batch)
    else:
        s.launch_batch_sample_if_needed(result)
    s.last_batch = batch
    return batch


def _pop_and_process(s: Any) -> None:
    b, r = s.result_queue.popleft()
    s.process_batch_result(b, r)
