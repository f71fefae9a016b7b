"""When the bytes of a vLLM KV block exist: published at schedule time, written by the forward.

vLLM publishes a block (inserts its hash into the prefix-cache map) inside ``allocate_slots``,
at schedule time (``kv_cache_manager.py``: ``coordinator.cache_blocks(request,
num_tokens_to_cache)``), but the KV of the tokens scheduled in a step is written only by that
step's forward pass. The content shadow model (checks.py) stamps what a block *will* hold
once its writer's forward runs; this module keeps what it *does* hold (``ready``) on a
timeline of steps and checks every forward's reads against it.

The contract, from vLLM's code (cited in docs/adapters-vllm.md, "Steps and the timeline"):
a reader in the same forward as the writer is safe, since every attention layer writes the
whole batch's new KV before it attends; a reader in a later forward is safe; a copy
(copy-on-write of a partial hit, the move of a Mamba partial-tail entry) runs before the
forward, so it copies only what earlier forwards wrote, and so does the step's Mamba state copy
(worker ``preprocess_mamba``) — which is why vLLM refuses a hit on a Mamba state published in the
same step (``MambaManager``, ``cached_blocks_this_step``; mamba_worker.run_states checks it); a
write that never runs (its request unscheduled after ``allocate_slots`` — the PRIORITY scheduler
preempting a request it already scheduled in this step) leaves a published block without its
bytes. A forward's read of KV bytes that are not there is the safety finding
``read_before_write``; a copy's source without the bytes it claims, ``state_copy_sound``.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from . import mamba, mamba_worker
from .checks import Violation
from .layouts import cdiv


TORN = ("<torn>", ())      # a block whose bytes mix two requests' prefixes: holds no prefix


class Timeline:
    """Steps (schedule, then the forward completes) and the bytes each block holds.
    `split` (the planted fault ``early_reader_forward``): the requests admitted in a step run
    in a forward of their own *before* the running requests' forward."""

    def __init__(self, ad: Any, split: bool = False) -> None:
        self.ad, self.split = ad, split
        self.open = False
        self.sched: dict[str, list] = {}        # rid -> [lo, hi, tok, admitted] in the open step
        self.ready: dict[int, tuple] = {}       # block id -> (salt, tokens) its bytes hold
        self.verified: dict[str, set] = {}      # rid -> {(g, i, block id)} full blocks proven
        self.copies: list[tuple] = []           # (src, dst, claim, exact) block copies of the open step
        self.preempted = self.admitted = False  # in the open step (the scheduler's order)
        self.cancelled: dict[int, str] = {}     # block id -> the request whose promised write never ran
        self.mamba_idx: dict[str, int] = {}     # rid -> the worker's running-state index (mamba_worker.py)
        self.mamba_acc: dict[str, int] = {}     # rid -> tokens its last step accepted (1: no drafts)
        self.mamba_spec: dict[str, tuple] = {}  # rid -> (known end, drafts) of the open step, to settle
        self.stats: Counter = Counter()
        self.discarded: set[str] = set()        # requests whose forward output vLLM discards (a failed sync load)
        self.garbled: dict[int, str] = {}       # block id -> the discarded request whose forward wrote it
        self.late: dict[int, tuple[str, str, str]] = {}   # block id -> (in-flight writer, new owner, how freed): engine_async._land_late

    # ---- the step ----------------------------------------------------------------------
    def begin(self) -> None:
        self.open, self.sched, self.copies = True, {}, []
        self.preempted = self.admitted = False
        self.stats["steps"] += 1

    def scheduled(self, rid: str, lo: int, hi: int, tok: int | None = None, admitted: bool = False,
                  drafts: int = 0) -> None:
        """`rid` computes tokens [lo, hi) in this step's forward (allocate_slots succeeded), and
        `drafts` draft positions after them (their KV and states kept once accepted)."""
        self.sched[rid] = [lo, hi, tok, admitted, drafts]
        self.admitted |= admitted

    def unschedule(self, rid: str) -> bool:
        """The scheduler took `rid` out of the step after allocating it (PRIORITY preemption):
        its blocks stay published, their writes never run."""
        self.preempted = True
        if self.sched.pop(rid, None) is None:
            return False
        self.stats["writes_cancelled"] += 1
        ad = self.ad
        self.cancel(rid, [b for g in range(len(ad.groups)) for b in ad._table(g, rid)])
        return True

    def cancel(self, rid: str, blocks: list) -> None:
        """`rid` leaves the step after its allocation (preempted): the blocks it was to write
        (promised content its bytes lack) will not get it from this step. Kept to name the cause
        when a later read or copy meets one (popped when the block is written)."""
        for b in blocks:
            w = None if b.is_null else self.ad.written.get(b.block_id)
            if w is not None and not mamba.holds(self.ready.get(b.block_id), w, False):
                self.cancelled[b.block_id] = rid

    def cause(self, bid: int) -> str:
        """Why block `bid` lacks its bytes, when the timeline knows (else "")."""
        store = self.ad.store
        if store is not None and bid in store.loading():
            return " (a KV connector load into it is still in flight: its bytes have not arrived)"
        if store is not None and bid in store.failed:
            return f" (a KV connector load into it failed, reported in {store.failed[bid]}, and nothing wrote it since)"
        if bid in self.garbled:
            return (f" (written by a forward whose output vLLM discarded after a failed KV connector load: "
                    f"{self.garbled[bid]} attended to the failed block, so what it wrote is not that KV)")
        if bid in self.late:
            old, new, how = self.late[bid]
            return (f" (the in-flight forward of {old} wrote it after {new}'s KV connector load: vLLM {how}, "
                    f"with that forward still running, and handed it to {new})")
        rid = self.cancelled.get(bid)
        return "" if rid is None else (f" (its writer {rid} was preempted in the step whose allocation "
                                       "published it: that write never ran)")

    def write_accepted(self, rid: str, lo: int, hi: int) -> None:
        """The forward also wrote draft positions [lo, hi) that the sampler then accepted (their
        tokens known only after ``update_from_output``): their bytes hold the request's prefix."""
        self._write(rid, lo, hi)

    def forget(self, rid: str) -> None:
        """`rid`'s blocks were freed (finished, preempted: vLLM's worker drops its state index too)."""
        self.verified.pop(rid, None)
        self.mamba_idx.pop(rid, None)
        self.mamba_acc.pop(rid, None)
        self.mamba_spec.pop(rid, None)

    def copy(self, src: int, dst: int, claim: tuple, exact: bool) -> None:
        """A block copy the step runs before its forward (vLLM's ``kv_cache_block_copies``): the
        destination is to receive `claim` (a state exactly, or a KV prefix)."""
        self.copies.append((src, dst, claim, exact))

    def forward(self) -> list[tuple[str, int | None]]:
        """The open step's forward completes: its copies run, then its writes, and every read is
        checked. Returns (rid, sampled token or None) of the requests it ran, in order."""
        items, copies = list(self.sched.items()), self.copies
        phases = ([[x for x in items if x[1][3]], [x for x in items if not x[1][3]]] if self.split
                  else [items])
        self.open, self.sched, self.copies = False, {}, []
        self.preempted = self.admitted = False
        for src, dst, claim, exact in copies:       # _update_states: the queued copies, first
            if not mamba.holds(self.ready.get(src), claim, exact):
                writer = self.writer(items, src)
                why = (f"published in this step: {writer}'s allocation in it published the block, and the "
                       "forward that writes it runs after the copy" if writer is not None else
                       "published before this step: " + ("no forward has written it" if src not in self.ready
                                                         else "the last forward that wrote it wrote another prefix"))
                raise Violation("safety", "state_copy_sound",
                                f"{self.ad.layout}: the step copies block #{src} -> #{dst} before its forward, "
                                "but the source's bytes are " + ("not written yet" if src not in self.ready else
                                                                 "not what the copy claims") + f" ({why})"
                                + self.cause(src))
            self.ready[dst] = claim
            self.cancelled.pop(dst, None)
            self.garbled.pop(dst, None)
        if self.ad.has_mamba:        # preprocess_mamba: the state copies, then the forward's states
            mamba_worker.run_states(self.ad, self, items)
        lost, self.discarded = self.discarded, set()
        for phase in phases:
            for rid, (lo, hi, *_) in phase:
                self._write(rid, lo, hi, rid in lost)
            for rid, (lo, *_) in phase:
                if rid not in lost:       # (a failed sync load: the request attends to garbage, and vLLM
                    self._check_reads(rid, lo)   # discards its output; what it wrote is torn)
        self.stats["forwards"] += 1
        return [(rid, x[2]) for rid, x in items]

    def writer(self, items: list, bid: int) -> str | None:
        """The request of the step `items` whose forward writes block `bid` (a KV block covering
        its tokens [lo, hi), or its Mamba state block at hi): the step that published it."""
        ad = self.ad
        for rid, (lo, hi, _, _, drafts) in items:
            req = ad.reqs.get(rid)
            for g, (kind, bs, _) in enumerate(ad.groups if req is not None else ()):
                table = ad._table(g, rid)
                span = [cdiv(hi + drafts, bs) - 1] if kind == mamba.MAMBA else range(lo // bs, cdiv(hi, bs))
                if any(i < len(table) and table[i].block_id == bid and bid in req.owned[g] for i in span):
                    return rid
        return None

    # ---- bytes -------------------------------------------------------------------------
    def _write(self, rid: str, lo: int, hi: int, garbage: bool = False) -> None:
        ad = self.ad
        req = ad.reqs.get(rid)
        if req is None:
            return
        for g, (kind, bs, _) in enumerate(ad.groups):
            if kind == mamba.MAMBA:                   # (state blocks: mamba_worker.run_states)
                continue
            table = ad._table(g, rid)
            for i in range(lo // bs, min(len(table), cdiv(hi, bs))):
                b = table[i]
                if not b.is_null and b.block_id in req.owned[g]:
                    # tokens [lo, hi) go in; what the block holds before lo must be this request's
                    # own prefix (a copy-on-write block: the copy's), else the block is torn
                    ok = not garbage and (i * bs >= lo or self.holds(b.block_id, ad._content(req, lo)))
                    new = ad._content(req, min((i + 1) * bs, hi)) if ok else TORN
                    # (slots past hi keep their bytes: a block that held a longer prefix extending the
                    # one written -- a request recomputing what a load already filled -- still holds it)
                    if not ok or not self.holds(b.block_id, new):
                        self.ready[b.block_id] = new
                    if garbage:
                        self.garbled[b.block_id] = rid
                    elif hi >= (i + 1) * bs:          # (a partial rewrite leaves the garbage past hi)
                        self.garbled.pop(b.block_id, None)
                    self.cancelled.pop(b.block_id, None)
                    self.late.pop(b.block_id, None)
                    if ad.store is not None:
                        ad.store.failed.pop(b.block_id, None)

    def holds(self, bid: int, want: tuple) -> bool:
        """Do block `bid`'s bytes hold the prefix `want` (salt, tokens)?"""
        return mamba.holds(self.ready.get(bid), want, False)

    def _check_reads(self, rid: str, lo: int) -> None:
        """The tokens [lo, ...) of `rid` attend to the blocks its next token at lo reads; every
        one must hold the request's prefix now (after this forward's writes)."""
        ad = self.ad
        req = ad.reqs.get(rid)
        if req is None:
            return
        seen = self.verified.setdefault(rid, set())
        for g, (kind, bs, _) in enumerate(ad.groups):
            if kind == mamba.MAMBA:                   # (checked by mamba_worker.run_states)
                continue
            table = ad._table(g, rid)
            for i in ad.needed_running(g, lo):
                b = table[i] if i < len(table) else None
                if b is None or b.is_null:      # missing or nulled: toctou_bound_stable's finding
                    continue
                key = (g, i, b.block_id)
                if key in seen:
                    continue
                end = min((i + 1) * bs, lo)
                if not self.holds(b.block_id, ad._content(req, end)):
                    raise Violation("safety", "read_before_write",
                                    f"{ad.layout} group {g} ({kind}): the forward of {rid} (tokens from {lo}) "
                                    f"reads block #{b.block_id} (tokens {i * bs}..{end - 1}), whose bytes do "
                                    "not hold that prefix: it was published at schedule time, and the "
                                    "forward that writes it had not run before this read (or never ran)"
                                    + self.cause(b.block_id))
                if end == (i + 1) * bs:
                    seen.add(key)

    def pending_hits(self, req: Any, blocks: Any, hit: int) -> int:
        """Hit blocks whose bytes are not there yet (published in the open step): counted."""
        n = 0
        for g, lst in enumerate(blocks.blocks):
            kind, bs, _ = self.ad.groups[g]
            for i, b in enumerate(lst):
                end, exact = mamba.block_want(kind, bs, i, hit)
                if not b.is_null and not mamba.holds(self.ready.get(b.block_id), self.ad._content(req, end), exact):
                    n += 1
        return n
