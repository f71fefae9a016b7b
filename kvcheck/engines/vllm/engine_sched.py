"""vLLM's own v1 ``Scheduler`` as the driver: kvcheck submits, aborts and steps; vLLM decides.

A step is what ``EngineCore.step`` does: ``schedule()`` → ``SchedulerOutput`` → a model-runner
output → ``update_from_output()``. Which requests run, their chunk sizes, admission, preemption
(FCFS or PRIORITY), prefix-cache lookups and retention are decided by the release's scheduler
code under the episode's knobs (sched_build.SchedKnobs). kvcheck keeps only what the GPU worker
does: the forward writes the scheduled tokens' KV (timeline.py), and the model samples one token
for each request whose prompt is done — a deterministic function of its context (a greedy model:
equal contexts give equal continuations, so resends and multi-turn chats share prefixes).

The checks are the manager drive's (checks.py, bookkeeping.py, timeline.py), hooked where the
scheduler calls the manager: every ``get_computed_blocks`` is judged against the spec's usable hit
(safety of the hit, lost reuse), every ``allocate_slots`` records the blocks the request now owns
and what they will hold, every ``free`` forgets a preempted request's blocks; after ``schedule()``
the step's forward is checked (reads of bytes not written, copies) and the bookkeeping of the pool.
EAGLE: drafts are proposed after every step (right with probability ~0.7, a stable function of
the context) and fed with ``update_draft_token_ids``; the sampler accepts them while they match
the greedy token (with Mamba groups too: the worker's state per draft position, mamba_worker.py).
Not yet on this drive: the dense twin (docs/adapters-vllm.md, "The scheduler drive").
"""
from __future__ import annotations

import inspect
from typing import Any, NamedTuple

from kvcheck.spec.sut import ActionRejected

from . import engine_async, mamba, mamba_worker
from .adapter import VllmAdapter
from .checks import Req
from .layouts import CONNECTOR_CACHE_EARLY, DROP_REF_ON_FREE, WORKER_TABLE_STALE, cdiv, vllm_modules
from .sampler import draft_tokens, greedy, next_token  # noqa: F401 (next_token: read from here by the reproducers)
from .sched_build import Built, SchedKnobs, build
from .worker import Worker, plant_stale

ENGINE_ACTIONS = ("submit", "step", "abort", "reset_prefix_cache", "evict_blocks")


class _Copy(NamedTuple):
    src_block_id: int
    dst_block_id: int


class EngineAdapter(VllmAdapter):
    """vLLM's Scheduler behind the adapter protocol (the manager is the scheduler's own)."""

    actions = frozenset(ENGINE_ACTIONS)

    def __init__(self, layout: str, knobs: SchedKnobs, fault: str | None = None, strict: bool = False) -> None:
        self.knobs = knobs
        self.sched_policy = knobs.policy
        super().__init__(layout, knobs.num_blocks, fault, strict)

    def reset(self, cfg: Any = None) -> None:
        built: Built = build(self.layout, self.knobs)
        self.sched, self.mgr, self.hasher = built.scheduler, built.scheduler.kv_cache_manager, built.hasher
        self.build_args = {"scheduler": self.knobs.as_dict()}
        V = vllm_modules()
        from .layouts import EAGLE, make_specs
        drafter = EAGLE.get(self.layout)
        self._fresh(drafter, drafter is not None and "is_eagle_group" in V["features"], make_specs(self.layout))
        if not getattr(self.mgr, "use_eagle", False):
            # the release's config chose no EAGLE block drop (0.33: lookahead block hashes prove the
            # boundary token instead): the spec's ground truth follows what the scheduler built
            self.eagle_groups = set()
        self.arrivals, self.worker, self.inflight = 0, Worker(), None   # (inflight: engine_async.py)
        self.frame_no, self.preempted_at = 0, {}                         # (engine_async.note_reset)
        self.store = None                           # the KV connector's external store (connector.py)
        if self.knobs.connector:
            from .connector_store import Store
            self.store = self.sched.connector.store = Store(self)
        self.done: list[list[int]] = []          # finished requests' whole token lists (multi-turn)
        self.stepped: set[str] = set()           # requests allocated in the open step
        self.noted: set[tuple[int, int]] = set()  # copies checked when their allocation queued them
        self.accepted: dict[str, tuple[int, int]] = {}   # rid -> accepted draft positions of the step
        self.settling: dict[str, int] = {}    # rid -> tokens accepted in the step (Mamba: mamba_worker.settle)
        self._alloc_sig = inspect.signature(type(self.mgr).allocate_slots)   # (the class's: wrappers hide it)
        self._hook("allocate_slots", self._on_alloc)
        self._hook("free", self._on_free)
        if hasattr(self.mgr, "pop_blocks_for_free"):         # (a deferred free: the same forgetting)
            self._hook("pop_blocks_for_free", self._on_free)
        if hasattr(self.mgr, "take_kv_cache_block_copies"):     # the scheduler drains the copies itself
            self._hook("take_kv_cache_block_copies", self._on_copies)
        self._req_args = set(inspect.signature(V["Request"]).parameters)
        self._out_args = self._model_output_defaults()

    # ---- hooks where the scheduler calls its manager -----------------------------------------
    def _hook(self, name: str, around: Any) -> None:
        inner = getattr(self.mgr, name)

        def hooked(*a: Any, **k: Any) -> Any:
            return around(inner, *a, **k)
        hooked._kvcheck_hook = True       # type: ignore[attr-defined]
        setattr(self.mgr, name, hooked)

    def _outermost_lookup_hook(self) -> None:
        """The hit check wraps every other wrapper (known.install's runs inside it)."""
        if not getattr(self.mgr.get_computed_blocks, "_kvcheck_hook", False):
            self._hook("get_computed_blocks", self._on_lookup)

    def _on_lookup(self, inner: Any, request: Any, *a: Any, **k: Any) -> Any:
        req = self.reqs[request.request_id]
        usable = self.spec_usable(req)
        out = inner(request, *a, **k)
        blocks, hit = out[0], out[1]
        self.last_hit = hit
        self.hits += hit > 0
        self.coverage["state:hit" if hit else "state:miss"] += 1
        self._check_hit(req, blocks, hit)
        n = len(self.lost)
        self._judge_hit(req, usable, hit)
        if len(self.lost) > n:            # (the known-defect recogniser judges it at this very lookup)
            self.lost[-1].known_last = getattr(self, "known_last", None)      # type: ignore[attr-defined]
        req.pending = (blocks, hit)      # type: ignore[attr-defined]
        return out

    def _on_alloc(self, inner: Any, request: Any, *a: Any, **k: Any) -> Any:
        args = self._alloc_sig.bind(self.mgr, request, *a, **k).arguments
        lo = request.num_computed_tokens
        queued = self._queued()
        new = inner(request, *a, **k)
        req = self.reqs.get(request.request_id)
        if new is None or req is None:
            self.coverage["state:alloc_refused"] += new is None
            return new
        self._own(req, new)
        hit = int(args.get("num_new_computed_tokens", 0) or 0)
        ext = int(args.get("num_external_computed_tokens", 0) or 0)     # (a connector's load)
        if ext:           # (its blocks: allocate_new_computed_blocks, not among the new ones returned)
            if args.get("delay_cache_blocks") and self.planted(CONNECTOR_CACHE_EARLY):
                self.mgr.cache_blocks(request, lo + hit + ext)     # (published before the load)
                self.coverage["state:fault_planted"] += 1
            for g, (_, bs, _) in enumerate(self.groups):
                table = self._table(g, req.rid)
                req.owned[g].update(b.block_id for b in table[(lo + hit) // bs: cdiv(lo + hit + ext, bs)]
                                    if not b.is_null)
        if self.has_mamba:          # the worker's running state block this step (drafts counted)
            req.state_block = cdiv(lo + hit + int(args["num_new_tokens"]), mamba.mamba_block(self.groups)) - 1
        copies = self._new_copies(queued)
        pending = getattr(req, "pending", None)
        if pending is not None and lo == 0:
            req.pending = None           # type: ignore[attr-defined]
            self._check_table_starts(req, pending[0], hit)
            if self.has_mamba:
                mamba.admitted(self, req, hit, copies)
        elif self.has_mamba:
            mamba.note_copies(self, copies)
            mamba.check_state_copy(self, req, lo)
        else:
            mamba.note_copies(self, copies)
        self._stamp(req, min(lo + hit + ext + int(args["num_new_tokens"]), request.num_tokens))   # (not drafts)
        self.stepped.add(req.rid)
        return new

    def _queued(self) -> list[int]:
        """How many copies each manager has queued (vLLM's own list, read, never drained)."""
        return [len(getattr(m, "_pending_cow_copies", ())) for m in self.coord.single_type_managers]

    def _new_copies(self, before: list[int]) -> list:
        """The copies the allocation just queued, as vLLM will hand them to the worker."""
        out = []
        for m, n in zip(self.coord.single_type_managers, before):
            for src, dst in list(getattr(m, "_pending_cow_copies", ()))[n:]:
                out.append(_Copy(src.block_id, dst.block_id))
                self.noted.add((src.block_id, dst.block_id))
        return out

    def _on_copies(self, inner: Any, *a: Any, **k: Any) -> Any:
        out = inner(*a, **k)
        late = [c for c in out[0] if (c.src_block_id, c.dst_block_id) not in self.noted]
        mamba.note_copies(self, late)         # (copies queued outside an allocation: none seen yet)
        self.noted = set()
        return out

    def _accept(self, rid: str) -> None:
        span = self.accepted.pop(rid, None)
        req = self.reqs.get(rid)
        a = self.settling.pop(rid, None)
        if a is not None:             # (the worker's Mamba postprocess: the sampler has decided)
            mamba_worker.settle(self, self.timeline, rid, a)
        if span is not None and req is not None:
            self.timeline.write_accepted(rid, *span)
            o = req.obj                   # (vLLM caches the accepted tokens' blocks in update_from_output;
            # under async scheduling the next frame's bonus token is not written yet: span[1])
            self._stamp(req, min(o.num_computed_tokens, o.num_tokens, span[1]))

    def _on_free(self, inner: Any, request: Any, *a: Any, **k: Any) -> Any:
        self._accept(request.request_id)  # (a request finishing in update_from_output: before its blocks go)
        req = self.reqs.get(request.request_id)
        held = [b for g in range(len(self.groups)) for b in self._table(g, request.request_id) if not b.is_null]
        out = inner(request, *a, **k)
        if self.timeline.open and request.request_id in self.stepped:   # preempted after its allocation
            self.timeline.cancel(request.request_id, held)
        if self.planted(DROP_REF_ON_FREE):
            shared = [b for b in held if b.ref_cnt >= 1]
            if shared:
                shared[0].ref_cnt -= 1
        if req is not None:
            req.owned, req.stamped, req.state_block = [set() for _ in self.groups], 0, None
            self.timeline.forget(req.rid)
        return out

    # ---- the protocol ------------------------------------------------------------------------
    def enabled(self) -> dict[str, list[str]]:
        live = [r for r, q in self.reqs.items() if q.state != "finished"]
        return {"submit": [], "step": [], "abort": live, "reset_prefix_cache": [], "evict_blocks": []}

    def apply(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        if action not in ENGINE_ACTIONS:
            raise ActionRejected(f"unknown action {action!r} on the vLLM scheduler drive")
        return super().apply(action, params)

    def _sync(self) -> None:
        """Requests as the scheduler holds them: finished ones leave (their tokens are kept)."""
        st = vllm_modules()["RequestStatus"]
        for rid in list(self.reqs):
            o = self.sched.requests.get(rid)
            if o is None:
                self.done.append(list(self.reqs.pop(rid).obj.all_token_ids))
                self.timeline.forget(rid)
                continue
            self.reqs[rid].state = ("finished" if o.is_finished() else      # (its blocks held for a KV store)
                                    "running" if o.status == st.RUNNING else
                                    "preempted" if o.status == st.PREEMPTED else "waiting")

    # ---- actions -----------------------------------------------------------------------------
    def _a_submit(self, tokens: list[int], salt: str | None = None, r: str | None = None,
                  prio: int = 0, max_tokens: int = 8) -> dict:
        V = vllm_modules()
        rid = self._new_rid(tokens, r)
        self.arrivals += 1
        mt = max(1, min(int(max_tokens), self.max_tokens - len(tokens)))
        kw = {k: v for k, v in dict(cache_salt=salt, block_hasher=self.hasher, eos_token_id=None,
                                    priority=int(prio), arrival_time=float(self.arrivals)).items()
              if k in self._req_args}
        obj = V["Request"](rid, list(tokens), V["SamplingParams"](max_tokens=mt), None, **kw)
        self.reqs[rid] = Req(rid, obj, salt, owned=[set() for _ in self.groups])
        self.sched.add_request(obj)
        return {"r": rid}

    def _a_reset_prefix_cache(self, running: bool = False) -> dict:
        """The scheduler's reset; `running`: it first preempts every running request (they resume,
        with new block tables, in a later step: vLLM's forced preemption)."""
        if running and ((self.store is not None and self.store.busy()) or self._frees_deferred()):
            # vLLM: "Failed to reset KV cache even when all the running requests are preempted ...
            # requests waiting for remote KV transfer, which is not supported yet" (a RuntimeError); the
            # same when freed blocks wait for in-flight steps (0.34: async + a consumer connector)
            raise ActionRejected("reset_prefix_cache(running) while a KV connector transfer or an in-flight "
                                 "step holds blocks: vLLM does not support it yet (it raises)")
        if running and self.knobs.async_sched:
            engine_async.note_reset(self)
        ok = self.sched.reset_prefix_cache(reset_running_requests=bool(running))
        self._sync()
        self.coverage["state:reset_ok" if ok else "state:reset_refused"] += 1
        self.coverage["state:reset_preempting"] += bool(running)
        return {"reset": ok}

    def _frees_deferred(self) -> bool:
        """Would vLLM keep blocks past a forced reset's preemptions? (0.34, async scheduling with a
        consumer connector: blocks freed while a step that may write them is in flight wait in
        deferred_frees: those already waiting, and those of every running request such a step ran.)"""
        s = self.sched
        if not getattr(s, "defer_block_free", False):
            return False
        done = getattr(s, "processed_step_seq", 0)
        return bool(s.deferred_frees) or any(getattr(o, "last_sched_seq", 0) > done for o in s.running)

    def _a_abort(self, r: str) -> dict:
        if r not in self.reqs or self.reqs[r].state == "finished":
            raise ActionRejected(f"request {r} is not live")
        self.sched.finish_requests([r], vllm_modules()["RequestStatus"].FINISHED_ABORTED)
        self._sync()
        return {}

    def _a_step(self) -> dict:
        if self.knobs.async_sched:             # (vLLM's batch queue: engine_async.py)
            return engine_async.step(self)
        self._outermost_lookup_hook()
        tl = self.timeline
        tl.begin()
        self.stepped = set()
        earlier = set(getattr(self.sched, "reset_preempted_req_ids", ()) or ())   # (preempted by a reset)
        so = self.sched.schedule()
        self._sync()
        if self.planted(WORKER_TABLE_STALE):
            self.coverage["state:fault_planted"] += plant_stale(so)
        self.worker.update(so)
        self.worker.check(self, so)           # the forward's slots are the worker's: they must be the manager's
        if self.store is not None:            # the connector's synchronous loads, before the forward
            self.store.before_forward(so)
        new = {x.req_id for x in so.scheduled_new_reqs}
        new |= set(getattr(so.scheduled_cached_reqs, "resumed_req_ids", ()) or ())
        spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        real: dict[str, int] = {}                 # rid -> end of the known tokens it computes
        for rid, n in so.num_scheduled_tokens.items():
            hi = self.sched.requests[rid].num_computed_tokens
            real[rid] = hi - len(spec.get(rid, ()))       # (draft positions: written once accepted)
            tl.scheduled(rid, hi - n, real[rid], None, admitted=rid in new, drafts=len(spec.get(rid, ())))
        self.coverage["state:multi_request_step"] += len(so.num_scheduled_tokens) > 1
        gone = set(getattr(so, "preempted_req_ids", ()) or ()) - earlier
        self.coverage["state:preempted"] += len(gone)
        self.coverage["state:preempt_scheduled"] += len(gone & self.stepped)   # PRIORITY: after its allocation
        # (the content model and bookkeeping are checked after the step, by apply: num_computed_tokens
        # counts the scheduled drafts until update_from_output takes the rejected ones back)
        discarded = set(tl.discarded)     # (requests whose failed sync load voids their output)
        tl.forward()                      # the forward writes, then every read is checked
        ids = list(so.num_scheduled_tokens)
        toks = [self._sampled(self.sched.requests[rid], list(spec.get(rid, ()))) for rid in ids]
        index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if self._indexed else {}   # (gone in 0.34)
        xfer = {"kv_connector_output": self._connector_output()} if self.store is not None else {}
        out = vllm_modules()["ModelRunnerOutput"](req_ids=ids, sampled_token_ids=toks, **index,
                                                  **dict(self._out_args, **xfer))
        # accepted drafts: their KV, written by the forward, is right (a request that finishes in
        # update_from_output has them written when it is freed: _on_free)
        self.accepted = {rid: (real[rid], real[rid] + len(t) - 1) for rid, t in zip(ids, toks)
                         if len(t) > 1 and rid not in discarded}     # (a failed sync load: output discarded)
        self.coverage["state:drafts_accepted"] += sum(hi - lo for lo, hi in self.accepted.values())
        self.settling = {rid: len(t) for rid, t in zip(ids, toks)} if self.has_mamba else {}
        self.sched.update_from_output(so, out)
        if self.store is not None:
            self.store.delivered()
        for rid in list(self.accepted) + list(self.settling):
            self._accept(rid)
        self._sync()
        self._propose()
        return {"ran": len(ids)}

    def _sampled(self, o: Any, drafts: list[int]) -> list[int]:
        """The greedy model's tokens for a scheduled request: none mid-prompt; else greedy()."""
        if o.num_computed_tokens - len(drafts) < o.num_tokens:
            return []
        return greedy(list(o.all_token_ids), drafts)

    def _propose(self) -> None:
        """EAGLE / MTP: drafts for every decoding request, each right with probability ~0.7 (a
        stable function of its context, so a replay proposes the same). With Mamba groups the
        worker keeps a state per draft position and resumes from the accepted one (mamba_worker.py)."""
        k = self.knobs.spec_tokens if self.drafter else 0
        rids, drafts = [], []
        for rid, req in self.reqs.items():
            o = req.obj
            if k <= 0 or req.state != "running" or o.num_tokens - o.num_computed_tokens != 1:
                continue
            rids.append(rid)
            drafts.append(draft_tokens(o.all_token_ids, k))
        if rids:
            from vllm.v1.outputs import DraftTokenIds
            self.sched.update_draft_token_ids(DraftTokenIds(rids, drafts))
            self.coverage["state:drafts_proposed"] += sum(map(len, drafts))

    def _connector_output(self) -> Any:
        """The worker's transfers finished in this step (connector.py), as the release's type."""
        from vllm.v1.outputs import KVConnectorOutput
        fields = self.__dict__.get("_xfer_fields")
        if fields is None:              # (the release's fields, read once: this runs every step)
            fields = self._xfer_fields = set(inspect.signature(KVConnectorOutput).parameters)
        got = self.store.output()
        self.coverage["state:connector_recv"] += len(got["finished_recving"] or ())
        self.coverage["state:connector_send"] += len(got["finished_sending"] or ())
        self.coverage["state:connector_load_failed"] += len(got["invalid_block_ids"]) + len(got["failed_recving"])
        self.coverage["state:connector_failed_recving"] += len(got["failed_recving"])      # (whole loads)
        return KVConnectorOutput(**{k: v for k, v in got.items() if k in fields})

    def _model_output_defaults(self) -> dict[str, Any]:
        """The release's required ModelRunnerOutput fields besides the three kvcheck fills."""
        V = vllm_modules()
        if "ModelRunnerOutput" not in V:
            from vllm.v1.outputs import ModelRunnerOutput
            V["ModelRunnerOutput"] = ModelRunnerOutput
        out: dict[str, Any] = {}
        self._indexed = "req_id_to_index" in inspect.signature(V["ModelRunnerOutput"]).parameters
        for k, p in inspect.signature(V["ModelRunnerOutput"]).parameters.items():
            if p.default is inspect.Parameter.empty and k not in ("req_ids", "req_id_to_index", "sampled_token_ids"):
                out[k] = [] if "list" in str(p.annotation) else {} if "dict" in str(p.annotation) else None
        return out
