"""The five cache objects: their lifecycle states, their pools, and their recovery conditions.

Owns, per object kind, the predicate "this object is usable for resuming at block k" and which
objects a block carries under a config. The recovery predicates here are the ground truth the
hit-soundness invariants check against; the funnel (which may carry planted faults) is written
separately in funnel.py. The vocabulary every engine speaks (state names, pool ids, decision
kinds, degradation reasons) and the kind declarations live in object_kinds.py, below config.py
(which validates capacities against them), and are re-exported here.
"""
from __future__ import annotations

from typing import Any

from .config import Config, Group
from .logic import Logic
from .object_kinds import (D_DURABLE, D_LOADING, D_NO, D_NONE, D_OFFLOADING,  # noqa: F401  (re-exported)
                           D_QUARANTINED, D_UNVERIFIED, DECISION_KINDS, DECISIONS, DEVICE_KINDS,
                           DEVICE_STATES, DISK_STATES, ENGINE_OBJECTS, EVICTED, FREE, KIND, OBJECT_KINDS,
                           OBJECTS, PARTIAL, POOL, PREFETCH, R_BOUND, R_DECIDED, R_IDLE, R_PREEMPTED,
                           R_RUNNING, R_WAITING, READY, REASON_BIT, REASONS, RECOMPUTE, RECURRENT_STATE,
                           REQUEST_STATES, REUSE, WRITING, ObjectKind, reason_names, state_name)


def block_objects(cfg: Config, j: int) -> list[tuple[int, str]]:
    """(group, kind) of every device object logical block j carries: compressed entries and
    indexer keys only where an entry completes, tails only where a snapshot is needed."""
    return [(g.index, kind) for g in cfg.groups for kind in g.objects if KIND[kind].carried(cfg, g, j)]


def live(st: Any, L: Logic) -> Any:
    return L.Or(st == WRITING, st == READY)


def current_version(v: Any, kind: str) -> Any:
    return getattr(v, KIND[kind].version)


def header_version(v: Any, kind: str, j: int) -> Any:
    return getattr(v.disk(j), KIND[kind].header)


# ---- recovery conditions (ground truth) -------------------------------------------------
# Each takes a state view `v` (see state.py), the logic, the config, a group and a concrete
# block count k >= 1 (resume at token L = k * block_size), and returns a predicate.

def needed_objects(cfg: Config, g: Group, k: int) -> dict[str, list[int]]:
    """Blocks whose objects of each kind a resume at k reads (the recovery set)."""
    return {kind: KIND[kind].needed(cfg, g, k) for kind in g.objects}


def recovery(kind: str, v: Any, L: Logic, cfg: Config, k: int) -> Any:
    """Every group's objects of `kind` meet their recovery condition at k (ground truth)."""
    conds = []
    for g in cfg.groups:
        need = needed_objects(cfg, g, k).get(kind, [])
        for j in need:
            o = v.obj(g.index, kind, j)
            conds.append(L.And(o.st == READY, o.ver == current_version(v, kind)))
    return L.And(*conds)


def layout_ok(v: Any, L: Logic, cfg: Config, k: int) -> Any:
    """Every object a resume at k reads has the current ABI and an aligned address."""
    conds = []
    for g in cfg.groups:
        for kind, blocks in needed_objects(cfg, g, k).items():
            for j in blocks:
                o = v.obj(g.index, kind, j)
                conds.append(L.And(o.abi == v.cur_abi, o.aln == 1))
    return L.And(*conds)


def resident(v: Any, L: Logic, cfg: Config, k: int) -> Any:
    """No block in the hit is served from an on-disk copy that is registered but not ready:
    every needed object of a block with a copy in flight or unverified is on the device."""
    conds = []
    for j in range(k):
        in_flight = L.In(v.disk(j).dst, (D_LOADING, D_UNVERIFIED))
        objs = []
        for g in cfg.groups:
            for kind, blocks in needed_objects(cfg, g, k).items():
                if j in blocks:
                    objs.append(v.obj(g.index, kind, j).st == READY)
        if objs:
            conds.append(L.Implies(in_flight, L.And(*objs)))
    return L.And(*conds)
