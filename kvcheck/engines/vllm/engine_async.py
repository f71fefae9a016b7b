"""Async scheduling on the scheduler drive: vLLM's ``AsyncScheduler`` under its engine core's
batch queue (``EngineCore.step_with_batch_queue``, two batches deep).

There the scheduler plans step N+1 while step N's forward is still running: the requests of N
carry output placeholders (``num_output_placeholders``; AsyncScheduler._update_after_schedule),
N+1 computes the KV of tokens N has not reported yet (the GPU feeds each sampled token straight
into the next forward), and ``update_from_output`` for N runs after ``schedule()`` for N+1. A
kvcheck step here is one call of the batch queue: ``schedule()`` (N+1), then N's model output
(built when N's forward ran) through ``update_from_output``, then N+1's forward on the timeline
(the tokens it writes are known by then: same bytes as the GPU's, in the GPU's order) and its
output kept for the next step. A request finished or aborted by N's output still runs in N+1's
forward (vLLM discards that output); kvcheck skips its writes there (they land past its tokens,
in blocks freed at N's output and reallocated only by a later schedule, so overwritten later).

Opt-in (knob ``async_sched``, env ASYNC_ENV=1: recorded in traces and in the rerun command), on
layouts without a drafter and without the KV connector (their async paths: not modelled yet).
"""
from __future__ import annotations

import os
from typing import Any

from .layouts import vllm_modules

ASYNC_ENV = "KVCHECK_VLLM_ASYNC_SCHEDULING"


def async_on() -> bool:
    """Do this process's episodes draw async scheduling (ASYNC_ENV=1)?"""
    return os.environ.get(ASYNC_ENV, "") not in ("", "0")


def scheduler_class(knobs: Any) -> Any:
    """The release's scheduler class for `knobs` (AsyncScheduler under async scheduling)."""
    if knobs.async_sched:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        return AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    return Scheduler


def step(ad: Any) -> dict:
    """One call of vLLM's batch queue: schedule N+1, take N's output, run N+1's forward."""
    ad._outermost_lookup_hook()
    tl = ad.timeline
    tl.begin()
    ad.stepped = set()
    earlier = set(getattr(ad.sched, "reset_preempted_req_ids", ()) or ())
    so = ad.sched.schedule()
    ad._sync()
    ad.worker.update(so)
    ad.worker.check(ad, so)
    new = {x.req_id for x in so.scheduled_new_reqs}
    new |= set(getattr(so.scheduled_cached_reqs, "resumed_req_ids", ()) or ())
    spans = {rid: (ad.sched.requests[rid].num_computed_tokens - n, ad.sched.requests[rid].num_computed_tokens)
             for rid, n in so.num_scheduled_tokens.items()}
    gone = set(getattr(so, "preempted_req_ids", ()) or ()) - earlier
    ad.coverage["state:preempted"] += len(gone)
    ad.coverage["state:preempt_scheduled"] += len(gone & ad.stepped)
    ad.coverage["state:multi_request_step"] += len(spans) > 1
    prev, ad.inflight = getattr(ad, "inflight", None), None
    if prev is not None:                       # N's output arrives after N+1 was scheduled
        ad.coverage["state:async_overlap"] += bool(set(prev[0].num_scheduled_tokens) & set(spans))
        ad.sched.update_from_output(*prev)
        ad._sync()
    for rid, (lo, hi) in spans.items():
        if rid in ad.reqs and rid in ad.sched.requests:
            tl.scheduled(rid, lo, hi, None, admitted=rid in new)
    tl.forward()
    ids = list(so.num_scheduled_tokens)
    toks = [ad._sampled(ad.sched.requests[rid], []) if rid in ad.sched.requests else [1] for rid in ids]
    index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if ad._indexed else {}
    ad.inflight = (so, vllm_modules()["ModelRunnerOutput"](req_ids=ids, sampled_token_ids=toks, **index,
                                                           **ad._out_args))
    return {"ran": len(ids)}
