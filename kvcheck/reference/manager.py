"""The reference engine's cache manager: the prefix table of chained block hashes, per-block
object records over physical pools, pins and leases, requests, admission, versions and graphs.
The per-kind rules live in kinds.py (one class per object kind), the funnel and the decision
in funnel.py, the tier coordinator in tier_coordinator.py; CacheManager composes them.

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
from kvcheck.spec.objects import (D_OFFLOADING, DECISIONS, EVICTED, PARTIAL, PREFETCH, R_BOUND,
                                  R_DECIDED, R_IDLE, R_PREEMPTED, R_RUNNING, R_WAITING, READY,
                                  REUSE, WRITING, block_objects)

from . import faults as EF
from .funnel import FunnelMixin
from .hashing import ExtraKeys, block_hashes
from .kinds import manager_for
from .pools import POOL_KINDS, PoolSet, encode_shift
from .records import BlockEntry, Decision, ObjRec, Refused, Request
from .tier_coordinator import TierMixin
from .tiers import TierStore

class CacheManager(FunnelMixin, TierMixin):
    """Bookkeeping and device/tier data movement for one model (no model execution)."""

    def __init__(self, cfg: Config, model_id: str, page_numel: dict[str, int],
                 fault: str | None = None, cache_dir: str | None = None) -> None:
        self.cfg, self.model_id = cfg, model_id
        self.planted = EF.planted(fault)
        self.B = cfg.block_size
        self.cur = {"ver": 0, "ix": 0, "cmp": 0, "abi": 0}
        # physical slots: the admission cap (bounded for unlisted kinds) plus room for
        # compaction targets; occupancy is capped by cfg.cap, never by the slot count
        n_objs = sum(len(self.block_kinds(j)) for j in range(cfg.blocks)) + 2
        cap = {k: min(cfg.cap(k), 8 * n_objs) for k in POOL_KINDS}
        pt = {k: cfg.block_size for k in POOL_KINDS}
        self.pools = PoolSet(cap, page_numel, pt, abi=0, spare=n_objs)
        self.tiers = TierStore(cache_dir, cfg.tiers) if cfg.offload_enabled else None
        self.entries: dict[str, BlockEntry] = {}
        self.requests: dict[int, Request] = {}
        self.inflight = 0
        self.graph: dict[str, Any] | None = None      # {"win", "pos", "ptrs": {ObjRec: (slot, gen)}}
        self.stats = {"lookups": 0, "logical_blocks": 0, "usable_blocks": 0, "decisions": {},
                      "degradations": {}, "transitions": {}}
        self._rs_cache: dict[tuple[int, int], list[tuple[str, int]]] = {}
        self._need_cache: dict[str, list[ObjRec]] = {}
        self._hold_cache: dict[tuple[str, int], frozenset[ObjRec]] = {}
        self._groups = cfg.groups
        wins = [g.window for g in cfg.groups if g.window is not None]
        self._wins = wins

    # ---- structure ------------------------------------------------------------------------
    def block_kinds(self, j: int) -> list[tuple[int, str]]:
        """(group, kind) of the objects block j carries (its slots)."""
        return block_objects(self.cfg, j)

    def entry(self, key: str, j: int) -> BlockEntry:
        e = self.entries.get(key)
        if e is None:
            e = BlockEntry(key, j, {gk: ObjRec(gk[0], gk[1], j) for gk in self.block_kinds(j)})
            self.entries[key] = e
        return e

    def obj(self, req: Request, g: int, kind: str, j: int) -> ObjRec | None:
        if j >= len(req.hashes):
            return None
        return self.entry(req.hashes[j], j).objs.get((g, kind))

    def window_lo(self, window: int | None, k: int) -> int:
        if window is None:
            return 0
        return max(0, k * self.B - window + 1) // self.B

    def retain_lo(self, k: int) -> int:
        return min((self.window_lo(w, k) for w in self._wins), default=k)

    def recovery_set(self, g: Group, k: int) -> list[tuple[str, int]]:
        """(kind, block) of every object group g reads to resume at k (memoised: a pure
        function of the config)."""
        key = (g.index, k)
        got = self._rs_cache.get(key)
        if got is None:
            got = self._rs_cache[key] = self._recovery_set(g, k)
        return got

    def _recovery_set(self, g: Group, k: int) -> list[tuple[str, int]]:
        return [(kind, j) for kind in g.objects
                for j in manager_for(kind).recovery(self.cfg, g, k, self.window_lo)]

    def needed(self, req: Request, k: int) -> list[ObjRec]:
        """The ObjRecs of the recovery set at k. Entries, once created, keep their records for
        good, so the list is cached per prefix (keyed by the chained hash of block k-1)."""
        if k == 0 or k > len(req.hashes):
            return self._needed(req, k)
        key = req.hashes[k - 1]                 # a chained hash names the whole prefix
        got = self._need_cache.get(key)
        if got is None:
            if len(self._need_cache) > 4096:
                self._need_cache.clear()
            got = self._need_cache[key] = self._needed(req, k)
        return got

    def _needed(self, req: Request, k: int) -> list[ObjRec]:
        out = []
        hashes, entries = req.hashes, self.entries
        for g in self._groups:
            gi = g.index
            for kind, j in self.recovery_set(g, k):
                if j >= len(hashes):
                    continue
                e = entries.get(hashes[j]) or self.entry(hashes[j], j)
                o = e.objs.get((gi, kind))
                if o is not None:
                    out.append(o)
        return out

    def holding(self, req: Request, win: int, pos: int) -> frozenset[ObjRec]:
        """The objects a holder resumed at `pos` with SWA pins from `win` keeps pinned (cached
        per prefix, like `needed`)."""
        if pos == 0 or pos > len(req.hashes):
            return frozenset(self._holding(req, win, pos))
        key = (req.hashes[pos - 1], win)
        got = self._hold_cache.get(key)
        if got is None:
            if len(self._hold_cache) > 4096:
                self._hold_cache.clear()
            got = self._hold_cache[key] = frozenset(self._holding(req, win, pos))
        return got

    def _holding(self, req: Request, win: int, pos: int) -> set[ObjRec]:
        out: set[ObjRec] = set()
        for j in range(min(pos, len(req.hashes))):
            for (g, kind), o in self.entry(req.hashes[j], j).objs.items():
                if manager_for(kind).holds(j, win, pos, self._groups[g].window is not None):
                    out.add(o)
        return out

    def version_of(self, kind: str) -> int:
        return self.cur[manager_for(kind).stamp]

    def shift(self, kind: str, abi: int | None = None, cmp: int | None = None, ix: int | None = None) -> int:
        return encode_shift(kind, self.cur["abi"] if abi is None else abi,
                            self.cur["cmp"] if cmp is None else cmp, self.cur["ix"] if ix is None else ix)

    def _count(self, key: str) -> None:
        t = self.stats["transitions"]
        t[key] = t.get(key, 0) + 1

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

    def graph_pinned(self, o: ObjRec) -> bool:
        g = self.graph
        if g is None:
            return False
        return manager_for(o.kind).holds(o.j, g["win"], g["pos"], self._groups[o.g].window is not None)

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, rid: int, tokens: list[int], n: int, extra: ExtraKeys) -> Request:
        q = self.requests.get(rid)
        if q is not None and q.st != R_IDLE:
            raise Refused(f"request slot {rid} is busy")
        salted = not self.planted(EF.CACHE_SALT_MISSING)
        req = Request(rid, list(tokens), n, block_hashes(tokens, self.B, n, extra, with_salt=salted),
                      extra.cache_salt)
        self.requests[rid] = req
        return req

    def probe_decision(self, tokens: list[int], n: int, extra: ExtraKeys) -> Decision:
        """What a lookup would answer for these tokens (no state change): isolation probes."""
        salted = not self.planted(EF.CACHE_SALT_MISSING)
        req = Request(-1, list(tokens), n, block_hashes(tokens, self.B, n, extra, with_salt=salted),
                      extra.cache_salt)
        return self.decide(req)

    def lookup(self, rid: int) -> Decision:
        req = self._req(rid, (R_WAITING,))
        d = self.decide(req)
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

    def _req(self, rid: int, states: tuple[int, ...]) -> Request:
        q = self.requests.get(rid)
        if q is None or q.st not in states:
            raise Refused(f"request {rid} is not in a state that allows this")
        return q

    def lease_current(self, req: Request) -> bool:
        return req.lease == self.cur

    def bind_valid(self, req: Request) -> bool:
        return self.lease_current(req) and self.funnel_ok_at(req, req.k)

    def bind(self, rid: int) -> None:
        """Check + pin, atomic: re-run the funnel at k under the lease's versions, then pin."""
        req = self._req(rid, (R_DECIDED,))
        if self.n_active() >= self.cfg.max_active:
            raise Refused("admission: max_active requests hold leases")
        if not self.bind_valid(req):
            raise Refused("the decision no longer holds (bind_stale)")
        if self.planted(EF.HASHES_PUBLISHED_EARLY):
            for j in range(req.n):
                self.entry(req.hashes[j], j).published = True
        req.st, req.pos, req.win = R_BOUND, req.k, self.retain_lo(req.k)
        self._set_pins(req, self.holding(req, req.win, req.pos))
        req.bound_ptrs = {o: (o.page, o.page.gen) for o in req.pins if o.page is not None}

    def bind_stale(self, rid: int) -> None:
        req = self._req(rid, (R_DECIDED,))
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
        req = self._req(rid, (R_BOUND,))
        if not self.use_valid(req):
            raise Refused("lease stale at use")
        req.st = R_RUNNING

    def use_stale(self, rid: int) -> bool:
        """The scheduler's use found the lease stale: unpin and fall back to a new lookup.
        Returns False when the engine ran the request instead (it judged the lease valid)."""
        req = self._req(rid, (R_BOUND,))
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

    def occupancy(self, kind: str) -> int:
        """Live objects of one kind (the admission cap's measure)."""
        return sum(o.live for e in self.entries.values() for o in e.objs.values() if o.kind == kind)

    def append(self, rid: int, j: int, data: dict[tuple[int, str], torch.Tensor]) -> None:
        """Write block j of a running request: raw KV pages and tails now; compressed entries and
        indexer keys are staged (WRITING) until compress / indexer_sync. Publishes the hash."""
        req = self._req(rid, (R_RUNNING,))
        if req.pos != j or j >= req.n:
            raise Refused(f"request {rid} is at block {req.pos}, not {j}")
        e = self.entry(req.hashes[j], j)
        rewrite = {}
        fresh: dict[str, int] = {}
        for gk, o in e.objs.items():
            rw = not (o.live and o.ver == self.version_of(o.kind) and o.abi == self.cur["abi"])
            if rw and (o.ref > 0 or self.graph_pinned(o)):
                raise Refused(f"{o.kind} of block {j} must be rewritten but is pinned")
            rewrite[gk] = rw
            if not o.live:
                fresh[o.kind] = fresh.get(o.kind, 0) + 1
        if not self.planted(EF.ADMISSION_CAP_IGNORED):
            for kind, n in fresh.items():
                if self.occupancy(kind) + n > self.cfg.cap(kind):
                    raise Refused(f"admission: {kind} pool full")
        for gk, o in e.objs.items():
            flat = data[gk]
            if rewrite[gk]:
                if o.page is not None:
                    o.page.pool.free(o.page)
                pool = self._pool_for(o.kind)
                o.page = pool.alloc()
                o.pool_id, o.aln = pool.pool_id, 1
                o.ver, o.abi = self.version_of(o.kind), self.cur["abi"]
                if manager_for(o.kind).staged:
                    o.page.pool.write(o.page, torch.zeros(0), 0)
                    o.staged, o.state = flat, WRITING
                else:
                    o.page.pool.write(o.page, flat, self.shift(o.kind))
                    o.state = READY
                o.epoch = self.cur["ver"]
                self._count(f"{o.kind}:append")
            elif o.epoch != self.cur["ver"] and not self.planted(EF.ENTRIES_KEPT_ACROSS_WEIGHT_UPDATE):
                # current by its own version stamp but computed under older weights (entries
                # depend on the layer input): refresh the bits in place.
                if o.state == WRITING:
                    o.staged = flat
                else:
                    o.page.pool.write(o.page, flat, self.shift(o.kind))
                o.epoch = self.cur["ver"]
        self._set_pins(req, self.holding(req, req.win, j + 1))
        req.pos = j + 1
        e.published = True

    def slide(self, rid: int) -> None:
        req = self._req(rid, (R_RUNNING,))
        lo = self.retain_lo(req.pos)
        if not req.win < lo:
            raise Refused("nothing to slide")
        req.win = lo
        self._set_pins(req, self.holding(req, lo, req.pos))

    def finish(self, rid: int) -> None:
        req = self._req(rid, (R_RUNNING,))
        if req.pos != req.n:
            raise Refused("request not finished")
        self._release(req)
        req.st = R_IDLE

    def preempt(self, rid: int) -> None:
        req = self._req(rid, (R_DECIDED, R_BOUND, R_RUNNING))
        self._release(req)
        req.st = R_PREEMPTED

    def resume(self, rid: int) -> None:
        self._req(rid, (R_PREEMPTED,)).st = R_WAITING

    # ---- objects -----------------------------------------------------------------------------
    def compress(self, o: ObjRec) -> None:
        if o.state != WRITING:
            raise Refused("no entry being compressed")
        o.page.pool.write(o.page, o.staged, self.shift(o.kind, abi=o.abi, cmp=o.ver, ix=o.ver))
        o.staged, o.state = None, READY
        self._count(f"{o.kind}:writing->ready")

    def evict(self, o: ObjRec) -> None:
        e = self.entry_of(o)
        if not o.live:
            raise Refused("not resident")
        if not self.planted(EF.PINNED_OBJECT_EVICTED):
            if o.ref > 0 or self.graph_pinned(o):
                raise Refused("pinned")
        if e.copy.dst == D_OFFLOADING:
            raise Refused("being offloaded")
        if o.page is not None:
            o.page.pool.free(o.page)
        o.page, o.staged, o.state = None, None, EVICTED
        self._count(f"{o.kind}:evict")

    def migrate(self, o: ObjRec) -> None:
        if o.state != READY or o.ref > 0:
            raise Refused("not movable")
        if self.graph_pinned(o) and not self.planted(EF.GRAPH_PAGES_MIGRATED):
            raise Refused("referenced by a captured graph")
        o.page.pool.move(o.page)
        o.moved, o.aln = 1, int(o.page.aligned)
        self._count(f"{o.kind}:migrate")

    def entry_of(self, o: ObjRec) -> BlockEntry:
        for e in self.entries.values():
            if e.objs.get((o.g, o.kind)) is o:
                return e
        raise KeyError(o)

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
        req = self._req(rid, (R_RUNNING,))
        if self.graph is not None:
            raise Refused("a graph is live")
        self.graph = {"win": req.win, "pos": req.pos}
        for e in self.entries.values():
            for o in e.objs.values():
                o.moved = 0
        self.graph["ptrs"] = {o: (o.page.slot, o.page.gen) for e in self.entries.values()
                              for o in e.objs.values() if self.graph_pinned(o) and o.page is not None}

    def release_graph(self) -> None:
        if self.graph is None:
            raise Refused("no graph")
        self.graph = None

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()

