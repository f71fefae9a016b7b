"""The reference engine's cache manager: the prefix table of chained block hashes, per-block
object records over physical pools, pins and leases, requests, admission, versions and graphs.
The per-kind rules live in kinds.py (one class per object kind). CacheManager holds the records
and runs the request lifecycle; it composes collaborators that see it through the Protocols of
manager_state.py: `Structure` (structure.py), `Funnel` (funnel.py: the decision),
`TierCoordinator` (tier_coordinator.py), `SlotTable` and `Allocator` (slots.py).

Written as an implementation (hash table of chained block hashes, page handles with
generations, per-request block tables of pins, transfer futures), independently of the spec's
code: the spec is imported only for its vocabulary (config, state/decision/reason constants).
Checking this manager against the spec in lockstep is therefore a real conformance check.

Every operation first checks that it is allowed and raises `Refused` (mapped to the protocol's
ActionRejected by the adapter) without changing anything when it is not.
"""
from __future__ import annotations

from typing import Any

import torch

from kvcheck.spec.config import Config, Group
from kvcheck.spec.objects import (DECISIONS, PARTIAL, PREFETCH, R_BOUND, R_DECIDED, R_IDLE,
                                  R_PREEMPTED, R_RUNNING, R_WAITING, READY, REUSE, WRITING)

from . import faults as EF
from .funnel import Funnel
from .hashing import ExtraKeys, block_hashes
from .kinds import manager_for
from .pools import POOL_KINDS, PoolSet
from .records import BlockEntry, Decision, ObjRec, Refused, Request, Slots
from .slots import Allocator, SlotTable, content_key
from .structure import Structure
from .tier_coordinator import TierCoordinator
from .tiers import TierStore


class CacheManager:
    """Bookkeeping and device/tier data movement for one model (no model execution). It is
    the `ManagerState` and the `RequestOps` its collaborators are built with."""

    def __init__(self, cfg: Config, model_id: str, page_numel: dict[str, int],
                 fault: str | None = None, cache_dir: str | None = None) -> None:
        self.cfg, self.model_id = cfg, model_id
        self.planted = EF.planted(fault)
        self.B = cfg.block_size
        self.cur = {"ver": 0, "ix": 0, "cmp": 0, "abi": 0}
        self.structure = Structure(self)
        # physical slots: the admission cap (bounded for unlisted kinds) plus room for
        # compaction targets; occupancy is capped by cfg.cap, never by the slot count
        n_objs = sum(len(self.structure.block_kinds(j)) for j in range(cfg.blocks)) + 2
        cap = {k: min(cfg.cap(k), 8 * n_objs) for k in POOL_KINDS}
        pt = {k: cfg.block_size for k in POOL_KINDS}
        self.pools = PoolSet(cap, page_numel, pt, abi=0, spare=n_objs)
        self.tiers = TierStore(cache_dir, cfg.tiers) if cfg.offload_enabled else None
        self.entries: dict[str, BlockEntry] = {}
        self.requests: dict[int, Request] = {}
        self.inflight = 0
        self.graph: dict[str, Any] | None = None      # {"win" (per group), "pos", "ptrs": {ObjRec: (slot, gen)}}
        self.stats = {"lookups": 0, "logical_blocks": 0, "usable_blocks": 0, "decisions": {},
                      "degradations": {}, "transitions": {}}
        # the configurable semantics (slots.py): one physical block per position (prompts > 1),
        # blocks written from a partial block (decode), last use per block (LRU allocation)
        self.slots = Slots.make(cfg, self.structure.block_kinds) if cfg.prompts > 1 else None
        self.bpart = [0] * cfg.blocks
        self.last_use = [0] * cfg.blocks
        self.clock = 0
        self.base_hashes: list[str] = []
        self.coordinator = TierCoordinator(self, self.structure)
        self.funnel = Funnel(self, self.structure, self.coordinator)
        self.slot_table = SlotTable(self, self.structure)
        self.allocator = Allocator(self, self.structure, self.slot_table, self)

    # ---- pins ------------------------------------------------------------------------------
    def _set_pins(self, req: Request, new: frozenset[ObjRec] | set[ObjRec]) -> None:
        old = req.pins
        if old is new:
            return
        for o in old - new:
            o.ref -= 1
        for o in new - old:
            o.ref += 1
        req.pins = new

    def _release(self, req: Request) -> None:
        if self.planted(EF.REFCOUNT_DOUBLE_DECREMENT) and req.st == R_RUNNING:
            for o in req.pins:
                if o.kind == "tail":
                    o.ref -= 1
        self._set_pins(req, frozenset())
        req.bound_ptrs = {}

    def n_active(self) -> int:
        return sum(q.st in (R_BOUND, R_RUNNING) for q in self.requests.values())

    # ---- requests ----------------------------------------------------------------------------
    def hashes(self, tokens: list[int], n: int, extra: ExtraKeys) -> list[str]:
        """The chained block hashes of the first n blocks (as this engine, faults included,
        computes them)."""
        return block_hashes(tokens, self.B, n, extra, with_salt=not self.planted(EF.CACHE_SALT_MISSING),
                            chained=not self.planted(EF.HASH_IGNORES_PARENT))

    def submit(self, rid: int, tokens: list[int], n: int, extra: ExtraKeys, p: int = 0) -> Request:
        q = self.requests.get(rid)
        if q is not None and q.st != R_IDLE:
            raise Refused(f"request slot {rid} is busy")
        self.clock += 1
        req = Request(rid, list(tokens), n, self.hashes(tokens, n, extra), extra.cache_salt,
                      win=self.structure.window_starts(0), p=p, extra=extra, serial=self.clock)
        self.requests[rid] = req
        return req

    def probe_decision(self, tokens: list[int], n: int, extra: ExtraKeys) -> Decision:
        """What a lookup would answer for these tokens (no state change): isolation probes."""
        req = Request(-1, list(tokens), n, self.hashes(tokens, n, extra), extra.cache_salt)
        return self.funnel.decide(req)

    def lookup(self, rid: int) -> Decision:
        req = self.request_in(rid, (R_WAITING,))
        d = self.funnel.decide(req)
        req.st = R_WAITING if d.kind == PREFETCH else R_DECIDED
        req.dec, req.k = d.kind, (0 if d.kind == PREFETCH else d.k)
        req.lease = dict(self.cur)
        s = self.stats
        s["lookups"] += 1
        s["logical_blocks"] += d.logical
        s["usable_blocks"] += d.k if d.kind in (REUSE, PARTIAL) else 0
        s["decisions"][DECISIONS[d.kind]] = s["decisions"].get(DECISIONS[d.kind], 0) + 1
        for name in d.to_dict()["reasons"]:
            s["degradations"][name] = s["degradations"].get(name, 0) + 1
        return d

    def request_in(self, rid: int, states: tuple[int, ...]) -> Request:
        """Request rid, refused unless it is in one of `states`."""
        q = self.requests.get(rid)
        if q is None or q.st not in states:
            raise Refused(f"request {rid} is not in a state that allows this")
        return q

    def lease_current(self, req: Request) -> bool:
        return req.lease == self.cur

    def bind_valid(self, req: Request) -> bool:
        """The lease's versions, the funnel at k and (prompts > 1: blocks may have been reused
        for other content since the lookup) the published hashes still covering k blocks."""
        if self.slots is not None and self.funnel.logical_hit(req) < req.k:
            return False
        return self.lease_current(req) and self.funnel.funnel_ok_at(req, req.k)

    def bind(self, rid: int) -> None:
        """Check + pin, atomic: re-run the funnel at k under the lease's versions, then pin."""
        req = self.request_in(rid, (R_DECIDED,))
        if self.n_active() >= self.cfg.max_active:
            raise Refused("admission: max_active requests hold leases")
        if not self.bind_valid(req):
            raise Refused("the decision no longer holds (bind_stale)")
        if self.planted(EF.HASHES_PUBLISHED_EARLY):
            for j in range(req.n):
                self.structure.entry(req.hashes[j], j).published = True
        req.st, req.pos, req.win = R_BOUND, req.k, self.structure.window_starts(req.k)
        self.clock += 1
        for j in range(req.k):
            self.last_use[j] = self.clock
        if req.tok:                         # a partial decoded block is recomputed from the hit
            del req.tokens[req.n * self.B:req.n * self.B + req.tok]
            req.tok = 0
        self._set_pins(req, self.structure.holding(req, req.win, req.pos))
        req.bound_ptrs = {o: (o.page, o.page.gen) for o in req.pins if o.page is not None}

    def bind_stale(self, rid: int) -> None:
        req = self.request_in(rid, (R_DECIDED,))
        if self.bind_valid(req):
            raise Refused("the decision still holds")
        req.st = R_WAITING

    def use_valid(self, req: Request) -> bool:
        """Re-validate at use: lease versions and the data pointers bound."""
        if self.planted(EF.NO_REVALIDATION_AT_USE):
            return True
        if not self.lease_current(req):
            return False
        return all(o.page is p and p.gen == gen and not p.freed for o, (p, gen) in req.bound_ptrs.items())

    def use(self, rid: int) -> None:
        req = self.request_in(rid, (R_BOUND,))
        if not self.use_valid(req):
            raise Refused("lease stale at use")
        req.st = R_RUNNING

    def use_stale(self, rid: int) -> bool:
        """The scheduler's use found the lease stale: unpin and fall back to a new lookup.
        Returns False when the engine ran the request instead (it judged the lease valid)."""
        req = self.request_in(rid, (R_BOUND,))
        if self.lease_current(req) and all(o.page is p and p.gen == gen and not p.freed
                                           for o, (p, gen) in req.bound_ptrs.items()):
            raise Refused("lease still valid")
        if self.planted(EF.NO_REVALIDATION_AT_USE):
            req.st = R_RUNNING                  # the faulty engine never notices the lease is stale
            return False
        req.st = R_WAITING
        self._release(req)
        return True

    def _pool_for(self, kind: str):
        if kind == "swa_window" and self.planted(EF.SHARED_FREE_LIST):
            return self.pools["tail"]
        return self.pools[kind]

    def write_plan(self, req: Request, j: int, key: str | None = None, prefix: tuple[int, ...] | None = None
                   ) -> tuple[BlockEntry, dict, dict[str, int], bool]:
        """What writing request req's block j takes: (its entry, which objects are rewritten,
        new objects per kind, whether the block holds other content). Refused while an object
        to rewrite is pinned (nothing changed)."""
        st = self.structure
        e = st.entry(key or req.hashes[j], j)
        other = self.slot_table.other_content(prefix or content_key(req.salt, req.tokens[:(j + 1) * self.B]), j)
        rewrite = {}
        fresh: dict[str, int] = {}
        for gk, o in e.objs.items():
            rw = other or not (o.live and o.ver == st.version_of(o.kind) and o.abi == self.cur["abi"])
            if rw and (o.ref > 0 or st.graph_pinned(o)):
                raise Refused(f"{o.kind} of block {j} must be rewritten but is pinned")
            rewrite[gk] = rw
            if not o.live:
                fresh[o.kind] = fresh.get(o.kind, 0) + 1
        return e, rewrite, fresh, other

    def append(self, rid: int, j: int, data: dict[tuple[int, str], torch.Tensor], key: str | None = None,
               prefix: tuple[int, ...] | None = None, decoding: bool = False, done: bool = True) -> None:
        """Write block j of a running request: raw KV pages and tails now; compressed entries and
        indexer keys are staged (WRITING) until compress / indexer_sync. Publishes the hash.
        `decoding`: block j = n filled by decode (decode.py), under `key` computed from `prefix`;
        `done` False only for a planted fault's write of a partial block."""
        req = self.request_in(rid, (R_RUNNING,))
        if req.pos != j or (j != req.n if decoding else j >= req.n):
            raise Refused(f"request {rid} is at block {req.pos}, not {j}")
        e, rewrite, fresh, other = self.write_plan(req, j, key, prefix)
        if not self.planted(EF.ADMISSION_CAP_IGNORED) and not self.allocator.fits(fresh):
            raise Refused("admission: a pool is full")
        for gk, o in e.objs.items():
            flat = data[gk]
            if rewrite[gk]:
                if o.page is not None:
                    o.page.pool.free(o.page)
                pool = self._pool_for(o.kind)
                o.page = pool.alloc()
                o.pool_id, o.aln = pool.pool_id, 1
                o.ver, o.abi = self.structure.version_of(o.kind), self.cur["abi"]
                if manager_for(o.kind).staged:
                    o.page.pool.write(o.page, torch.zeros(0), 0)
                    o.staged, o.state = flat, WRITING
                else:
                    o.page.pool.write(o.page, flat, self.structure.shift(o.kind))
                    o.state = READY
                o.epoch = self.cur["ver"]
                self.structure.count(f"{o.kind}:append")
            elif self.bpart[j] or (o.epoch != self.cur["ver"]
                                   and not self.planted(EF.ENTRIES_KEPT_ACROSS_WEIGHT_UPDATE)):
                # current by its own version stamp but computed under older weights (entries
                # depend on the layer input), or from a partial block: refresh the bits in place.
                if o.state == WRITING:
                    o.staged = flat
                else:
                    o.page.pool.write(o.page, flat, self.structure.shift(o.kind))
                o.epoch = self.cur["ver"]
        self.slot_table.publish(j, e, prefix or content_key(req.salt, req.tokens[:(j + 1) * self.B]), other)
        if decoding:
            self.bpart[j] = int(not done)
        if done:
            self._set_pins(req, self.structure.holding(req, req.win, j + 1))
            req.pos = j + 1

    def slide(self, rid: int) -> None:
        req = self.request_in(rid, (R_RUNNING,))
        starts = self.structure.window_starts(req.pos)
        if not any(new > old for new, old in zip(starts, req.win)):
            raise Refused("nothing to slide")
        req.win = starts                    # each group unpins the pages below its own window
        self._set_pins(req, self.structure.holding(req, starts, req.pos))

    def finish(self, rid: int) -> None:
        req = self.request_in(rid, (R_RUNNING,))
        if req.pos != req.n:
            raise Refused("request not finished")
        self._release(req)
        req.st = R_IDLE

    def preempt(self, rid: int) -> None:
        req = self.request_in(rid, (R_DECIDED, R_BOUND, R_RUNNING))
        self._release(req)
        req.st = R_PREEMPTED

    def resume(self, rid: int) -> None:
        self.request_in(rid, (R_PREEMPTED,)).st = R_WAITING

    # ---- objects -----------------------------------------------------------------------------
    def compress(self, o: ObjRec) -> None:
        if o.state != WRITING:
            raise Refused("no entry being compressed")
        o.page.pool.write(o.page, o.staged, self.structure.shift(o.kind, abi=o.abi, cmp=o.ver, ix=o.ver))
        o.staged, o.state = None, READY
        self.structure.count(f"{o.kind}:writing->ready")

    def migrate(self, o: ObjRec) -> None:
        if o.state != READY or o.ref > 0:
            raise Refused("not movable")
        if self.structure.graph_pinned(o) and not self.planted(EF.GRAPH_PAGES_MIGRATED):
            raise Refused("referenced by a captured graph")
        o.page.pool.move(o.page)
        o.moved, o.aln = 1, int(o.page.aligned)
        self.structure.count(f"{o.kind}:migrate")

    # ---- versions and graphs ---------------------------------------------------------------------
    def bump(self, field_: str) -> None:
        if self.cur[field_] >= self.cfg.max_version:
            raise Refused("version bound reached")
        self.cur[field_] += 1
        if field_ == "abi":
            self.pools.set_abi(self.cur["abi"])
        for q in self.requests.values():
            if q.st == R_RUNNING:
                self._release(q)
                q.st = R_PREEMPTED

    def capture(self, rid: int) -> None:
        req = self.request_in(rid, (R_RUNNING,))
        if self.graph is not None:
            raise Refused("a graph is live")
        self.graph = {"win": req.win, "pos": req.pos}
        for e in self.entries.values():
            for o in e.objs.values():
                o.moved = 0
        self.graph["ptrs"] = {o: (o.page.slot, o.page.gen) for e in self.entries.values()
                              for o in e.objs.values() if self.structure.graph_pinned(o) and o.page is not None}

    def release_graph(self) -> None:
        if self.graph is None:
            raise Refused("no graph")
        self.graph = None

    # ---- the collaborators' operations the adapter and the engine call -------------------------
    def block_kinds(self, j: int) -> list[tuple[int, str]]:
        return self.structure.block_kinds(j)

    def entry(self, key: str, j: int) -> BlockEntry:
        return self.structure.entry(key, j)

    def obj(self, req: Request, g: int, kind: str, j: int) -> ObjRec | None:
        return self.structure.obj(req, g, kind, j)

    def recovery_set(self, g: Group, k: int) -> list[tuple[str, int]]:
        return self.structure.recovery_set(g, k)

    def shift(self, kind: str, abi: int | None = None, cmp: int | None = None, ix: int | None = None) -> int:
        return self.structure.shift(kind, abi, cmp, ix)

    def set_base(self, prefix: list[int], hashes: list[str], salt: str = "") -> None:
        self.slot_table.set_base(prefix, hashes, salt)

    def slot_published(self, j: int) -> bool:
        return self.slot_table.slot_published(j)

    def drop_hash(self, j: int) -> None:
        self.slot_table.drop_hash(j)

    def append_evict(self, rid: int, j: int, data: dict[tuple[int, str], torch.Tensor]) -> int:
        return self.allocator.append_evict(rid, j, data)

    def append_fail(self, rid: int, j: int) -> int:
        return self.allocator.append_fail(rid, j)

    def evict(self, o: ObjRec) -> None:
        self.allocator.evict(o)

    def offload_start(self, e: BlockEntry) -> None:
        self.coordinator.offload_start(e)

    def offload_ack(self, e: BlockEntry) -> None:
        self.coordinator.offload_ack(e)

    def prefetch_start(self, e: BlockEntry) -> None:
        self.coordinator.prefetch_start(e)

    def prefetch_complete(self, e: BlockEntry) -> None:
        self.coordinator.prefetch_complete(e)

    def verify(self, e: BlockEntry, aligned: int, want_ok: bool | None = None) -> bool:
        return self.coordinator.verify(e, aligned, want_ok)

    def corrupt(self, e: BlockEntry) -> None:
        self.coordinator.corrupt(e)

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()

