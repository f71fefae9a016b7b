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
forward (vLLM discards that output); kvcheck does not write it at once but keeps what N+1's
forward writes (``_frame_writes``) and lands it after the next frame's connector loads
(``_land_late``): on the GPU that forward may still be running when those loads (RDMA, not ordered
with the stream) fill a block the scheduler freed at N's output and handed on -- PR #45357's race,
which releases that defer such frees behind the in-flight frame cannot reach.

With an EAGLE/MTP drafter the scheduler holds placeholders only (``spec_token_ids = [-1] * k``;
the engine core never sends the GPU's drafts back under async scheduling, ``EngineCore.post_step``):
N+1's k draft positions are the drafts the GPU proposed after N's accepted tokens (``_gpu_drafts``),
N+1 computes from where N's rejections put it (``_spans``: vLLM takes them back from
``num_computed_tokens`` at N's output, the GPU knows them already), and N+1's accepted drafts are
written once its output is taken, a step later (``Frame.accepted``).

Drawn by default (knob ``async_sched``, recorded in traces), as vLLM enables it by default
(``VllmConfig``: ``async_scheduling=None`` becomes True unless the executor, pipeline parallelism
or a non-EAGLE drafter rules it out; 0.14.1 ``config/vllm.py:588-627``, 0.34.0 ``:1610-1637``), in
half the episodes, a drafter's too, not a drafter's on Mamba groups (the worker's async correction
of its per-draft states: not modelled), with the KV connector too (N+1's sync loads before its
forward, the finished transfers on its output), not with failed sync loads (opt-in; their async
timing: not modelled). ASYNC_ENV=0 turns it off (and the rerun command says so).
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

from . import mamba
from .layouts import cdiv, vllm_modules
from .sampler import draft_tokens, greedy
from .violation import Violation

ASYNC_ENV = "KVCHECK_VLLM_ASYNC_SCHEDULING"


def async_on() -> bool:
    """Do this process's episodes draw async scheduling (the default; ASYNC_ENV=0: no)?"""
    return os.environ.get(ASYNC_ENV, "").strip() != "0"


def scheduler_class(knobs: Any) -> Any:
    """The release's scheduler class for `knobs` (AsyncScheduler under async scheduling)."""
    if knobs.async_sched:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        return AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    return Scheduler


def note_reset(ad: Any) -> None:
    """A forced reset (reset_prefix_cache(reset_running_requests=True)) preempts every running
    request: the outputs of the frames scheduled before it are stale for them, no later one is.
    (The scheduler's own preemptions mark the same: `step`; 0.34 drops their stale outputs when a
    connector needs the KV delivered, `drop_stale_output=self.requires_kv_delivery`.)"""
    for o in ad.sched.running:
        ad.preempted_at[o.request_id] = (ad.frame_no, True)


def discarding(o: object) -> bool:
    """Will vLLM drop this request's next output frame? (0.14-0.21: a flag; 0.22-0.3x: a count;
    0.34: a count of stale tokens it drops or delivers, `drop_stale_output`.)"""
    return bool(getattr(o, "discard_latest_async_tokens", False) or getattr(o, "async_tokens_to_discard", 0)
                or (getattr(o, "drop_stale_output", False) and getattr(o, "num_stale_output_tokens", 0)))


def _check_discards(ad: Any, frame: int, out: Any, before: dict[str, tuple[bool, int]]) -> None:
    """After frame `frame`'s output: a token vLLM dropped is stale only if its frame was scheduled
    before the request's latest preemption; one sampled by a later forward is a real token lost
    (its KV already computed by the forward after it, fed the token on the GPU)."""
    for rid, toks in zip(out.req_ids, out.sampled_token_ids):
        o, (flag, n) = ad.sched.requests.get(rid), before.get(rid, (False, 0))
        if not (flag and len(toks) and o is not None) or len(o.output_token_ids) != n:
            continue
        ad.coverage["state:async_token_discarded"] += 1
        mark, forced = ad.preempted_at.get(rid, (frame, False))
        if frame > mark:
            raise Violation("bookkeeping", "toctou_bound_stable",
                            f"vLLM dropped {rid}'s token at position {o.num_tokens}, sampled by a forward "
                            f"scheduled after its {'forced ' if forced else ''}preemption (the discard of a stale "
                            "output outlived the frames in flight): the KV the next forward computed from it is "
                            "of a token the request no longer has")


def _check_stale_untouched(ad: Any, stale: dict[str, int], frame: int) -> None:
    """The output of a frame scheduled before a request's latest preemption describes a forward of
    its previous incarnation: it must not move the request's count of computed tokens (the forward
    in flight for the resumed request computes what its SchedulerOutput said). vLLM 0.14-0.24 took
    such a frame's rejected drafts back from the resumed count (PR #46066)."""
    for rid, before in stale.items():
        o = ad.sched.requests.get(rid)
        if o is not None and not o.is_finished() and o.num_computed_tokens != before:
            raise Violation("bookkeeping", "toctou_bound_stable",
                            f"vLLM applied the output of frame {frame}, scheduled before {rid}'s preemption, to its "
                            f"resumed state: num_computed_tokens {before} -> {o.num_computed_tokens} (that frame's "
                            f"rejected drafts; output placeholders now {getattr(o, 'num_output_placeholders', 0)}), "
                            "while the forwards in flight compute from the resumed count")


def _frame_writes(ad: Any, spans: dict[str, tuple[int, int]]) -> dict[int, tuple[str, tuple, int, int]]:
    """What the forward of the frame just scheduled writes, block by block (the worker's tables:
    a request its predecessor's output finishes keeps its row until the next SchedulerOutput):
    {block id: (request, the prefix its bytes hold after the write, group, block index)}. Attention
    blocks only."""
    out: dict[int, tuple[str, tuple, int, int]] = {}
    null = ad.pool.null_block.block_id
    for rid, (lo, hi) in spans.items():
        req, rows = ad.reqs.get(rid), ad.worker.tables.get(rid)
        if req is None or rows is None or hi <= lo:
            continue
        for g, (kind, bs, _) in enumerate(ad.groups):
            if kind == mamba.MAMBA or g >= len(rows):
                continue
            for i in range(lo // bs, min(len(rows[g]), cdiv(hi, bs))):
                if rows[g][i] != null:
                    out[rows[g][i]] = (rid, ad._content(req, min((i + 1) * bs, hi)), g, i)
    return out


def _land_late(ad: Any) -> None:
    """The previous frame's forward is still running when this frame's KV connector loads start
    (an RDMA write, not ordered with the GPU stream), so its writes may land after them. A block
    it writes that the scheduler has since handed to another request -- freed at that frame's
    predecessor's output while the frame was in flight, then reallocated -- gets the old
    request's bytes over what the load put there (PR #45357's race; releases that defer such
    frees behind the in-flight frame never hand the block on). Where the new owner's own forward
    writes the block from its start, stream order overwrites it again (no harm)."""
    pending, ad.in_flight_writes = getattr(ad, "in_flight_writes", None) or {}, {}
    if not pending:
        return
    tl, owner = ad.timeline, {}
    for rid, rows in ad.worker.tables.items():
        for row in rows:
            for b in row:
                owner[b] = rid
    for bid, (rid, value, g, i) in pending.items():
        now = owner.get(bid)
        if now is not None and now != rid and not tl.holds(bid, value):
            ad.coverage["state:async_late_write"] += 1
            tl.ready[bid] = value
            tl.late[bid] = (rid, now, _how_freed(ad, rid, g, i))


def _how_freed(ad: Any, rid: str, g: int, i: int) -> str:
    """How vLLM let go of block i of group g that `rid`'s in-flight forward still writes (for the
    finding's cause): the request finished or was preempted (PR #45357's race), or it still holds
    the position nulled: the block left its sliding window at a schedule that counted the in-flight
    tokens as computed (PR #47728's)."""
    o = ad.sched.requests.get(rid)
    if o is None or o.is_finished():
        return f"freed {rid}'s blocks when it finished"
    from .bookkeeping import WINDOWED
    table, kind = ad._table(g, rid), ad.groups[g][0]
    if kind in WINDOWED and i < len(table) and table[i].is_null:
        return (f"freed this block of {rid}'s as out of its {WINDOWED[kind]} at a schedule that counted that "
                "forward's tokens as computed")
    return f"freed {rid}'s blocks when it was preempted (by the scheduler or a forced reset)"


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
    if ad.store is not None:                   # the connector's synchronous loads, before N+1's forward
        ad.store.before_forward(so)
    _land_late(ad)                             # N's forward, still running, lands after those loads
    new = {x.req_id for x in so.scheduled_new_reqs}
    new |= set(getattr(so.scheduled_cached_reqs, "resumed_req_ids", ()) or ())
    spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}      # (placeholders: the GPU's drafts)
    opt = {rid: ad.sched.requests[rid].num_computed_tokens for rid in so.num_scheduled_tokens}
    gone = set(getattr(so, "preempted_req_ids", ()) or ()) - earlier
    ad.coverage["state:preempted"] += len(gone)
    ad.coverage["state:preempt_scheduled"] += len(gone & ad.stepped)
    for rid in gone:                           # (the frames scheduled before this one are stale for them)
        ad.preempted_at[rid] = (ad.frame_no, False)
    ad.coverage["state:multi_request_step"] += len(opt) > 1
    prev, ad.inflight = ad.inflight, None
    ad.frame_no += 1
    if prev is not None:                       # N's output arrives after N+1 was scheduled
        ad.coverage["state:async_overlap"] += bool(set(prev.so.num_scheduled_tokens) & set(opt))
        before = {rid: (discarding(o), len(o.output_token_ids)) for rid in prev.out.req_ids
                  if (o := ad.sched.requests.get(rid)) is not None}
        ad.accepted, ad.settling = dict(prev.accepted), {}
        stale = {rid: o.num_computed_tokens for rid in prev.out.req_ids if (o := ad.sched.requests.get(rid))
                 is not None and prev.frame <= ad.preempted_at.get(rid, (-1, False))[0]}
        ad.sched.update_from_output(prev.so, prev.out)
        _check_stale_untouched(ad, stale, prev.frame)
        if ad.store is not None:
            ad.store.delivered()
        for rid in list(ad.accepted):          # (N's accepted drafts: written by N's forward)
            ad._accept(rid)
        ad._sync()
        _check_discards(ad, prev.frame, prev.out, before)
    spans = _spans(so, opt, new, prev.rejected if prev is not None else {})
    drafts: dict[str, list[int]] = {}
    for rid, (lo, hi) in spans.items():
        d, o = len(spec.get(rid, ())), ad.sched.requests.get(rid)
        drafts[rid] = _gpu_drafts(o, d)
        ad.coverage["state:async_drafts_proposed"] += len(drafts[rid])
        if rid in ad.reqs and o is not None:
            tl.scheduled(rid, lo, hi - d, None, admitted=rid in new, drafts=d)
    tl.forward()
    real = {rid: (lo, hi - len(spec.get(rid, ()))) for rid, (lo, hi) in spans.items()}
    ad.in_flight_writes = _frame_writes(ad, real)
    ids = list(so.num_scheduled_tokens)
    toks = [_gpu_sampled(ad.sched.requests.get(rid), real[rid][1], drafts[rid]) for rid in ids]
    index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if ad._indexed else {}
    # (the transfers the worker finished by N+1's forward ride on its output, delivered a step later)
    xfer = {"kv_connector_output": ad._connector_output()} if ad.store is not None else {}
    out = vllm_modules()["ModelRunnerOutput"](req_ids=ids, sampled_token_ids=toks, **index, **dict(ad._out_args, **xfer))
    accepted = {rid: (real[rid][1], real[rid][1] + len(t) - 1) for rid, t in zip(ids, toks) if len(t) > 1}
    ad.coverage["state:async_drafts_accepted"] += sum(hi - lo for lo, hi in accepted.values())
    rejected = {rid: len(drafts[rid]) + 1 - len(t) for rid, t in zip(ids, toks) if t and drafts[rid]}
    ad.inflight = Frame(so, out, ad.frame_no, accepted, rejected)
    return {"ran": len(ids)}


class Frame(NamedTuple):
    """A frame in flight: its SchedulerOutput, the model output its forward made (taken a step
    later), its number, the draft positions its sampler accepted, the drafts it rejected."""
    so: Any
    out: Any
    frame: int
    accepted: dict[str, tuple[int, int]]
    rejected: dict[str, int]


def _spans(so: Any, opt: dict[str, int], new: set[str], rejected: dict[str, int]) -> dict[str, tuple[int, int]]:
    """The positions frame N+1's forward computes per request, as the GPU computes them. The
    scheduler planned them as if every draft of N were accepted; the GPU, which knows how many N
    accepted, computes from where N's rejections put a continuing request (vLLM takes them back
    from num_computed_tokens at N's output). A request new or resumed in N+1 starts where its
    SchedulerOutput says: N's frame was another incarnation's. (Not vLLM's state after N's output:
    a release that applies a stale frame's rejections there, PR #46066's bug, does not move the GPU.)"""
    return {rid: (opt[rid] - n - back, opt[rid] - back) for rid, n in so.num_scheduled_tokens.items()
            for back in [0 if rid in new else rejected.get(rid, 0)]}


def _gpu_sampled(o: Any, hi: int, drafts: list[int]) -> list[int]:
    """The tokens frame N+1's sampler returns for a request whose known tokens it computed up to
    `hi`: none short of the request's tokens (a prompt chunk, a recompute), else the greedy token
    and the drafts that match it (a request N's output finished: vLLM drops whatever comes)."""
    if o is None:
        return [1]
    if hi < o.num_tokens:
        return []
    return greedy(list(o.all_token_ids), drafts)


def _gpu_drafts(o: Any, d: int) -> list[int]:
    """The d drafts the GPU's drafter proposed for `o` at the end of frame N (vLLM's scheduler
    holds placeholders only: under async scheduling the engine core never sends them back,
    ``EngineCore.post_step``): the same drafter as the sync drive's, after N's accepted tokens."""
    if not d or o is None:
        return []
    return draft_tokens(list(o.all_token_ids), d)
