"""vLLM's real (v1, hybrid) KV cache manager as a system under test: its actions, how to apply
one, how to observe it, and its own checks (kvcheck/engines/vllm/checks.py).

vLLM's ``KVCacheManager`` (hybrid coordinator + per-type managers + block pool) is pure Python
and runs on CPU. The actions are vLLM's own vocabulary: submit (tokens, cache salt), lookup =
``get_computed_blocks`` + admission ``allocate_slots``, chunked prefill and decode =
``allocate_slots``, finish/preempt = ``free``, ``reset_prefix_cache``, connector
``evict_blocks``; eviction happens by itself under a small ``num_blocks``. Its state has no
mapping onto the spec's, so it runs on the lockstep core with the free model: its checks,
reported by ``extra_checks`` after every step, are the ground truth.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from kvcheck.spec.config import Config
from kvcheck.fuzz.boundary import check_exception
from kvcheck.spec.sut import ActionRejected

from . import faults, mamba
from .timeline import Timeline
from .checks import ShadowChecks, Violation, Req
from .layouts import (EAGLE, LAYOUT_DATA, RETENTION, ACTIONS, DROP_REF_ON_FREE, EARLY_READER_FORWARD, LAYOUTS, VOCAB,
                      make_specs, vllm_modules, layout_config, layout_scale, planted, vllm_version)


class VllmAdapter(ShadowChecks):
    """vLLM's KVCacheManager behind kvcheck's adapter protocol: reset / apply / observe, and
    extra_checks. `strict`: a lost reuse is a finding too (else it is only recorded in `lost`)."""

    name = "vllm"
    store: Any = None          # the KV connector's external store (the scheduler drive: connector.py)
    actions = frozenset(ACTIONS)
    twin_oracle = False          # TwinAdapter: plants and catches the retention fault
    sched_policy = "fcfs"        # "priority": a request scheduled in the open step may be preempted
    last_n: int | None = None    # the tokens the last lookup/prefill/decode scheduled (the split's)
    last_hit: int | None = None  # the last lookup's hit (a reproducer records both, even past a check)

    def __init__(self, layout: str, num_blocks: int = 24, fault: str | None = None,
                 strict: bool = False) -> None:
        if layout not in LAYOUT_DATA:
            raise ValueError(f"unknown vLLM layout {layout!r}; known: {', '.join(LAYOUTS)}")
        try:
            self.planted = planted(fault)
        except KeyError as e:                      # UnknownFault: one line naming the SUT
            raise ValueError(str(e)) from None
        groups = LAYOUT_DATA[layout][1]
        why = faults.refusal(layout, groups, fault, self.twin_oracle)
        if why:
            raise ValueError(why)
        self.layout, self.num_blocks, self.fault, self.strict = layout, num_blocks, fault, strict
        self.groups = groups
        self.has_mamba = any(k == mamba.MAMBA for k, _, _ in groups)
        self.sched_bs = LAYOUT_DATA[layout][2]
        self.hb, self.max_len = layout_scale(layout)      # hash block, max_model_len
        self.max_tokens = self.max_len * 3 // 4           # requests never grow past this
        self.cfg = layout_config(layout)
        self.reset()

    # ---- construction ------------------------------------------------------------------
    def reset(self, cfg: Config | None = None) -> None:
        V = vllm_modules()
        specs = make_specs(self.layout)
        feats = V["features"]
        extra = ({"prefix_cache_retention_interval": self.retention()}
                 if "retention_interval" in feats else {})
        drafter = EAGLE.get(self.layout)       # the groups holding draft layers, or None
        flag = drafter is not None and "is_eagle_group" in feats
        kcfg = V["KVCacheConfig"](num_blocks=self.num_blocks, kv_cache_tensors=[],
                                  kv_cache_groups=[V["KVCacheGroupSpec"]([f"layer{i}"], s, **(
                                      {"is_eagle_group": i in drafter} if flag else {}))
                                                   for i, s in enumerate(specs)], **extra)
        sched = {"scheduler_block_size": self.sched_bs} if "scheduler_block_size" in feats else {}
        if drafter is not None:
            sched["use_eagle"] = True
        sched.update(mamba.manager_kwargs(self.has_mamba, feats))
        self.build_args = {"config": extra, "manager": {"max_model_len": self.max_len, "hash_block_size": self.hb,
                                                         **sched}}     # (what a reproducer rebuilds)
        self.mgr = V["KVCacheManager"](kcfg, max_model_len=self.max_len, hash_block_size=self.hb, **sched)
        self.hasher = V["ku"].get_request_block_hasher(self.hb, V["sha256"])
        self._fresh(drafter, flag, specs)

    def _fresh(self, drafter: tuple[int, ...] | None, flag: bool, specs: list) -> None:
        """Everything the checks keep, for the fresh manager in `self.mgr`."""
        self.drafter, self.retained = drafter is not None, []    # (retained: the step's copies' endpoints)
        self.pool = self.mgr.block_pool
        self.coord = self.mgr.coordinator
        self.align = int(getattr(self.coord, "_cache_hit_alignment_tokens", self.sched_bs))
        self.eagle_groups = self._eagle_groups(drafter, flag, specs)
        self.reqs: dict[str, Req] = {}
        self.written: dict[int, tuple] = {}        # block id -> (salt, token prefix) written there
        self.hash_content: dict[bytes, tuple] = {}  # hash -> (salt, token prefix) it fingerprints
        self.next_id = 0
        self.coverage: Counter = Counter()
        self.lost: list[Violation] = []
        self.hits = 0                              # lookups that hit
        self.broken: Violation | None = None       # what the last step broke (extra_checks)
        self.timeline = Timeline(self, split=self.planted(EARLY_READER_FORWARD))   # when bytes exist
        self._plant()
        self._bk_reset()                           # the incremental bookkeeping's index

    def _eagle_groups(self, drafter: tuple[int, ...] | None, flagged: bool, specs: list) -> set[int]:
        """The groups whose hits take the EAGLE drop (they must match one block past the hit):
        the drafter's groups where the release flags them (none flagged: every group), and,
        as vLLM looks up groups of identical spec together, every group whose spec equals one."""
        if drafter is None:
            return set()
        # (a Mamba group never takes the drop: its finder never drops, draft models have no Mamba layers)
        if not flagged or not drafter:
            return {g for g in range(len(self.groups)) if not mamba.is_mamba(self.groups, g)}
        return {g for g in range(len(specs)) if any(specs[g] == specs[d] for d in drafter)
                and not mamba.is_mamba(self.groups, g)}

    def retention(self) -> int | None:
        """The layout's prefix_cache_retention_interval (None: dense); the dense twin overrides it."""
        return RETENTION.get(self.layout)

    def _plant(self) -> None:
        faults.plant(self)

    # ---- the protocol ------------------------------------------------------------------
    def observe(self) -> None:
        """vLLM's state has no mapping onto the spec's state tuple (only its hits and
        bookkeeping are checked), so the abstraction function is partial: None."""
        return None

    def enabled(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {a: [] for a in ACTIONS}
        for rid, r in self.reqs.items():
            if r.state in ("waiting", "preempted"):
                out["lookup"].append(rid)
            else:
                rem = r.obj.num_tokens - r.obj.num_computed_tokens
                if rem > 1:
                    out["prefill"].append(rid)
                elif r.obj.num_tokens < self.max_tokens:
                    out["decode"].append(rid)
                out["finish"].append(rid)
                out["preempt"].append(rid)
        return out

    def apply(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        """Perform one action; the first check it breaks is kept for `extra_checks` (the
        checks run inside the action, where vLLM's answer is at hand)."""
        fn = getattr(self, f"_a_{action}", None)
        if fn is None or action not in self.actions:
            raise ActionRejected(f"unknown vLLM adapter action {action!r}")
        n_lost = len(self.lost)
        try:
            if self.has_mamba and not self.timeline.open and hasattr(self.mgr, "new_step_starts"):
                self.mgr.new_step_starts()      # a step starts (outside begin_step: each action is one)
            obs = fn(**params) or {}
            self.coverage[action] += 1
            mamba.take_copies(self)             # the step's queued copies (run before its forward)
            self._after_step()
            if not self.timeline.open and (self.timeline.sched or self.timeline.copies):
                self._forward()                 # one request per step: its forward
            if not self.timeline.open:
                mamba.release_retained(self)    # the step's scheduling is over
        except ActionRejected:
            raise
        except Violation as v:
            self.broken, obs = v, {}
        except Exception as e:  # noqa: BLE001 - whose it is decides: a finding or "cannot drive"
            if isinstance(e, TypeError) and "argument" in str(e) and "_a_" in str(e):
                raise ActionRejected(f"bad parameters for {action}: {e}") from None
            # raised on kvcheck's side of the boundary: CannotDrive (fuzz/boundary.py), no finding
            check_exception(e, "vllm", vllm_version(), ("vllm",))
            self.broken, obs = Violation("bookkeeping", "vllm_internal_error",
                                         f"vLLM raised {type(e).__name__}{raised_in(e)}: {e}"), {}
        if self.broken is None and self.strict and len(self.lost) > n_lost:
            self.broken = self.lost[-1]
        return obs

    def extra_checks(self, action: str, params: dict[str, Any]) -> tuple[str, str, str] | None:
        """(kind, check, message) of the check the last step broke, if any."""
        v, self.broken = self.broken, None
        return None if v is None else (v.kind, v.check, v.message)

    # ---- actions -----------------------------------------------------------------------
    def _get(self, r: str, states: tuple[str, ...]) -> Req:
        req = self.reqs.get(r)
        if req is None or req.state not in states:
            raise ActionRejected(f"request {r} is not {'/'.join(states)}")
        return req

    def _new_rid(self, tokens: list[int], r: str | None) -> str:
        """A new request's id (the given one, or the next), refused when taken or out of length."""
        rid = r or f"r{self.next_id}"
        if rid in self.reqs:
            raise ActionRejected(f"request {rid} already exists")
        if not 1 <= len(tokens) < self.max_tokens:
            raise ActionRejected(f"a request needs 1..{self.max_tokens - 1} tokens")
        self.next_id += 1
        return rid

    def _a_submit(self, tokens: list[int], salt: str | None = None, r: str | None = None) -> dict:
        V = vllm_modules()
        rid = self._new_rid(tokens, r)
        eos = {"eos_token_id": None} if "request_eos_arg" in V["features"] else {}   # older releases
        obj = V["Request"](rid, list(tokens), V["SamplingParams"](max_tokens=self.max_tokens), None,
                           cache_salt=salt, block_hasher=self.hasher, **eos)
        self.reqs[rid] = Req(rid, obj, salt, owned=[set() for _ in self.groups])
        return {"r": rid}

    def _a_lookup(self, r: str, chunk: int, la: int = 0, mp: int = 0) -> dict:
        req = self._get(r, ("waiting", "preempted"))
        if self.timeline.preempted:
            raise ActionRejected("vLLM admits no waiting request in a step that preempted one")
        o = req.obj
        usable = self.spec_usable(req)
        blocks, hit, *junction = self.mgr.get_computed_blocks(o)   # the junction: newer releases
        self.last_hit = hit
        if junction:
            o.shared_prefix_boundary = junction[0]      # as the scheduler does
        self.hits += hit > 0
        self._check_hit(req, blocks, hit)
        obs: dict[str, Any] = {"hit": hit, "usable": usable, **self._judge_hit(req, usable, hit)}
        chunk = mamba.split(self, o, hit, max(1, min(chunk, o.num_tokens - hit)), mp)
        self.last_n = chunk               # (the tokens scheduled: a reproducer replays this count)
        if chunk == 0:                    # the scheduler gives it no tokens this step
            self.coverage["state:mamba_split_empty"] += 1
            return {**obs, "admitted": False}
        pending = self.timeline.pending_hits(req, blocks, hit) if self.timeline.open and hit else 0
        new = self.mgr.allocate_slots(o, chunk, hit, blocks, **({"num_lookahead_tokens": la} if la else {}))
        if new is None:
            self.coverage["state:admission_refused"] += 1
            self.coverage["state:mamba_same_step_refused"] += mamba.same_step(self, blocks)
            obs["admitted"] = False
            return obs
        self._own(req, new)
        self._check_table_starts(req, blocks, hit)
        if self.has_mamba:
            mamba.admitted(self, req, hit)
        o.status = vllm_modules()["RequestStatus"].RUNNING
        o.num_computed_tokens = hit + chunk
        req.state = "running"
        self.coverage["state:hit" if hit else "state:miss"] += 1
        self.coverage["state:same_step_hit"] += pending > 0    # a hit on blocks this step publishes
        self.timeline.scheduled(r, hit, hit + chunk, None, admitted=True)
        if not self.timeline.open:
            self._maybe_sample(req)
        obs["admitted"] = True
        return obs

    def _step(self, req: Req, n: int, tok: int | None, la: int = 0, mp: int = 0) -> dict:
        tl, o = self.timeline, req.obj
        if tl.open and (req.rid in tl.sched or tl.admitted):
            raise ActionRejected(f"request {req.rid} cannot be scheduled again in this step (vLLM schedules "
                                 "each request once per step, the running ones before it admits waiting ones)")
        n = self.last_n = mamba.split(self, o, 0, n, mp)
        if n == 0:                        # the scheduler gives it no tokens this step
            self.coverage["state:mamba_split_empty"] += 1
            return {"allocated": False}
        new = self.mgr.allocate_slots(req.obj, n, **({"num_lookahead_tokens": la} if la else {}))
        if new is None:
            self.coverage["state:alloc_refused"] += 1
            return {"allocated": False}
        self._own(req, new)
        if self.has_mamba:
            mamba.check_state_copy(self, req, o.num_computed_tokens)
        lo = req.obj.num_computed_tokens
        req.obj.num_computed_tokens += n
        tl.scheduled(req.rid, lo, lo + n, tok)
        if not tl.open:
            self._maybe_sample(req, tok)
        return {"allocated": True}

    def _a_prefill(self, r: str, chunk: int, la: int = 0, mp: int = 0) -> dict:
        req = self._get(r, ("running",))
        rem = req.obj.num_tokens - req.obj.num_computed_tokens
        if rem <= 1:
            raise ActionRejected(f"request {r} has no prompt left to prefill")
        return self._step(req, max(1, min(chunk, rem)), None, la, mp)

    def _a_decode(self, r: str, tok: int, la: int = 0) -> dict:
        req = self._get(r, ("running",))
        if req.obj.num_tokens - req.obj.num_computed_tokens != 1 or req.obj.num_tokens >= self.max_tokens:
            raise ActionRejected(f"request {r} cannot decode now")
        return self._step(req, 1, tok, la)

    def _maybe_sample(self, req: Req, tok: int | None = None) -> None:
        o = req.obj
        if o.num_computed_tokens == o.num_tokens and o.num_tokens < self.max_tokens:
            # the forward produced a token (requests stop growing at max_tokens < max_model_len)
            o.append_output_token_ids(tok if tok is not None else (o.num_tokens * 7) % VOCAB)

    def _a_finish(self, r: str) -> dict:
        req = self._get(r, ("running",))
        self._between_steps("finish")
        self._free(req)
        del self.reqs[r]
        self.timeline.forget(r)
        return {}

    def _a_preempt(self, r: str) -> dict:
        req = self._get(r, ("running",))
        tl = self.timeline
        if tl.open and tl.admitted:
            raise ActionRejected("vLLM preempts only in its running loop, before it admits waiting requests")
        if tl.open and r in tl.sched and self.sched_policy != "priority":
            raise ActionRejected("vLLM's FCFS policy never preempts a request it scheduled in this step "
                                 "(its victims come from the end of the running queue; PRIORITY's may not)")
        if tl.open and tl.unschedule(r):     # the PRIORITY policy's victim was scheduled in this step
            self.coverage["state:preempt_scheduled"] += 1
        self.timeline.forget(r)
        self._free(req)
        o = req.obj
        o.status = vllm_modules()["RequestStatus"].PREEMPTED
        o.num_computed_tokens = 0
        o.num_preemptions += 1
        req.state = "preempted"
        req.owned = [set() for _ in self.groups]
        req.stamped = 0
        return {}

    def _free(self, req: Req) -> None:
        held = [b for g in range(len(self.groups)) for b in self._table(g, req.rid) if not b.is_null]
        self.mgr.free(req.obj)
        if self.planted(DROP_REF_ON_FREE):
            shared = [b for b in held if b.ref_cnt >= 1]
            if shared:
                shared[0].ref_cnt -= 1

    def _a_reset_prefix_cache(self) -> dict:
        self._between_steps("reset_prefix_cache")
        ok = self.mgr.reset_prefix_cache()
        self.coverage["state:reset_ok" if ok else "state:reset_refused"] += 1
        return {"reset": ok}

    def _a_evict_blocks(self, block_ids: list[int]) -> dict:
        self._between_steps("evict_blocks")
        ids = {i for i in block_ids if 0 < i < self.num_blocks}
        self.mgr.evict_blocks(ids)
        return {}


    # ---- scheduler steps (timeline.py) --------------------------------------------
    def _between_steps(self, action: str) -> None:
        if self.timeline.open:
            raise ActionRejected(f"{action} runs between scheduler steps, not inside one")

    def _a_begin_step(self) -> dict:
        self._between_steps("begin_step")
        self.timeline.begin()
        return {}

    def _a_forward(self) -> dict:
        if not self.timeline.open:
            raise ActionRejected("no scheduler step is open")
        ran = self._forward(sample=True)
        self.coverage["state:multi_request_step"] += len(ran) > 1
        return {"ran": len(ran)}

    def _forward(self, sample: bool = False) -> list:
        """The step's forward completes (timeline.py checks its reads); in a scheduler step
        the requests that finished their prompt then sample a token (update_from_output)."""
        ran = self.timeline.forward()
        for rid, tok in ran if sample else ():
            req = self.reqs.get(rid)
            if req is not None and req.state == "running":
                self._maybe_sample(req, tok)
        return ran


def raised_in(e: BaseException) -> str:
    """ " in FUNCTION" of the innermost frame of vLLM's own code the exception came from (an empty
    assertion says nothing else; the known defects' signatures name it)."""
    tb, name = e.__traceback__, ""
    while tb is not None:
        if "/vllm/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            name = tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    return f" in {name}" if name else ""

