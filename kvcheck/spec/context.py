"""What an action body sees: the pre-state view, the logic, the config, the planted fault, and
the lease/pin semantics every action shares (who holds what, pins, releases, occupancy).

Owns the writes an action records (TLA+'s primed variables, computed from the pre-state only)
and the reference-count deltas, folded into one write per slot when the body returns.
"""
from __future__ import annotations

from typing import Any

from . import content
from . import faults as F
from .logic import Expr, Logic
from .objects import D_OFFLOADING, KIND, POOL, R_BOUND, R_PREEMPTED, R_RUNNING, current_version, live
from .state import Layout, ObjSlot, View


class Ctx:
    """What an action body sees: the pre-state, helpers for the lease/pin semantics, and
    `planted`, the probe a patch site asks whether its fault is planted."""

    def __init__(self, v: View, L: Logic, lay: Layout, fault: "str | F.Planted | None") -> None:
        self.v, self.L, self.lay, self.cfg = v, L, lay, lay.cfg
        self.planted = F.planted_spec_fault(fault)
        self.writes: dict[int, Any] = {}
        self._ref_delta: dict[int, list[Any]] = {}

    # ---- writes ---------------------------------------------------------------------
    def set(self, key: tuple, value: Any) -> None:
        self.writes[self.lay.index[key]] = value

    def set_obj(self, o: ObjSlot, f: str, value: Any) -> None:
        self.set(("o", o.group, o.kind, o.block, f), value)

    def add_ref(self, o: ObjSlot, delta: Any) -> None:
        if isinstance(delta, int) and delta == 0:
            return
        self._ref_delta.setdefault(self.lay.o(o.group, o.kind, o.block, "ref"), []).append(delta)

    def finish(self) -> dict[int, Any]:
        for idx, deltas in self._ref_delta.items():
            val = self.v.vec[idx]
            for d in deltas:
                val = val + d
            self.writes[idx] = val
        return self.writes

    # ---- lease semantics ------------------------------------------------------------
    def ob(self, o: ObjSlot) -> Any:
        return self.v.obj(o.group, o.kind, o.block)

    def held(self, o: ObjSlot, win: Any, pos: Any) -> Any:
        """Does a holder resumed at `pos` whose retained windows are step `win` (of
        Config.window_steps) hold object o? (Its kind's `held` rule: entries before pos, the
        tail snapshot at pos, the pages of its own group's window.)"""
        finite = self.lay.window_lo[o.group] is not None
        lo = self.window_lo(o.group, win) if finite and KIND[o.kind].windowed else 0
        return KIND[o.kind].held(self.L, o.block, lo, pos, finite)

    def window_lo(self, g: int, step: Any) -> Any:
        """First block of group g's window at window step `step` (g has a finite window). With
        one finite window the step is that block (the table is the identity: not built)."""
        table = self.lay.window_lo[g]
        assert table is not None, f"group {g} has no finite window"
        return step if table == list(range(len(table))) else self.L.Table(step, table)

    def active(self, r: int) -> Any:
        st = self.v.req(r).rst
        return self.L.Or(st == R_BOUND, st == R_RUNNING)

    def holds(self, r: int, o: ObjSlot) -> Any:
        q = self.v.req(r)
        return self.L.And(self.active(r), self.held(o, q.rwin, q.rpos))

    def gpin(self, o: ObjSlot) -> Any:
        return self.L.And(self.v.graph == 1, self.held(o, self.v.gwin, self.v.gpos))

    def window_step(self, kexpr: Any) -> Any:
        """The window step (Config.window_steps) a request resumed at k retains: every group
        keeps its own window's pages, from `window_lo_block(W_g, k)`."""
        return self.L.Table(kexpr, [self.cfg.window_step(k) for k in range(self.cfg.blocks + 1)])

    def lease_current(self, r: int) -> Any:
        q, v = self.v.req(r), self.v
        return self.L.And(q.rver == v.cur_ver, q.rix == v.cur_ix, q.rabi == v.cur_abi,
                          q.rcmp == v.cur_cmp)

    def occupancy(self, kind: str) -> Any:
        """Pages of `kind` in use: live objects, and their second copies (duplicates = allow)."""
        objs = [o for o in self.lay.objects if o.kind == kind]
        n = self.L.Count(live(self.ob(o).st, self.L) for o in objs)
        if self.cfg.duplicates == "allow":
            for o in objs:
                n = n + self.ob(o).dup
        return n

    def n_active(self) -> Any:
        return self.L.Count(self.active(r) for r in range(self.cfg.requests))

    def current(self, o: ObjSlot) -> Any:
        """Written by the current versions (content and layout)."""
        ob, v = self.ob(o), self.v
        return self.L.And(ob.ver == current_version(v, o.kind), ob.abi == v.cur_abi)

    def block_objects(self, j: int) -> list[ObjSlot]:
        return [o for o in self.lay.objects if o.block == j]

    def release(self, r: int) -> None:
        """Drop every pin request r holds (finish, preempt, stale lease)."""
        q = self.v.req(r)
        for o in self.lay.objects:
            if self.held(o, q.rwin, q.rpos) is False:
                continue
            self.add_ref(o, self.L.If(self.holds(r, o), -1, 0))

    def pin(self, win: Any, pos: Any) -> None:
        for o in self.lay.objects:
            h = self.held(o, win, pos)
            if isinstance(h, bool) and not h:
                continue
            self.add_ref(o, self.L.If(h, 1, 0))

    def preempt_running(self) -> None:
        """A version change drains running requests: they lose their pins and must re-look-up."""
        L = self.L
        for r in range(self.cfg.requests):
            q = self.v.req(r)
            running = q.rst == R_RUNNING
            self.set(("r", r, "rst"), L.If(running, R_PREEMPTED, q.rst))
            for o in self.lay.objects:
                h = self.held(o, q.rwin, q.rpos)
                if isinstance(h, bool) and not h:
                    continue
                self.add_ref(o, L.If(L.And(running, h), -1, 0))


def fits(c: Ctx, j: int, room: dict[str, Any] | None = None) -> list[Any]:
    """Every pool has room for block j's objects that are not live (new allocations), after
    `room` more slots per kind were freed (an eviction inside the allocation, alloc.py)."""
    L, new = c.L, {}  # type: ignore[var-annotated]
    for o in c.block_objects(j):
        new.setdefault(o.kind, []).append(L.Not(live(c.ob(o).st, L)))
    room = room or {}
    return [c.occupancy(kind) + L.Count(m) - room.get(kind, 0) <= c.cfg.cap(kind) if kind in room
            else c.occupancy(kind) + L.Count(m) <= c.cfg.cap(kind) for kind, m in new.items()]


def spare(c: Ctx, v: int) -> tuple[Any, dict[str, Any]]:
    """(can every object of block v give up an unreferenced second copy — one exists, fewer
    holders than copies, not graph-captured, not being offloaded; the slots per kind it frees).
    Second copies are duplicates.py's; the room they free is here, as `fits`, because
    alloc.py's append_fail asks it too."""
    L, objs = c.L, c.block_objects(v)
    ok = L.And(c.v.disk(v).dst != D_OFFLOADING,
               *[L.And(c.ob(o).dup == 1, c.ob(o).ref < 2, L.Not(c.gpin(o))) for o in objs])
    room: dict[str, int] = {}
    for o in objs:
        room[o.kind] = room.get(o.kind, 0) + 1
    return ok, room


def write_block(c: Ctx, r: int, j: int, write: Any = True, done: Any = True,
                room: dict[str, Any] | None = None) -> list[Any]:
    """Request r writes block j (append; decode when the block fills): objects rewritten where
    missing, stale or another prompt's, the hash published (when `write`), and its pins moved
    on to j + 1 (when `done`). Returns the guard's conjuncts (each only binding when `write`);
    `room`: pool slots per kind an eviction inside this allocation frees (alloc.py)."""
    L, v, q = c.L, c.v, c.v.req(r)

    def gate(new: Any, old: Any, when: Any = write) -> Any:
        return new if when is True else L.If(when, new, old)

    def need(cond: Any) -> Any:
        return cond if write is True else L.Implies(write, cond)
    guard: list[Any] = []
    other = False                       # the slot holds another prompt's content: rewrite it all
    if c.cfg.prompts > 1:
        b, mine = v.disk(j), L.let(content.chain_of(L, c.cfg, q.rp, j))
        other = L.let(b.bcid != mine)
        c.set(("b", j, "bcid"), gate(mine, b.bcid))
        keep = L.And(other, b.hashed == 1) if c.planted(F.STALE_HASH_AFTER_REUSE) else False
        c.set(("b", j, "bkey"), gate(L.If(keep, b.bkey, mine), b.bkey))
    rewrites = []
    for o in c.block_objects(j):
        ob = c.ob(o)
        rewrite = L.Or(L.Not(L.And(live(ob.st, L), c.current(o))), other)
        rewrite = L.let(rewrite if write is True else L.And(write, rewrite))
        rewrites.append(rewrite)
        guard.append(L.Not(L.And(rewrite, L.Or(ob.ref > 0, c.gpin(o)))))
        fresh = KIND[o.kind].fresh
        cur = current_version(v, o.kind)
        aliased = o.kind == "swa_window" and c.planted(F.SHARED_FREE_LIST)
        pool = POOL["tail"] if aliased else POOL[o.kind]
        c.set_obj(o, "st", L.If(rewrite, fresh, ob.st))
        c.set_obj(o, "ver", L.If(rewrite, cur, ob.ver))
        c.set_obj(o, "abi", L.If(rewrite, v.cur_abi, ob.abi))
        c.set_obj(o, "aln", L.If(rewrite, 1, ob.aln))
        c.set_obj(o, "pool", L.If(rewrite, pool, ob.pool))
        if c.cfg.duplicates == "allow":     # a rewrite frees every copy of the old content
            c.set_obj(o, "dup", L.If(rewrite, 0, ob.dup))
    if not c.planted(F.ADMISSION_IGNORED):
        guard.extend(need(f) for f in fits(c, j, room))
    for o in c.lay.objects:
        before, after = c.held(o, q.rwin, j), c.held(o, q.rwin, j + 1)
        if isinstance(before, Expr) and isinstance(after, Expr) and before.src == after.src:
            continue
        if not isinstance(before, Expr) and not isinstance(after, Expr) and before == after:
            continue
        delta = L.If(after, 1, 0) - L.If(before, 1, 0)
        c.add_ref(o, delta if done is True else L.If(done, delta, 0))
    c.set(("r", r, "rpos"), gate(j + 1, j, done))
    if c.cfg.publish == "release":      # written unpublished; a rewrite drops the old content's hash
        c.set(("b", j, "hashed"), gate(L.If(L.Or(other, *rewrites), 0, v.disk(j).hashed), v.disk(j).hashed))
    else:
        c.set(("b", j, "hashed"), gate(1, v.disk(j).hashed))
    return guard


def mine_cached(c: Ctx, r: int, j: int) -> Any:
    """Block j's objects are live and current and hold request r's content (its prefix to j)."""
    L, q = c.L, c.v.req(r)
    ok = [L.And(live(c.ob(o).st, L), c.current(o)) for o in c.block_objects(j)]
    if c.cfg.prompts > 1:
        ok.append(c.v.disk(j).bcid == content.chain_of(L, c.cfg, q.rp, j))
    return L.And(*ok)


def unseen(c: Ctx, r: int, j: int) -> Any:
    """publish = release: block j holds request r's content but is unpublished (another running
    request wrote it): r cannot find it and computes its own copy (append_copy), never shares it."""
    if c.cfg.publish != "release":
        return False
    return c.L.And(c.v.disk(j).hashed == 0, mine_cached(c, r, j))


def publish_released(c: Ctx, r: int) -> None:
    """publish = release: request r releases its blocks (finish, preempt) and the engine publishes
    the hash of each position it holds whose slot still holds its content (live, current, its
    prefix); a slot another prompt rewrote meanwhile (out of a window) stays as it is."""
    if c.cfg.publish != "release":
        return
    L, q = c.L, c.v.req(r)
    stale = c.planted(F.LATE_PUBLISH_REUSED_SLOT)
    for j in range(c.cfg.blocks):
        b = c.v.disk(j)
        at = L.let(L.And(c.active(r), j < q.rpos))
        if stale:           # the fault: every position published under r's key, content or not
            c.set(("b", j, "hashed"), L.If(at, 1, b.hashed))
            if c.cfg.prompts > 1:
                c.set(("b", j, "bkey"), L.If(at, content.chain_of(L, c.cfg, q.rp, j), b.bkey))
            continue
        c.set(("b", j, "hashed"), L.If(L.And(at, mine_cached(c, r, j)), 1, b.hashed))
