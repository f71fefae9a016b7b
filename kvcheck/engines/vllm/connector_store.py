"""kvcheck's side of the KV connector (connector.py): what the external store holds and the
transfers in flight, on the adapter's timeline, per KV cache group.

A stored block is keyed by its group and the prefix it holds (salt, tokens up to its end); its
value says whether the bytes copied were that prefix (a block vLLM reallocated before a delayed
store copied it stores a torn prefix). Loads write what the store holds into the non-null blocks
vLLM allocated for the external tokens; everything is a stable function of the request id, its
attempt and its preemptions, so a replay makes the same transfers.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .checks import Req
from .connector import stable

WHOLE = -1      # Load.failed: the whole load failed (failed_recving), not one block


@dataclass
class Load:
    rid: str
    lo: int                    # the local hit: the load covers tokens [lo, hi)
    hi: int
    sync: bool
    due: int                   # async: the step whose output reports it finished
    failed: int | None = None  # group 0's table index of the block whose load fails, or WHOLE


@dataclass
class Send:
    rid: str
    items: list[tuple[int, int, int]]      # (group, block end, block id) stored
    due: int
    keys: list[tuple] = field(default_factory=list)


class Store:
    """The store (key -> bytes sound) and the transfers in flight."""

    def __init__(self, ad: Any) -> None:
        self.ad = ad
        self.bs = [bs for _, bs, _ in ad.groups]
        self.unit = math.lcm(*self.bs)            # a hybrid hit's alignment: every group's block
        self.single = len(self.bs) == 1
        from vllm.v1.outputs import KVConnectorOutput
        import inspect
        # a load may fail whole where the release lets a connector say so (failed_recving, 0.32+)
        self.whole_ok = "failed_recving" in inspect.signature(KVConnectorOutput).parameters
        self.held: dict[tuple, bool] = {}
        self.offer: dict[str, tuple[int, bool]] = {}   # rid -> (its local hit, load async) offered
        self.loads: dict[str, Load] = {}
        self.sends: dict[str, Send] = {}
        self.reported: set[str] = set()        # loads reported done in an output vLLM has not taken yet
        self.tries: Counter = Counter()        # rid -> loads allocated (a failed whole load is retried)
        self.failed: dict[int, str] = {}       # block -> how its failed load was reported (until written)
        self.sync_failed: set[int] = set()     # this step's failed sync-load blocks (to report)
        self.step = 0

    def _key(self, g: int, req: Req, end: int) -> tuple:
        salt, p = self.ad._content(req, end)           # (a content.Prefix: compared by its key)
        return g, salt, p.key

    def _need(self, g: int, lo: int, n: int) -> list[int]:
        """Group g's blocks a load of tokens [lo, n) must fill: every block vLLM allocates for them,
        by the group manager's own rule (``get_num_skipped_tokens``: a window's older blocks are
        skipped, given the null block)."""
        bs = self.bs[g]
        skipped = self.ad.coord.single_type_managers[g].get_num_skipped_tokens(n)
        return list(range(max(lo, skipped) // bs, n // bs))

    # ---- the scheduler side ------------------------------------------------------------------
    def matched(self, request: Any, local: int) -> tuple[int, bool]:
        rid = request.request_id
        req, u = self.ad.reqs.get(rid), self.unit
        if req is None or local % u:
            return 0, False
        best, n = local, local + u
        while n <= request.num_tokens - 1:
            ok = [all(self.held.get(self._key(g, req, (i + 1) * self.bs[g])) is not None for i in self._need(g, local, n))
                  for g in range(len(self.bs))]
            if all(ok):
                best = n
            elif any(not ok[g] for g, (k, _, _) in enumerate(self.ad.groups) if k in ("full", "mla")):
                break                        # (a full group's run of stored blocks ended: none longer)
            n += u
        if best == local:
            return 0, False
        self.offer[rid] = (local, stable(rid, request.num_preemptions, "async") % 2 == 0)
        return best - local, self.offer[rid][1]

    def allocated(self, request: Any, blocks: Any, ext: int) -> None:
        rid = request.request_id
        offer = self.offer.pop(rid, None)
        if ext <= 0 or offer is None:
            return
        lo, sync = offer[0], not offer[1]
        self.tries[rid] += 1
        h = stable(rid, request.num_preemptions, "load", *([self.tries[rid]] if self.tries[rid] > 1 else []))
        load = Load(rid, lo, lo + ext, sync, self.step + 1 + h % 3)
        if not sync and h % 4 == 0:
            self._fail_one(load, h)
        self.loads[rid] = load

    def _fail_one(self, load: Load, h: int) -> None:
        """The load fails one of its blocks (which one: a stable function `h` of the request), or,
        async and where the release can hear it, whole (a hybrid's always: vLLM cannot map a block
        id to a group; a one-group load's in half the cases); a hybrid's sync load never fails."""
        if not load.sync and self.whole_ok and (not self.single or (h >> 8) % 2):
            load.failed = WHOLE
            return
        if not self.single:
            load.failed = None
            return
        first, last = load.lo // self.bs[0], load.hi // self.bs[0]
        load.failed = first + (h >> 4) % max(1, last - first)

    def finished(self, request: Any, block_ids: tuple[list[int], ...]) -> bool:
        """Store the request's full blocks (each group's non-null ones); True: hold them until the
        worker reports the copy done (also while a load into them is still in flight)."""
        rid = request.request_id
        req = self.ad.reqs.get(rid)
        self.ad._accept(rid)       # (drafts the step's sampler accepted: written by its forward, already)
        if rid in self.reported:   # (async scheduling: the load's report is on its way; vLLM frees the
            return True            # aborted request's blocks when it arrives: nothing to store)
        loading = rid in self.loads and not self.loads[rid].sync
        if req is None:
            return loading
        # The send holds the request's full blocks (vLLM delays their free until finished_sending); it
        # stores those whose KV the worker has computed: under async scheduling num_computed_tokens
        # counts the frame still in flight, placeholders whose KV no forward has finished (vLLM's own
        # safe frontier, num_computed_tokens - num_output_placeholders)
        full = min(request.num_computed_tokens, request.num_tokens)
        done = min(full - getattr(request, "num_output_placeholders", 0), full)
        items, keys, held = [], [], False
        for g, ids in enumerate(block_ids):
            bs = self.bs[g]
            nulls = {b.block_id for b in self.ad._table(g, rid) if b.is_null}
            for i in range(min(full // bs, len(ids))):
                key = self._key(g, req, (i + 1) * bs)
                if ids[i] not in nulls and self.held.get(key) is None:
                    held = True
                    if (i + 1) * bs <= done:
                        items.append((g, (i + 1) * bs, ids[i]))
                        keys.append(key)
        if not held and not loading:
            return False
        delayed = loading or stable(rid, "send") % 2 == 0
        send = Send(rid, items, self.step + 1 + stable(rid, "due") % 2, keys)
        if not delayed:
            self._copy(send, req)
            return False
        self.sends[rid] = send
        return True

    def _copy(self, send: Send, req: Any) -> None:
        tl = self.ad.timeline
        for (_, end, bid), key in zip(send.items, send.keys):
            sound = req is not None and tl.holds(bid, self.ad._content(req, end))
            self.held.setdefault(key, sound)

    # ---- the worker side ---------------------------------------------------------------------
    def before_forward(self, so: Any) -> None:
        """Synchronous loads of the requests this step runs: written before the forward reads. One
        in four fails one block (one-group layouts, knob ``sync_fail``): reported in this step's
        ``invalid_block_ids``; the forward runs anyway on the garbage (vLLM then discards the
        request's output and recomputes from the failed block), so what the request writes is torn."""
        for rid in so.num_scheduled_tokens:
            load = self.loads.get(rid)
            if load is not None and load.sync:
                del self.loads[rid]
                h = stable(rid, load.lo, load.hi, "sync-fail")
                if self.ad.knobs.sync_fail and self.single and h % 4 == 0:
                    self._fail_one(load, h)
                bad = self._write(load)
                if bad is not None:
                    self.sync_failed.add(bad)
        # vLLM discards the output of every running request holding a failed block (the loader, and
        # any that hit it in the step: _update_requests_with_invalid_blocks); their forward ran on it
        for rid in so.num_scheduled_tokens if self.sync_failed else ():
            if any(b.block_id in self.sync_failed for b in self.ad._table(0, rid)):
                self.ad.timeline.discarded.add(rid)

    def output(self) -> dict[str, Any]:
        """The worker's ``kv_connector_output`` for this step: finished async loads (their bytes
        written now, a failed block's never; a whole failed load in failed_recving too) and
        finished stores."""
        self.step += 1
        recving, sending, invalid, failed = set(), set(), set(self.sync_failed), set()
        self.sync_failed = set()
        for rid, load in list(self.loads.items()):
            if load.sync or load.due > self.step:
                continue
            del self.loads[rid]
            if rid in self.sends:                # aborted while loading: the blocks were held for it
                continue
            bad = self._write(load)
            if load.failed == WHOLE:
                failed.add(rid)
            elif bad is not None:
                invalid.add(bad)
            recving.add(rid)
        self.reported |= recving
        for rid, send in list(self.sends.items()):
            if send.due > self.step or rid in self.loads:
                continue
            del self.sends[rid]
            self._copy(send, self.ad.reqs.get(rid))
            sending.add(rid)
        return {"finished_recving": recving or None, "finished_sending": sending or None,
                "invalid_block_ids": invalid, "failed_recving": failed}

    def delivered(self) -> None:
        """vLLM took the outputs built so far (update_from_output): their load reports are its own."""
        self.reported.clear()

    def _blocks(self, load: Load) -> list[tuple[int, int, Any]]:
        """(group, table index, block) a load fills: each group's non-null blocks of [lo, hi)."""
        out = []
        for g, bs in enumerate(self.bs):
            table = self.ad._table(g, load.rid)
            out += [(g, i, table[i]) for i in range(load.lo // bs, min(len(table), load.hi // bs))
                    if not table[i].is_null]
        return out

    def _write(self, load: Load) -> int | None:
        """The load's blocks receive what the store holds; returns the failed block's id (a whole
        failed load writes nothing: its blocks stay as they were)."""
        ad, bad = self.ad, None
        req = ad.reqs.get(load.rid)
        if req is None:
            return None
        for g, i, b in self._blocks(load):
            if load.failed == WHOLE or (g == 0 and i == load.failed):
                bad = b.block_id
                self.failed[bad] = "failed_recving (the whole load)" if load.failed == WHOLE else "invalid_block_ids"
                continue
            self.failed.pop(b.block_id, None)
            end = (i + 1) * self.bs[g]
            sound = self.held.get(self._key(g, req, end))
            ad.timeline.ready[b.block_id] = ad._content(req, end) if sound else _torn()
            ad.timeline.cancelled.pop(b.block_id, None)
            ad.timeline.garbled.pop(b.block_id, None)
            ad.timeline.late.pop(b.block_id, None)
        return bad

    def loading(self) -> set[int]:
        """Blocks an asynchronous load in flight is still to fill."""
        return {b.block_id for load in self.loads.values() if not load.sync for _, _, b in self._blocks(load)}

    def busy(self) -> bool:
        """A transfer holds blocks outside the running requests (an async load, loaded blocks of a
        request not scheduled yet, a delayed store)."""
        return bool(self.sends) or any(not x.sync for x in self.loads.values()) or any(
            r.state != "running" and any(self.ad._table(g, rid) for g in range(len(self.bs)))
            for rid, r in self.ad.reqs.items())


def _torn() -> tuple:
    from .timeline import TORN
    return TORN
