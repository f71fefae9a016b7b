"""The action table: every way the cache state may change, as (parameters, guard, effect).

Owns Next. Each action is a function of a `Ctx` (the pre-state view, the logic, the config,
the planted fault) and its parameters; it returns the guard and records the effect as writes
to state slots, computed from the pre-state only (TLA+'s primed variables). The same function
runs concretely, compiles to Python, and becomes a z3 transition relation. The table itself
(`Action`, `ACTIONS`, `@action`) is action_registry.py's, re-exported here.
"""
from __future__ import annotations

from typing import Any, Iterable

from . import content
from .action_registry import ACTIONS, Action, action, per_block, per_object, per_object_kind, per_request
from . import faults as F
from .funnel import Decision
from .logic import Logic
from .objects import (header_version, D_DURABLE, D_LOADING, D_NONE, D_OFFLOADING, D_QUARANTINED,
                      D_UNVERIFIED, EVICTED, KIND, POOL, PREFETCH, R_BOUND, R_DECIDED, R_IDLE,
                      R_PREEMPTED, R_RUNNING, R_WAITING, READY, WRITING, live)
from .context import Ctx, publish_released, unseen, write_block
from .state import Layout, ObjSlot, View


# ---- requests ---------------------------------------------------------------------------

def _submits(lay: Layout) -> Iterable[dict[str, Any]]:
    prompts = [{}] if lay.cfg.prompts == 1 else [{"p": p} for p in range(lay.cfg.prompts)]
    return ({"r": r, "n": n, **p} for r in range(lay.cfg.requests)
            for n in range(1, lay.cfg.blocks + 1) for p in prompts)


@action(_submits)
def submit(c: Ctx, r: int, n: int, p: int | None = None) -> Any:
    """A request arrives whose prompt covers n blocks of the shared prefix (then its own suffix);
    with prompts > 1, prompt p of the prompt table (content.py)."""
    q = c.v.req(r)
    for f, val in (("rst", R_WAITING), ("rlen", n), ("rk", 0), ("rpos", 0), ("rwin", 0),
                   ("rdec", 0), ("rver", 0), ("rix", 0), ("rabi", 0), ("rcmp", 0)):
        c.set(("r", r, f), val)
    if p is not None:
        c.set(("r", r, "rp"), p)
    if c.cfg.decode:
        c.set(("r", r, "rtok"), 0)
    return q.rst == R_IDLE


@action(per_request)
def lookup(c: Ctx, r: int) -> Any:
    """Check: the funnel decides REUSE(k)/PARTIAL(k)/PREFETCH/RECOMPUTE; leases record versions."""
    L, v, q = c.L, c.v, c.v.req(r)
    d = Decision(v, L, c.cfg, r, c.planted)
    pf = d.kind == PREFETCH
    c.set(("r", r, "rst"), L.If(pf, R_WAITING, R_DECIDED))
    c.set(("r", r, "rdec"), d.kind)
    c.set(("r", r, "rk"), L.If(pf, 0, d.k))
    c.set(("r", r, "rver"), v.cur_ver)
    c.set(("r", r, "rix"), v.cur_ix)
    c.set(("r", r, "rabi"), v.cur_abi)
    c.set(("r", r, "rcmp"), v.cur_cmp)
    return q.rst == R_WAITING


def _bind_valid(c: Ctx, r: int) -> Any:
    d = Decision(c.v, c.L, c.cfg, r, c.planted)
    ok = d.ok_at(c.L, c.v.req(r).rk)
    # the blocks may hold other content since the lookup (prompts > 1), or be live yet unpublished
    # (publish = release: rewritten by a request still running): re-check the published hashes
    if c.cfg.prompts > 1 or c.cfg.publish == "release":
        ok = c.L.And(ok, d.hit_at(c.L, c.v.req(r).rk))
    return c.L.And(c.lease_current(r), ok)


@action(per_request)
def bind(c: Ctx, r: int) -> Any:
    """Bind: atomically re-check the decision under the same versions and pin its objects."""
    L, q = c.L, c.v.req(r)
    step = L.let(c.window_step(q.rk))
    c.set(("r", r, "rst"), R_BOUND)
    c.set(("r", r, "rpos"), q.rk)
    c.set(("r", r, "rwin"), step)
    c.pin(step, q.rk)
    if c.cfg.decode:
        c.set(("r", r, "rtok"), 0)      # a partial block's tokens are recomputed from the hit
    return L.And(q.rst == R_DECIDED, c.n_active() < c.cfg.max_active, _bind_valid(c, r))


@action(per_request)
def bind_stale(c: Ctx, r: int) -> Any:
    """The state changed between check and bind: the decision is dropped, look up again."""
    q = c.v.req(r)
    c.set(("r", r, "rst"), R_WAITING)
    return c.L.And(q.rst == R_DECIDED, c.L.Not(_bind_valid(c, r)))


@action(per_request)
def use(c: Ctx, r: int) -> Any:
    """Use: re-validate the lease's versions at the moment of reading, then run."""
    q = c.v.req(r)
    c.set(("r", r, "rst"), R_RUNNING)
    if c.planted(F.NO_REVALIDATION_AT_USE):
        return q.rst == R_BOUND
    return c.L.And(q.rst == R_BOUND, c.lease_current(r))


@action(per_request)
def use_stale(c: Ctx, r: int) -> Any:
    """Use found a stale lease: unpin and fall back to a fresh lookup (never error out)."""
    q = c.v.req(r)
    c.set(("r", r, "rst"), R_WAITING)
    c.release(r)
    return c.L.And(q.rst == R_BOUND, c.L.Not(c.lease_current(r)))


@action(lambda lay: ({"r": r, "j": j} for r in range(lay.cfg.requests) for j in range(lay.cfg.blocks)))
def append(c: Ctx, r: int, j: int) -> Any:
    """Write block j's tokens: raw KV pages and tail now; the compressed entry and the indexer
    keys start WRITING (compress / indexer_sync finish them). Publishes the block's hash (with
    publish = release: at the request's release instead, and a block another request wrote but
    has not published is not shared: the request copies it, duplicates.py)."""
    q = c.v.req(r)
    return c.L.And(q.rst == R_RUNNING, q.rpos == j, j < q.rlen, c.L.Not(unseen(c, r, j)), *write_block(c, r, j))


@action(per_request)
def slide(c: Ctx, r: int) -> Any:
    """Window slide: each group releases its SWA pages that fell out of its own window."""
    L, q = c.L, c.v.req(r)
    if len(c.lay.narrowest_lo) == 1:    # no window starts moving within `blocks` (full attention)
        return False
    step = L.let(c.window_step(q.rpos))
    c.set(("r", r, "rwin"), step)
    # a planted fault: one bound for every group, the narrowest window's (with one finite
    # window that is every group's own: the fault exists only where windows differ)
    one = len(c.cfg.windows) > 1 and c.planted(F.SLIDE_ONE_WINDOW)
    for o in c.lay.objects:
        if KIND[o.kind].windowed and c.lay.window_lo[o.group] is not None:
            lo = L.Table(step, c.lay.narrowest_lo) if one else c.window_lo(o.group, step)
            old = c.window_lo(o.group, q.rwin)
            c.add_ref(o, L.If(L.And(old <= o.block, o.block < lo, o.block < q.rpos), -1, 0))
    return L.And(q.rst == R_RUNNING, q.rwin < step)


@action(per_request)
def finish(c: Ctx, r: int) -> Any:
    """The request completes and releases everything it holds (publish = release: publishing
    the blocks it wrote)."""
    L, q = c.L, c.v.req(r)
    c.set(("r", r, "rst"), R_IDLE)
    c.release(r)
    publish_released(c, r)
    if c.planted(F.REFCOUNT_DOUBLE_DECREMENT):
        for o in c.lay.objects:
            if o.kind == "tail":            # the pin of the tail snapshot, released twice
                c.add_ref(o, L.If(c.held(o, q.rwin, q.rpos), -1, 0))
    return L.And(q.rst == R_RUNNING, q.rpos == q.rlen)


@action(per_request)
def preempt(c: Ctx, r: int) -> Any:
    """Preemption: a decided, bound or running request is descheduled and unpins (publish =
    release: publishing the blocks it wrote, as at finish)."""
    L, q = c.L, c.v.req(r)
    c.set(("r", r, "rst"), R_PREEMPTED)
    c.release(r)
    publish_released(c, r)
    return L.In(q.rst, (R_DECIDED, R_BOUND, R_RUNNING))


@action(per_request)
def resume(c: Ctx, r: int) -> Any:
    """A preempted request comes back and must look up again."""
    q = c.v.req(r)
    c.set(("r", r, "rst"), R_WAITING)
    return q.rst == R_PREEMPTED


# ---- per-object lifecycle -----------------------------------------------------------------

@action(per_object_kind(tuple(k.name for k in KIND.values() if k.finished_by == "compress")))
def compress(c: Ctx, g: int, kind: str, j: int) -> Any:
    """The compressor finishes an entry from its tail tokens (writing -> ready)."""
    o = ObjSlot(g, kind, j)
    c.set_obj(o, "st", READY)
    return c.ob(o).st == WRITING


@action(per_object_kind(tuple(k.name for k in KIND.values() if k.finished_by == "indexer_sync")))
def indexer_sync(c: Ctx, g: int, kind: str, j: int) -> Any:
    """The indexer catches up with the KV of an entry (it may lag; writing -> ready)."""
    o = ObjSlot(g, kind, j)
    c.set_obj(o, "st", READY)
    return c.ob(o).st == WRITING


@action(per_object)
def evict(c: Ctx, g: int, kind: str, j: int) -> Any:
    """Per-type eviction from the object's own pool: never pinned, graph-captured or being
    offloaded (the hash stays: the object is a tombstone)."""
    L, o = c.L, ObjSlot(g, kind, j)
    ob = c.ob(o)
    c.set_obj(o, "st", EVICTED)
    if c.cfg.duplicates == "allow":
        c.set_obj(o, "dup", 0)          # unreferenced: every copy goes back to the free list
    if c.cfg.eviction == "drop_hash" and not c.planted(F.STALE_HASH_AFTER_EVICT):
        c.set(("b", j, "hashed"), 0)    # the block goes back to the free list: its hash with it
    if c.planted(F.EVICTION_IGNORES_PINS):
        return live(ob.st, L)
    return L.And(live(ob.st, L), ob.ref == 0, L.Not(c.gpin(o)), c.v.disk(j).dst != D_OFFLOADING)


@action(per_block)
def drop_hash(c: Ctx, j: int) -> Any:
    """The hash table forgets block j (eviction = drop_hash only: an engine may unpublish a
    block at any time; its objects stay until evicted, unreachable by a lookup)."""
    if c.cfg.eviction != "drop_hash":
        return False
    c.set(("b", j, "hashed"), 0)
    return c.v.disk(j).hashed == 1


@action(per_object)
def migrate(c: Ctx, g: int, kind: str, j: int) -> Any:
    """Compaction moves an unpinned page to another (aligned) address."""
    L, o = c.L, ObjSlot(g, kind, j)
    ob = c.ob(o)
    c.set_obj(o, "gmv", 1)
    c.set_obj(o, "aln", 1)
    if c.planted(F.GRAPH_PAGES_MIGRATED):
        return L.And(ob.st == READY, ob.ref == 0)
    return L.And(ob.st == READY, ob.ref == 0, L.Not(c.gpin(o)))


# ---- tiers ------------------------------------------------------------------------------

@action(per_block)
def offload_start(c: Ctx, j: int) -> Any:
    """Write-back of block j's objects to host/disk begins (the header records the versions)."""
    L, v, d = c.L, c.v, c.v.disk(j)
    if not c.cfg.offload_enabled:
        return False
    c.set(("b", j, "dst"), D_OFFLOADING)
    c.set(("b", j, "dver"), v.cur_ver)
    c.set(("b", j, "dix"), v.cur_ix)
    c.set(("b", j, "dcmp"), v.cur_cmp)
    c.set(("b", j, "dabi"), v.cur_abi)
    c.set(("b", j, "dbad"), 0)
    if c.cfg.prompts > 1:
        c.set(("b", j, "dcid"), d.bcid)     # the copy carries the content it was written from
    c.set(("g", "inflight"), v.inflight + 1)
    objs = [L.And(c.ob(o).st == READY, c.current(o)) for o in c.block_objects(j)]
    return L.And(L.In(d.dst, (D_NONE, D_QUARANTINED)), v.inflight < c.cfg.max_inflight, *objs)


@action(per_block)
def offload_ack(c: Ctx, j: int) -> Any:
    """The write is durable (fsync + rename acknowledged)."""
    v = c.v
    c.set(("b", j, "dst"), D_DURABLE)
    c.set(("g", "inflight"), v.inflight - 1)
    return v.disk(j).dst == D_OFFLOADING


def _restore_fits(c: Ctx, j: int, reserve: int) -> list[Any]:
    L, out = c.L, []
    missing: dict[str, list[Any]] = {}
    for o in c.block_objects(j):
        missing.setdefault(o.kind, []).append(L.Not(live(c.ob(o).st, L)))
    for kind, m in missing.items():
        out.append(c.occupancy(kind) + L.Count(m) <= c.cfg.cap(kind) - reserve)
    return out


@action(per_block)
def prefetch_start(c: Ctx, j: int) -> Any:
    """Start loading block j's copy back (only within the restore budget: pool capacity minus
    the reserve kept for new requests)."""
    L, v = c.L, c.v
    c.set(("b", j, "dst"), D_LOADING)
    c.set(("g", "inflight"), v.inflight + 1)
    some_missing = L.Or(*[L.Not(live(c.ob(o).st, L)) for o in c.block_objects(j)])
    return L.And(v.disk(j).dst == D_DURABLE, some_missing, v.inflight < c.cfg.max_inflight,
                 *_restore_fits(c, j, c.cfg.reserve))


@action(per_block)
def prefetch_complete(c: Ctx, j: int) -> Any:
    """The bytes arrived: loaded but not yet verified ('registered' is not 'ready')."""
    v = c.v
    c.set(("b", j, "dst"), D_UNVERIFIED)
    c.set(("g", "inflight"), v.inflight - 1)
    return v.disk(j).dst == D_LOADING


@action(lambda lay: ({"j": j, "aligned": a} for j in range(lay.cfg.blocks) for a in (1, 0)))
def verify_ok(c: Ctx, j: int, aligned: int) -> Any:
    """Checksum and header verified: the missing objects become ready again (placed at an
    aligned address, or not: a bounce buffer may leave them misaligned)."""
    L, v, d = c.L, c.v, c.v.disk(j)
    for o in c.block_objects(j):
        ob = c.ob(o)
        gone = L.let(L.Not(live(ob.st, L)))
        c.set_obj(o, "st", L.If(gone, READY, ob.st))
        c.set_obj(o, "ver", L.If(gone, header_version(v, o.kind, j), ob.ver))
        c.set_obj(o, "abi", L.If(gone, d.dabi, ob.abi))
        c.set_obj(o, "aln", L.If(gone, aligned, ob.aln))
        c.set_obj(o, "pool", L.If(gone, POOL[o.kind], ob.pool))
        c.set_obj(o, "gmv", L.If(gone, 1, ob.gmv))
    c.set(("b", j, "dst"), D_DURABLE)
    c.set(("b", j, "hashed"), 1)
    same = []
    if c.cfg.prompts > 1 and c.cfg.offload_enabled:     # restored and published as the copy's content
        c.set(("b", j, "bcid"), d.dcid)
        if not c.planted(F.RESTORE_UNDER_STALE_KEY):
            c.set(("b", j, "bkey"), d.dcid)
        same = [content.copy_fits(v, L, j, [live(c.ob(o).st, L) for o in c.block_objects(j)])]
    return L.And(d.dst == D_UNVERIFIED, d.dbad == 0, d.dver == v.cur_ver, d.dabi == v.cur_abi,
                 *same, *_restore_fits(c, j, 0))


@action(per_block)
def checksum_fail(c: Ctx, j: int) -> Any:
    """Checksum or header mismatch (or, with prompts > 1, a copy of content its live slot no
    longer holds): the copy is quarantined, never served."""
    L, v, d = c.L, c.v, c.v.disk(j)
    c.set(("b", j, "dst"), D_QUARANTINED)
    other = []
    if c.cfg.prompts > 1 and c.cfg.offload_enabled:     # a copy of content the slot moved on from
        alive = [live(c.ob(o).st, L) for o in c.block_objects(j)]
        other = [L.Not(content.copy_fits(v, L, j, alive))]
    return L.And(d.dst == D_UNVERIFIED, L.Or(d.dbad == 1, d.dver != v.cur_ver, d.dabi != v.cur_abi, *other))


@action(per_block)
def corrupt(c: Ctx, j: int) -> Any:
    """The copy's bytes are damaged (torn write, bit flip, truncation)."""
    d = c.v.disk(j)
    c.set(("b", j, "dbad"), 1)
    return c.L.And(c.L.In(d.dst, (D_OFFLOADING, D_DURABLE, D_LOADING)), d.dbad == 0)


# ---- versions and graphs ----------------------------------------------------------------

def _bump(c: Ctx, field: str) -> Any:
    val = getattr(c.v, field)
    c.set(("g", field), val + 1)
    c.preempt_running()
    return val < c.cfg.max_version


@action()
def bump_model(c: Ctx) -> Any:
    """New weights: tails and raw KV pages become stale (entries carry the compressor's version)."""
    return _bump(c, "cur_ver")


@action()
def bump_compressor(c: Ctx) -> Any:
    """New compressor (compressed-KV quantization or format): compressed entries become stale."""
    return _bump(c, "cur_cmp")


@action()
def bump_indexer(c: Ctx) -> Any:
    """New indexer version: indexer keys become stale."""
    return _bump(c, "cur_ix")


@action()
def bump_abi(c: Ctx) -> Any:
    """New kernel ABI / layout / dtype: every stored layout becomes foreign."""
    return _bump(c, "cur_abi")


@action(per_request)
def capture(c: Ctx, r: int) -> Any:
    """Capture an execution graph over a running request's pages at their current addresses."""
    L, v, q = c.L, c.v, c.v.req(r)
    c.set(("g", "graph"), 1)
    c.set(("g", "gwin"), q.rwin)
    c.set(("g", "gpos"), q.rpos)
    for o in c.lay.objects:
        c.set_obj(o, "gmv", 0)
    return L.And(v.graph == 0, q.rst == R_RUNNING)


@action()
def release_graph(c: Ctx) -> Any:
    """Release the captured graph; its pages become ordinary again."""
    c.set(("g", "graph"), 0)
    c.set(("g", "gwin"), 0)
    c.set(("g", "gpos"), 0)
    return c.v.graph == 1


def run_body(act: Action, v: View, L: Logic, lay: Layout, fault: "str | F.Planted | None",
             params: dict[str, Any]) -> tuple[Any, dict[int, Any]]:
    c = Ctx(v, L, lay, fault)
    guard = act.body(c, **params)
    return guard, c.finish()


# The other action modules register into the same table, after this module's actions (the
# table's order): decode, then append_evict / append_fail, then the duplicate-copy actions.
from . import decode as _decode  # noqa: E402,F401  (registers `decode`)
from . import alloc as _alloc  # noqa: E402,F401  (registers append_evict, append_fail)
from . import duplicates as _duplicates  # noqa: E402,F401  (append_copy, evict_copy, append_evict_copy)

ACTION_NAMES = tuple(ACTIONS)
assert R_IDLE == 0 and D_LOADING == 3 and D_UNVERIFIED == 4
assert all(k.finished_by in (None, *ACTIONS) for k in KIND.values())
