"""The reference engine's cache manager: prefix table, per-block object records over physical
pools, pins and leases, the four-layer funnel and the decision, tiers, admission, graphs.

Written as an implementation (hash table of chained block hashes, page handles with
generations, per-request block tables of pins, transfer futures), independently of the spec's
code: the spec is imported only for its vocabulary (config, state/decision/reason constants).
Checking this manager against the spec in lockstep is therefore a real conformance check.

Every operation first checks that it is allowed and raises `Refused` (mapped to the protocol's
ActionRejected by the adapter) without changing anything when it is not.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvcheck.spec.config import Config, Group
from kvcheck.spec.objects import (D_DURABLE, D_LOADING, D_NONE, D_OFFLOADING, D_QUARANTINED,
                                  D_UNVERIFIED, DECISIONS, EVICTED, FREE, PARTIAL, PREFETCH,
                                  R_BOUND, R_DECIDED, R_IDLE, R_PREEMPTED, R_RUNNING, R_WAITING,
                                  READY, RECOMPUTE, REASONS, REUSE, WRITING)

from .hashing import ExtraKeys, block_hashes
from .pools import POOL_KINDS, Page, PoolSet, encode_shift
from .tiers import CopyInvalid, TierStore, check_header, unpack

REASON = dict(REASONS)
MISSING_REASON = {"compressed_kv": "compressed_missing", "tail": "tail_missing",
                  "swa_window": "window_incomplete", "indexer": "indexer_lagging"}


class Refused(Exception):
    """The manager refuses an operation in its current state (nothing changed)."""


@dataclass(eq=False)
class ObjRec:
    """One cache object (group g, kind, block). Keeps its last stamps after eviction."""

    g: int
    kind: str
    j: int
    state: int = FREE
    ver: int = 0
    abi: int = 0
    aln: int = 1
    pool_id: int = 0
    ref: int = 0
    moved: int = 0
    page: Page | None = None
    staged: torch.Tensor | None = None     # produced, not yet compressed / synced
    epoch: int = -1                        # model weights the data was computed with

    @property
    def live(self) -> bool:
        return self.state in (WRITING, READY)


@dataclass
class CopyRec:
    """The on-disk/host copy of one block."""

    dst: int = D_NONE
    hdr: dict = field(default_factory=lambda: {"ver": 0, "ix": 0, "cmp": 0, "abi": 0})
    damaged: int = 0          # set by fault injection (torn write, bit flip): for observation


@dataclass(eq=False)
class BlockEntry:
    key: str
    j: int
    objs: dict[tuple[int, str], ObjRec]
    published: bool = False
    copy: CopyRec = field(default_factory=CopyRec)


@dataclass(eq=False)
class Request:
    rid: int
    tokens: list[int]
    n: int                               # blocks of the (hashable) shared prefix
    hashes: list[str]
    salt: str = ""
    st: int = R_WAITING
    k: int = 0
    pos: int = 0
    win: int = 0
    dec: int = 0
    lease: dict = field(default_factory=lambda: {"ver": 0, "ix": 0, "abi": 0, "cmp": 0})
    pins: frozenset = frozenset()
    bound_ptrs: dict = field(default_factory=dict)   # ObjRec -> (page, gen) at bind


@dataclass
class Decision:
    kind: int
    k: int
    logical: int
    bits: int

    def to_dict(self) -> dict[str, Any]:
        return {"kind": DECISIONS[self.kind], "k": self.k, "logical": self.logical,
                "reasons": [n for n, b in REASONS if self.bits & b]}


class CacheManager:
    """Bookkeeping and device/tier data movement for one model (no model execution)."""

    def __init__(self, cfg: Config, model_id: str, page_numel: dict[str, int],
                 fault: str | None = None, cache_dir: str | None = None) -> None:
        self.cfg, self.model_id = cfg, model_id
        from .faults import internal
        self.fault = internal(fault)
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
        return self.cfg.block_objects(j)

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
        out: list[tuple[str, int]] = []
        if "compressed_kv" in g.objects:
            blocks = [j for j in range(k) if self.cfg.has_compressed(g, j)]
            out += [("compressed_kv", j) for j in blocks]
            if "indexer" in g.objects:
                out += [("indexer", j) for j in blocks]
        if "tail" in g.objects and k >= 1 and self.cfg.needs_tail(g, k - 1):
            out.append(("tail", k - 1))
        if "swa_window" in g.objects:
            out += [("swa_window", j) for j in range(self.window_lo(g.window, k), k)]
        return out

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
                if kind in ("compressed_kv", "indexer"):
                    out.add(o)
                elif kind == "tail":
                    if pos == j + 1:
                        out.add(o)
                elif self._groups[g].window is None or win <= j:
                    out.add(o)
        return out

    def version_of(self, kind: str) -> int:
        return self.cur["cmp"] if kind == "compressed_kv" else self.cur["ix"] if kind == "indexer" else self.cur["ver"]

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
        if self.fault == "refcount_double_decrement" and req.st == R_RUNNING:
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
        if o.kind in ("compressed_kv", "indexer"):
            return o.j < g["pos"]
        if o.kind == "tail":
            return g["pos"] == o.j + 1
        if self._groups[o.g].window is None:
            return o.j < g["pos"]
        return g["win"] <= o.j < g["pos"]

    # ---- the funnel ----------------------------------------------------------------------------
    def copy_restorable(self, e: BlockEntry) -> bool:
        """A copy a load can bring back: durable or in flight, of the current model weights and
        ABI, and intact — the engine scrubs the bytes (checksum) rather than trusting a flag."""
        c = e.copy
        if c.dst not in (D_DURABLE, D_LOADING, D_UNVERIFIED):
            return False
        if c.hdr["ver"] != self.cur["ver"] or c.hdr["abi"] != self.cur["abi"]:
            return False
        return self._intact(e)

    def _intact(self, e: BlockEntry) -> bool:
        if self.tiers is None:
            return False
        try:
            if e.copy.dst in (D_LOADING, D_UNVERIFIED):
                blob = self.tiers.loaded(e.key)
            else:
                blob = self.tiers._read(e.key)
            unpack(blob)
            return True
        except (CopyInvalid, OSError, KeyError, AssertionError):
            return False

    def layers_at(self, req: Request, k: int) -> list[tuple[bool, int]]:
        """The four layers at candidate k, each (passes, reason bits if it fails)."""
        need = self.needed(req, k)
        l1 = (k % self.cfg.align_blocks == 0, REASON["lcm_alignment"])
        cur_abi, cur_ix = self.cur["abi"], self.cur["ix"]
        cur_of = {"compressed_kv": self.cur["cmp"], "indexer": cur_ix, "tail": self.cur["ver"],
                  "swa_window": self.cur["ver"]}
        skip_abi = self.fault == "abi_version_ignored"
        skip_ix = self.fault == "indexer_version_ignored"
        abi_ok = ver_ok = ix_ok = aligned = True
        for o in need:                        # layers 2 and 4 read the same objects: one pass
            if not o.aln:
                aligned = False
            if o.state != WRITING and o.state != READY:
                continue
            if o.abi != cur_abi and not skip_abi:
                abi_ok = False
            if o.ver != cur_of[o.kind]:
                if o.kind == "indexer":
                    ix_ok = ix_ok and skip_ix
                else:
                    ver_ok = False
        l2 = (abi_ok and ver_ok and ix_ok,
              (0 if abi_ok else REASON["abi_mismatch"]) + (0 if ver_ok else REASON["model_version"])
              + (0 if ix_ok else REASON["indexer_version"]))
        bits, ok3, on_disk = 0, True, False
        lag_ok = self.fault == "indexer_lag_not_checked"
        for o in self._presence_set(req, k, need):
            if o.state == READY or (lag_ok and o.kind == "indexer" and o.state == WRITING):
                continue
            ok3 = False
            bits |= REASON[MISSING_REASON[o.kind]]
            if not on_disk and self.copy_restorable(self.entry(req.hashes[o.j], o.j)):
                on_disk = True
        if on_disk:
            bits |= REASON["on_disk_not_ready"]
        l3 = (ok3, bits)
        l4 = (aligned or self.fault == "misaligned_accepted", REASON["misaligned"])
        return [l1, l2, l3, l4]

    def _presence_set(self, req: Request, k: int, need: list[ObjRec]) -> list[ObjRec]:
        if self.fault == "tail_check_skipped":
            return [o for o in need if o.kind != "tail"]
        if self.fault == "swa_window_off_by_one":
            out = []
            for g in self.cfg.groups:
                rs = self.recovery_set(g, k)
                swa = [j for kind, j in rs if kind == "swa_window"]
                for kind, j in rs:
                    if kind == "swa_window" and swa and j == swa[0] and g.window is not None:
                        continue
                    o = self.obj(req, g.index, kind, j)
                    if o is not None:
                        out.append(o)
            return out
        return need

    def usable_after_load(self, req: Request, k: int) -> bool:
        if k % self.cfg.align_blocks:
            return False
        for o in self.needed(req, k):
            here = (o.state == READY and o.ver == self.version_of(o.kind) and o.abi == self.cur["abi"]
                    and o.aln == 1)
            if here:
                continue
            e = self.entry(req.hashes[o.j], o.j)
            hv = e.copy.hdr["cmp" if o.kind == "compressed_kv" else "ix" if o.kind == "indexer" else "ver"]
            if o.live or not self.copy_restorable(e) or hv != self.version_of(o.kind):
                return False
        return True

    def logical_hit(self, req: Request) -> int:
        h = 0
        for j in range(min(req.n, len(req.hashes))):
            e = self.entries.get(req.hashes[j])
            if e is None or not e.published:
                break
            h = j + 1
        return h

    def decide(self, req: Request) -> Decision:
        logical = self.logical_hit(req)
        # Candidates from the longest down: the first that passes all four layers is k*; every
        # longer one has been evaluated (failed) by then, which is all PREFETCH and the
        # reasons need. (Not a filter chain: the window rule is not monotone in k.)
        layers: dict[int, list[tuple[bool, int]]] = {}
        kstar = 0
        for k in range(logical, 0, -1):
            layers[k] = self.layers_at(req, k)
            if all(p for p, _ in layers[k]):
                kstar = k
                break
        prefetch = any(self.usable_after_load(req, k) for k in range(kstar + 1, logical + 1))
        bits = 0
        if kstar < logical:
            bits = next((why for passes, why in layers[logical] if not passes), 0)
        kind = PREFETCH if prefetch else REUSE if kstar == logical > 0 else PARTIAL if kstar else RECOMPUTE
        return Decision(kind, kstar, logical, bits)

    def funnel_ok_at(self, req: Request, k: int) -> bool:
        return k == 0 or all(p for p, _ in self.layers_at(req, k))

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, rid: int, tokens: list[int], n: int, extra: ExtraKeys) -> Request:
        q = self.requests.get(rid)
        if q is not None and q.st != R_IDLE:
            raise Refused(f"request slot {rid} is busy")
        salted = self.fault != "cache_salt_missing"
        req = Request(rid, list(tokens), n, block_hashes(tokens, self.B, n, extra, with_salt=salted),
                      extra.cache_salt)
        self.requests[rid] = req
        return req

    def probe_decision(self, tokens: list[int], n: int, extra: ExtraKeys) -> Decision:
        """What a lookup would answer for these tokens (no state change): isolation probes."""
        salted = self.fault != "cache_salt_missing"
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
        if self.fault == "hashes_published_early":
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
        if self.fault == "no_revalidation_at_use":
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
        if self.fault == "no_revalidation_at_use":
            req.st = R_RUNNING                  # the faulty engine never notices the lease is stale
            return False
        req.st = R_WAITING
        self._release(req)
        return True

    def _pool_for(self, kind: str):
        if self.fault == "shared_free_list" and kind == "swa_window":
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
        if self.fault != "admission_cap_ignored":
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
                if o.kind in ("compressed_kv", "indexer"):
                    o.page.pool.write(o.page, torch.zeros(0), 0)
                    o.staged, o.state = flat, WRITING
                else:
                    o.page.pool.write(o.page, flat, self.shift(o.kind))
                    o.state = READY
                o.epoch = self.cur["ver"]
                self._count(f"{o.kind}:append")
            elif o.epoch != self.cur["ver"] and self.fault != "entries_kept_across_weight_update":
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
        if self.fault != "pinned_object_evicted":
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
        if self.graph_pinned(o) and self.fault != "graph_pages_migrated":
            raise Refused("referenced by a captured graph")
        o.page.pool.move(o.page)
        o.moved, o.aln = 1, int(o.page.aligned)
        self._count(f"{o.kind}:migrate")

    def entry_of(self, o: ObjRec) -> BlockEntry:
        for e in self.entries.values():
            if e.objs.get((o.g, o.kind)) is o:
                return e
        raise KeyError(o)

    # ---- tiers ---------------------------------------------------------------------------------
    def offload_start(self, e: BlockEntry) -> None:
        if self.tiers is None:
            raise Refused("no host/disk tier")
        if e.copy.dst not in (D_NONE, D_QUARANTINED):
            raise Refused("copy already exists")
        if self.inflight >= self.cfg.max_inflight:
            raise Refused("admission: transfers in flight")
        for o in e.objs.values():
            if not (o.state == READY and o.ver == self.version_of(o.kind) and o.abi == self.cur["abi"]):
                raise Refused(f"{o.kind} of block {e.j} is not ready and current")
        objs, chunks, off = [], [], 0
        for (g, kind), o in sorted(e.objs.items()):
            raw = o.page.pool.read_raw(o.page).numpy().tobytes()       # DMA: exact bytes
            objs.append({"g": g, "kind": kind, "offset": off, "nbytes": len(raw), "ver": o.ver, "abi": o.abi})
            chunks.append(raw)
            off += len(raw)
        header = {"model_id": self.model_id, "block": e.j, "key": e.key, **self.cur,
                  "layouts": self.pools.layouts(), "objects": objs}
        self.tiers.offload(e.key, header, b"".join(chunks))
        e.copy = CopyRec(D_OFFLOADING, dict(self.cur), 0)
        self.inflight += 1
        if self.fault == "offload_ready_before_write":
            e.copy.dst = D_DURABLE                     # acknowledged at submission
            self.inflight -= 1
        self._count("on_disk:none->offloading")

    def offload_ack(self, e: BlockEntry) -> None:
        if e.copy.dst != D_OFFLOADING:
            raise Refused("no write in flight")
        self.tiers.wait_durable(e.key)                 # durable = the write future completed
        e.copy.dst = D_DURABLE
        self.inflight -= 1
        self._count("on_disk:offloading->durable")

    def _restore_fits(self, e: BlockEntry, reserve: int) -> bool:
        missing: dict[str, int] = {}
        for o in e.objs.values():
            missing[o.kind] = missing.get(o.kind, 0) + (not o.live)
        return all(self.occupancy(k) + n <= self.cfg.cap(k) - reserve for k, n in missing.items())

    def prefetch_start(self, e: BlockEntry) -> None:
        if e.copy.dst != D_DURABLE or all(o.live for o in e.objs.values()):
            raise Refused("nothing to prefetch")
        if self.inflight >= self.cfg.max_inflight:
            raise Refused("admission: transfers in flight")
        if not self._restore_fits(e, self.cfg.reserve):
            raise Refused("admission: restore reserve")
        self.tiers.load(e.key)
        e.copy.dst = D_LOADING
        self.inflight += 1

    def prefetch_complete(self, e: BlockEntry) -> None:
        if e.copy.dst != D_LOADING:
            raise Refused("no load in flight")
        try:
            self.tiers.loaded(e.key)
        except OSError:
            pass                      # a missing/unreadable file fails verification next
        e.copy.dst = D_UNVERIFIED
        self.inflight -= 1

    def verify(self, e: BlockEntry, aligned: int, want_ok: bool | None = None) -> bool:
        """Verify the loaded bytes (checksum, then header) before any object becomes ready;
        place the missing objects on success, quarantine on failure. `want_ok` (the adapter's
        action: verify_ok / checksum_fail) makes a mismatching outcome a refusal."""
        if e.copy.dst != D_UNVERIFIED:
            raise Refused("nothing loaded")
        header = payload = None
        try:
            blob = self.tiers.loaded(e.key)
            if self.fault == "load_before_checksum":
                header, payload = _unpack_unchecked(blob)
            else:
                header, payload = unpack(blob)
                check_header(header, self.model_id, self.cur)
            ok = True
        except (CopyInvalid, OSError, ValueError):
            ok = False
        if want_ok is not None and ok != want_ok and self.fault != "load_before_checksum":
            raise Refused("verification outcome differs")
        if not ok:
            self.tiers.quarantine(e.key)
            e.copy.dst = D_QUARANTINED
            self._count("on_disk:loaded_unverified->quarantined")
            return False
        if not self._restore_fits(e, 0):
            if want_ok is False:                   # (fault path) cannot place it: drop it
                self.tiers.quarantine(e.key)
                e.copy.dst = D_QUARANTINED
                return False
            raise Refused("admission: no room to restore")
        for meta in header["objects"]:
            o = e.objs.get((meta["g"], meta["kind"]))
            if o is None or o.live:
                continue
            raw = torch.frombuffer(bytearray(payload[meta["offset"]:meta["offset"] + meta["nbytes"]]),
                                   dtype=torch.float32)
            pool = self.pools[o.kind]
            o.page = pool.alloc(aligned=bool(aligned))
            pool.write_raw(o.page, raw)
            o.state, o.aln, o.pool_id, o.moved = READY, int(o.page.aligned), pool.pool_id, 1
            o.ver = header["cmp" if o.kind == "compressed_kv" else "ix" if o.kind == "indexer" else "ver"]
            o.abi = header["abi"]
            o.epoch = header["ver"]
            self._count(f"{o.kind}:restore")
        e.copy.dst = D_DURABLE
        e.published = True
        return True

    def corrupt(self, e: BlockEntry) -> None:
        if e.copy.dst not in (D_OFFLOADING, D_DURABLE, D_LOADING) or e.copy.damaged:
            raise Refused("no intact copy to damage")
        self.tiers.corrupt(e.key, in_flight_load=e.copy.dst == D_LOADING)
        if e.copy.dst == D_LOADING:
            self.tiers.corrupt(e.key)
        e.copy.damaged = 1

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


def _unpack_unchecked(blob: bytes) -> tuple[dict, bytes]:
    """The fault `load_before_checksum`: parse the framing, skip checksum and header checks."""
    import json
    import struct
    from .tiers import MAGIC
    start = len(MAGIC) + 4
    (hlen,) = struct.unpack("<I", blob[len(MAGIC):start])
    header = json.loads(blob[start:start + hlen])
    return header, blob[start + hlen:-32]
