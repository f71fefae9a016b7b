"""The scheduler drive behind kvcheck's adapter protocol (the lockstep core, FreeModel).

Actions (a trace is a sequence of them, replayed as it was run):
  start(config)                       build SGLang's scheduler for the episode (config.SchedConfig)
  submit(r, tokens, max_new, priority) a request, through SGLang's `handle_generate_request`
  step(toks, times=1)                 `times` passes of SGLang's event loop: `get_next_batch_to_run`,
                                      then `run_batch` + `process_batch_result`, or `on_idle`;
                                      the forward samples `toks` (request i gets toks[i % len])
  abort(r)                            SGLang's `abort_request`
After each action the worker's checks (worker.py) and, with nothing running, the tree's lock
balance (`lock_ref_equals_holders`: every lock reference at 0) and slot accounting
(`size_accounting`: free + tree == pool) are checked, and after every action the tree's content
(`tree_content_matches`) and every live request's locked node (`no_evict_locked`). SGLang's own checks run inside its calls
(`on_idle`'s invariant checker, the tree's sanity check): one that raises is a finding
(`sglang_internal_error`), unless the exception comes from kvcheck's side (cannot drive).
"""
from __future__ import annotations

import contextlib
import inspect
import random
import sys
from array import array
from collections import Counter
from typing import TYPE_CHECKING, Any

from kvcheck.fuzz.boundary import CannotDrive, check_exception, frame_at
from kvcheck.spec.refusal import ActionRejected

from ..checks import slots_of
from ..install import LayoutError, SglangUnavailable, load
from ..violation import Violation
from . import loop
from .build import Built, build, disabled, gap
from .config import SchedConfig, all_swa, model_gap, pool_too_small
from .faults import evict_entries, plant, plantable
from .tree import Tree
from .worker import EOS, ModelWorker, fingerprints, kv_field

if TYPE_CHECKING:
    from ..layouts import Layout

ACTIONS = ("start", "submit", "step", "abort")
DRIVEN_CLASSES = ("RadixCache", "UnifiedRadixCache", "PureSWARadixCache", "ChunkCache")


def _input_ids(cls: type, tokens: list[int]) -> Any:
    """The prompt as the release's tokenizer manager hands it over: the type its
    `TokenizedGenerateReqInput.input_ids` declares (an `array` 0.5.14+, a list before)."""
    ann = str(getattr(cls, "__annotations__", {}).get("input_ids", ""))
    return array("q", tokens) if "array" in ann else list(tokens)


class SchedAdapter:
    """SGLang's own scheduler over the layout's cache class, one episode per adapter."""

    name = "sglang"
    actions = frozenset(ACTIONS)
    incremental_pays = False

    def __init__(self, lay: Layout, fault: str | None = None, capacity: int | None = None) -> None:
        if lay.cls not in DRIVEN_CLASSES:
            raise LayoutError(f"layout {lay.name}: the scheduler drive runs {', '.join(DRIVEN_CLASSES)} so far "
                              f"(not {lay.cls}); its cache-level layout {lay.name.split('@')[0]} runs it")
        if fault is not None and fault not in plantable(lay):
            raise LayoutError(f"layout {lay.name}: the scheduler drive plants {', '.join(plantable(lay)) or 'nothing'} "
                              f"there on this release, not {fault!r}")
        why = gap(lay.page_size) or model_gap(lay)
        if why:
            raise SglangUnavailable(why)
        self.lay, self.fault = lay, fault
        self.capacity = capacity or lay.capacity
        self.reset()

    def reset(self, cfg: Any = None) -> None:
        self.built: Built | None = None
        self.worker = ModelWorker()
        self.reqs: dict[str, Any] = {}          # rid -> SGLang's Req, while it lives
        self.coverage: Counter = Counter()
        self.broken: Violation | None = None
        self.hits = 0
        self.next_id = 0
        self.config: SchedConfig | None = None

    def close(self) -> None:
        if self.built is not None:
            self.built.close()
            self.built = None

    def observe(self) -> None:
        return None

    def enabled(self) -> dict[str, list[str]]:
        if self.built is None:
            return {"start": ["-"]}
        return {"submit": ["-"], "step": ["-"], "abort": sorted(self.reqs)}

    # ---- actions -------------------------------------------------------------------------
    def apply(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        if action not in ACTIONS:
            raise ActionRejected(f"unknown action {action!r} for the SGLang scheduler drive")
        if (action == "start") != (self.built is None):
            raise ActionRejected("start comes first, once" if action == "start" else "no scheduler yet")
        if action == "start":
            try:
                self.config = SchedConfig.from_dict(params["config"])
            except (TypeError, ValueError, KeyError, AttributeError) as e:
                raise ActionRejected(f"bad parameters for start: {e}") from None
            if why := pool_too_small(self.config, self.lay):
                self.config = None
                raise ActionRejected(f"bad parameters for start: {why}")
        method = getattr(self, f"_a_{action}")
        _check_params(action, method, params)
        try:
            with contextlib.redirect_stdout(sys.stderr):    # SGLang prints tree dumps on its own errors
                obs = method(**params)
        except (ActionRejected, CannotDrive):
            raise
        except Exception as e:     # SGLang's own code raised: a finding; kvcheck's frames: cannot drive
            self.broken, obs = self._engine_raised(e), {}
        self.coverage[action] += 1
        self.coverage.update(self.worker.coverage)
        self.worker.coverage.clear()
        if self.broken is None:
            self.broken = self.worker.broken
        if self.broken is None and self.built is not None:
            self.broken = self._tree_checks() or self._idle_checks()
        return obs

    def _a_start(self, config: dict[str, Any]) -> dict:
        """Build the scheduler (`self.config`, parsed by `apply`): whatever fails here is kvcheck's
        side (cannot drive) or the release's (its own constructors raised)."""
        try:
            self.built = build(self.lay, self.config, self.worker)
        except SglangUnavailable:
            raise
        except Exception as e:      # building is kvcheck's side of the boundary: never SGLang's bug
            raise CannotDrive("sglang", load()["version"], f"building SGLang's scheduler on CPU failed: "
                              f"{type(e).__name__}: {e}", (frame_at(e) or ("", "build.py"))[1]) from e
        self.tree = Tree(self.built.cache)
        self.coverage[f"tree:{type(self.built.cache).__name__}"] += 1     # the class SGLang's factory built
        self.worker.bind(self.built.cache, self.built.rows, self.tree,
                         self.lay.window if "swa" in self.lay.components else None, all_swa(self.lay))
        self.worker.disabled = disabled(self.lay)
        self.worker.pre_forward = self._tree_checks     # what the scheduling of a step broke, before its forward
        if self.fault is not None:
            plant(self.fault, self.built.cache, self.tree)
        for name in evict_entries(self.built.cache):
            setattr(self.built.cache, name, self._counted(getattr(self.built.cache, name)))
        self.coverage[f"config:policy:{self.config.schedule_policy}"] += 1
        self.coverage["config:chunked" if self.config.chunked_prefill_size > 0 else "config:unchunked"] += 1
        self.coverage["config:overlap" if self.config.enable_overlap else "config:no_overlap"] += 1
        return {}

    def _counted(self, real_evict: Any) -> Any:
        """SGLang's evict, called through; observed only (coverage: an eviction happened)."""
        def evict(*a: Any, **k: Any) -> Any:
            full = getattr(self.built.alloc, "full_attn_allocator", self.built.alloc)
            before = full.available_size()
            out = real_evict(*a, **k)
            if full.available_size() > before:
                self.coverage["state:evicted"] += 1
            return out
        return evict

    def _a_submit(self, r: str, tokens: list[int], max_new: int, priority: int | None = None) -> dict:
        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams
        if r in self.reqs or not tokens or any(not isinstance(t, int) or t < 0 for t in tokens):
            raise ActionRejected(f"bad submit of {r!r}")
        if type(max_new) is not int or max_new < 0 or not (priority is None or type(priority) is int):
            raise ActionRejected(f"bad submit of {r!r}: max_new must be an int >= 0, priority an int or null")
        s = self.built.sched
        sp = SamplingParams(max_new_tokens=max_new, stop_token_ids=[EOS])
        sp.normalize(None)
        T = TokenizedGenerateReqInput
        fields = set(getattr(T, "__dataclass_fields__", ())) or set(getattr(T, "__struct_fields__", ()))
        kw = dict(rid=r, input_text="", input_ids=_input_ids(T, tokens), input_embeds=None, mm_inputs=None,
                  token_type_ids=None, sampling_params=sp, return_logprob=False, logprob_start_len=-1,
                  top_logprobs_num=0, token_ids_logprob=None, stream=False,
                  **({"priority": priority} if priority is not None else {}))
        # the fields the release's request has (0.5.7 has no token_type_ids); parameters are checked
        # above, so a refusal here is kvcheck's construction, not the trace's
        try:
            req_in = T(**{k: v for k, v in kw.items() if not fields or k in fields})
        except TypeError as e:
            raise CannotDrive("sglang", load()["version"], f"its TokenizedGenerateReqInput refused kvcheck's "
                              f"request: {e}", "kvcheck/engines/sglang/scheduler/adapter.py (_a_submit)") from e
        s.handle_generate_request(req_in)
        req = next((q for q in s.waiting_queue if q.rid == r), None)
        if req is None:                # refused at admission (too long, queue full): SGLang finished it
            self.coverage["submit:refused"] += 1
        else:
            self.reqs[r] = req
        self.next_id += 1
        return {}

    def _a_step(self, toks: list[int], times: int = 1) -> dict:
        if not isinstance(times, int) or not 1 <= times <= 4096:
            raise ActionRejected(f"step times must be 1..4096, got {times!r}")
        for _ in range(times):
            self._one_step(toks)
            if self.worker.broken is not None:
                break
        return {}

    def _one_step(self, toks: list[int]) -> None:
        """One pass of SGLang's event loop (loop.py: the release's own normal or overlap loop)."""
        self.worker.tokens = list(toks)
        if (loop.overlap if self.config.enable_overlap else loop.normal)(self.built.sched, self._launched) is None:
            self.coverage["step:idle"] += 1
        for rid in [rid for rid, q in self.reqs.items() if q.finished()]:
            self.coverage["finished"] += 1
            del self.reqs[rid]

    def _launched(self, batch: Any) -> None:
        self.worker.launched = batch
        extend = batch.forward_mode.is_extend()
        self.coverage["step:extend" if extend else "step:decode"] += 1
        if extend:
            self.hits += sum(1 for p in batch.prefix_lens if int(p) > 0)

    def _a_abort(self, r: str) -> dict:
        from sglang.srt.managers.io_struct import AbortReq
        if r not in self.reqs:
            raise ActionRejected(f"request {r} is not live")
        self.built.sched.abort_request(AbortReq(rid=r))
        return {}

    # ---- checks --------------------------------------------------------------------------
    def _tree_checks(self, batch: Any = None) -> Violation | None:
        """After every action and as each forward starts (`batch`: the one about to run): each
        tree slot holds the KV of its path (`tree_content_matches`: what a later hit reads; an SWA
        slot, where the node keeps one, likewise), every holder's locked node is still in the tree
        (`no_evict_locked`), and each node's full lock_ref is the number of holders locking it or
        a node below it (`lock_ref_equals_holders`)."""
        written, written_swa = self.worker.written, self.worker.written_swa
        nodes = set()
        for v in self.tree.views():
            nodes.add(id(v.node))
            fps = fingerprints(v.path + v.key)
            for shadow, slots, what in ((written, v.full, ""), (written_swa, v.swa, "SWA ")):
                for k, slot in enumerate(slots or ()):
                    p = len(v.path) + k
                    if shadow.get(slot) != fps[p]:
                        return Violation("safety", "tree_content_matches",
                                         f"the tree holds position {p} of a cached prefix in {what}slot {slot}, "
                                         f"which does not hold that prefix's KV")
        want: dict[int, int] = {}
        for req in self._holders(batch):
            lock = getattr(req, "lock", None)
            node = self.tree.node(lock.node if lock is not None and hasattr(lock, "node") else req.last_node)
            if node is None or node is self.tree.root:
                continue
            if id(node) not in nodes:
                return Violation("safety", "no_evict_locked",
                                 f"{req.rid}'s locked node (its cached prefix) is no longer in the tree")
            while node is not None and node is not self.tree.root:
                want[id(node)] = want.get(id(node), 0) + 1
                node = node.parent
        for v in self.tree.views():
            if v.full_lock != want.get(id(v.node), 0):
                return Violation("bookkeeping", "lock_ref_equals_holders",
                                 f"a tree node of {len(v.key)} tokens holds lock_ref {v.full_lock}; "
                                 f"{want.get(id(v.node), 0)} running request(s) lock it or a node below it")
        return None

    def _holders(self, batch: Any = None) -> list[Any]:
        """The requests that hold a lock on their prefix: those in a batch (running, the chunked
        one, the last batch's), not finished or retracted; where the release keeps the lock on
        the request (`req.lock`, 0.5.22+), those whose lock is set. A waiting request's
        `last_node` is a match without a lock (the policy's), which eviction may take."""
        s = self.built.sched
        cands = list(s.running_batch.reqs) + ([s.chunked_req] if s.chunked_req is not None else []) \
            + (list(s.last_batch.reqs) if s.last_batch is not None else []) \
            + (list(batch.reqs) if batch is not None else []) \
            + [r for b, _ in s.__dict__.get("result_queue", ()) for r in b.reqs]     # overlap: not yet processed
        out, seen = [], set()
        for req in cands:
            if id(req) in seen or req.finished() or getattr(req, "is_retracted", False):
                continue
            seen.add(id(req))
            if "lock" in vars(req) and req.lock is None:
                continue
            out.append(req)
        return out

    def _idle_checks(self) -> Violation | None:
        """Slot accounting after every action (`size_accounting`: free + the tree's + what live
        requests hold outside the tree == the pool, in pages; on a FULL+SWA model for the SWA pool
        too, a request holding the SWA slots its row maps to); with no request anywhere in the
        scheduler, every lock released (`lock_ref_equals_holders`)."""
        s, cache, alloc = self.built.sched, self.built.cache, self.built.alloc
        ps = self.lay.page_size
        views = self.tree.views()
        locked = max((v.full_lock for v in views), default=0)
        pure, rows = all_swa(self.lay), []     # rows: the slots each live request holds
        for req in self.reqs.values():
            # 0.5.19+: row and length on req.kv; 0.5.18: the row on the Req, the length on req.kv
            # (a ReqKvInfo, None before the first allocation)
            kv = getattr(req, "kv", None) or req
            row = getattr(kv, "req_pool_idx", getattr(req, "req_pool_idx", None))
            n = int(getattr(kv, "kv_allocated_len", 0) or 0)
            if row is None or not n:
                continue
            held = [int(v) for v in self.built.rows.req_to_token[row, :n].tolist()]
            lo, hi = window_freed(req, kv) if pure else (0, 0)
            if hi > lo:     # positions the window freed (maybe_evict_swa): neither the tree's nor held
                self.coverage["state:window_freed"] += 1
                held = held[:lo] + held[hi:]
            rows.append(held)
        full = getattr(alloc, "full_attn_allocator", alloc)     # FULL+SWA: the full pool, then the SWA pool
        pools = [("SWA " if pure else "", full, [v.full for v in views], rows, ps)]
        swa_alloc, m = getattr(alloc, "swa_attn_allocator", None), getattr(alloc, "full_to_swa_index_mapping", None)
        if swa_alloc is not None and m is not None and not pure:
            ml = m.tolist()
            # the tree's SWA slots: a node's own SWA value, and the SWA slots its full slots still map to
            # (0.5.23 keeps a node's SWA pages through the mapping: SGLang counts them evictable)
            pools.append(("SWA ", swa_alloc, [(v.swa or []) + [ml[x] for x in v.full or () if ml[x] > 0] for v in views],
                          [[ml[x] for x in r if ml[x] > 0] for r in rows], 1))
        for what, pool, in_tree, in_rows, unit in pools:
            tree = {x // unit for slots in in_tree for x in slots or ()}
            held = {x // unit for r in in_rows for x in r} - tree
            free = int(pool.available_size())
            if free + (len(tree) + len(held)) * unit != pool.size:
                return Violation("bookkeeping", "size_accounting",
                                 f"{what}pool: {free} free + {len(tree) * unit} in the tree + {len(held) * unit} held "
                                 f"by live requests != {pool.size} slots")
        idle = not (s.waiting_queue or not s.running_batch.is_empty() or s.chunked_req is not None or self.reqs)
        if idle and locked:
            return Violation("bookkeeping", "lock_ref_equals_holders",
                             f"no request runs, yet a tree node holds lock_ref {locked}")
        self.coverage["check:idle" if idle else "check:accounting"] += 1
        return None

    def _engine_raised(self, e: Exception) -> Violation:
        """SGLang's own code raised: a finding. Where it is SGLang's own capacity or leak check
        ("out of memory", "memory leak"), the finding leads with the accounting the state already
        broke, if it did (the cause such a check reports); any other exception is reported as
        itself (a mid-step state is not counted)."""
        check_exception(e, "sglang", load()["version"], ("sglang",))
        kernel = frame_at(e, "triton", first=True)
        if kernel:
            raise CannotDrive("sglang", load()["version"], f"{type(e).__name__}: {e}: the release launched a Triton "
                              "kernel, which does not run on this CPU", kernel[1]) from e
        if self.built is not None and any(w in str(e).lower() for w in ("out of memory", "memory leak")):
            try:
                v = self._idle_checks()
            except Exception:           # the state is too broken to count: the error alone
                v = None
            if v is not None:
                return Violation(v.kind, v.check, f"{v.message}; then SGLang raised {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}")
        return Violation("bookkeeping", "sglang_internal_error", f"SGLang raised {type(e).__name__}: {e}")

    def extra_checks(self, action: str, params: dict[str, Any]) -> tuple[str, str, str] | None:
        v, self.broken = self.broken, None
        if v is not None:
            self.worker.broken = None
        return None if v is None else (v.kind, v.check, v.message)

    def generator(self, rng: random.Random) -> Any:
        from .generator import SchedGen
        return SchedGen(rng, self.lay, self.capacity)


def window_freed(req: Any, kv: Any) -> tuple[int, int]:
    """The positions of a request's row its window eviction freed: from above what the tree owns and
    the prefill it keeps (`cache_protected_len`, `swa_evict_floor`) up to its SWA eviction cursor
    (0.5.21+ `get_evicted_seqlen(SWA)`, 0.5.15-0.5.20 `swa_evicted_seqlen`; on the request or its
    `kv` record by release)."""
    if hasattr(kv, "get_evicted_seqlen"):
        from ..compat import component_types
        hi = int(kv.get_evicted_seqlen(component_types().SWA))
    else:
        hi = kv_field(req, "swa_evicted_seqlen")
    return max(kv_field(req, "cache_protected_len"), kv_field(req, "swa_evict_floor")), hi


_PARAM_TYPES = {"r": str, "tokens": list, "toks": list, "times": int, "config": dict}


def _check_params(action: str, method: Any, params: dict[str, Any]) -> None:
    """A trace is user input: its parameter names and types are checked before the action runs,
    so that whatever raises inside it is SGLang's (a finding) or kvcheck's (cannot drive), never
    a bad parameter passed off as either."""
    try:
        inspect.signature(method).bind(**params)
    except TypeError as e:
        raise ActionRejected(f"bad parameters for {action}: {e}") from None
    for name, want in _PARAM_TYPES.items():
        v = params.get(name)
        if name in params and (type(v) is not want or (want is list and any(type(t) is not int for t in v))):
            raise ActionRejected(f"bad parameters for {action}: {name} must be "
                                 f"{'a list of ints' if want is list else want.__name__}, got {v!r:.60}")

