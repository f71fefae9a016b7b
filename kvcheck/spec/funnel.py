"""The four-layer validation funnel and the decision REUSE(k) | PARTIAL(k) | PREFETCH | RECOMPUTE.

Owns what a lookup answers. Layers run cheapest first at each candidate k: (1) whole-block /
LCM alignment, (2) ABI/layout and version fingerprints, (3) the intersection of every cache
group's object states, (4) byte-level hardware alignment. The usable length is the largest
aligned k at which all four pass; the first failing layer names the degradation reason.
Spec faults are planted here as named deviations; the invariants check against objects.py.
"""
from __future__ import annotations

from typing import Any

from . import faults as F
from .config import Config
from .content import chain_of, hash_matches
from .logic import Logic
from .objects import (current_version, header_version, D_DURABLE, D_LOADING, D_UNVERIFIED, KIND, PARTIAL,
                      PREFETCH, READY, RECOMPUTE, REASON_BIT, REUSE, live, needed_objects)


def _needed(cfg: Config, k: int, fault: F.Planted | None = None) -> list[tuple[int, str, int]]:
    """(group, kind, block) of every object a resume at k reads. With `fault`, the set whose
    presence layer 3 checks (the coverage faults live here; layers 2 and 4 see the true set)."""
    out = []
    for g in cfg.groups:
        need = needed_objects(cfg, g, k)
        if fault is not None and need.get("swa_window") and fault(F.WINDOW_OFF_BY_ONE):
            need["swa_window"] = need["swa_window"][1:]          # first page of the window unchecked
        start = cfg.tail_start_block(g, k) if need.get("tail") else None   # an older snapshot
        if fault is not None and start is not None and cfg.needs_tail(g, start) \
                and fault(F.TAIL_JUNCTION_NOT_CHECKED):
            need["tail"] = [start]
        for kind, blocks in need.items():
            out.extend((g.index, kind, j) for j in blocks)
    return out


# Layer 2's planted faults: the kind whose version stamp each one leaves unchecked.
_STAMP_PATCH = {"indexer": F.DECISION_IGNORES_INDEXER_VERSION, "compressed_kv": F.COMPRESSED_VERSION_IGNORED}


def restorable(v: Any, L: Logic, j: int) -> Any:
    """Block j has an intact-looking copy that a load can bring back (durable or in flight)."""
    d = v.disk(j)
    return L.And(L.In(d.dst, (D_DURABLE, D_LOADING, D_UNVERIFIED)), d.dbad == 0,
                 d.dver == v.cur_ver, d.dabi == v.cur_abi)


def layers_at(v: Any, L: Logic, cfg: Config, k: int, fault: F.Planted) -> list[tuple[Any, Any]]:
    """[(passes, reason_bits_if_it_fails)] for the four layers at a concrete k >= 1."""
    need = _needed(cfg, k)
    # layer 1: alignment
    l1 = (k % cfg.align_blocks == 0, REASON_BIT["lcm_alignment"])
    # layer 2: fingerprints of the objects that are present
    abi: list[Any] = []
    stamps: dict[str, list[Any]] = {"model_version": [], "indexer_version": []}
    for g, kind, j in need:
        o = v.obj(g, kind, j)
        here = live(o.st, L)
        if not fault(F.ABI_IGNORED):
            abi.append(L.Implies(here, o.abi == v.cur_abi))
        patch = _STAMP_PATCH.get(kind)
        if patch is None or not fault(patch):
            stamps[KIND[kind].version_reason].append(L.Implies(here, o.ver == current_version(v, kind)))
    abi_ok = L.let(L.And(*abi))
    ver_ok, ix_ok = L.let(L.And(*stamps["model_version"])), L.let(L.And(*stamps["indexer_version"]))
    l2_bits = L.let(L.If(abi_ok, 0, REASON_BIT["abi_mismatch"]) + L.If(ver_ok, 0, REASON_BIT["model_version"])
                    + L.If(ix_ok, 0, REASON_BIT["indexer_version"]))
    l2 = (L.And(abi_ok, ver_ok, ix_ok), l2_bits)
    # layer 3: intersection of all groups' states (ready = complete, compressed, synced)
    per_reason: dict[str, list[Any]] = {}
    missing_restorable = []
    for g, kind, j in _needed(cfg, k, fault):
        o = v.obj(g, kind, j)
        ok = o.st == READY
        if fault(F.PREFETCH_COUNTED_AS_HIT):
            ok = L.Or(ok, L.In(v.disk(j).dst, (D_LOADING, D_UNVERIFIED)))
        per_reason.setdefault(KIND[kind].missing_reason, []).append(ok)
        missing_restorable.append(L.And(L.Not(ok), restorable(v, L, j)))
    l3_parts = {r: L.let(L.And(*c)) for r, c in per_reason.items()}
    on_disk = L.let(L.Or(*missing_restorable))
    l3_bits: Any = 0
    for r, part in l3_parts.items():
        l3_bits = l3_bits + L.If(part, 0, REASON_BIT[r])
    l3_bits = l3_bits + L.If(on_disk, REASON_BIT["on_disk_not_ready"], 0)
    l3 = (L.And(*l3_parts.values()), l3_bits)
    # layer 4: hardware alignment of physical addresses
    l4 = (L.let(L.And(*[v.obj(g, kind, j).aln == 1 for g, kind, j in need])), REASON_BIT["misaligned"])
    return [l1, l2, l3, l4]


def prefetch_ok_at(v: Any, L: Logic, cfg: Config, k: int, r: int | None = None) -> Any:
    """Would k be usable once every restorable copy is loaded and verified? (With prompts > 1,
    a copy counts only when it holds request r's content.)"""
    if k % cfg.align_blocks:
        return False
    conds = []
    for g, kind, j in _needed(cfg, k):
        o = v.obj(g, kind, j)
        cur = current_version(v, kind)
        here_ok = L.And(o.st == READY, o.ver == cur, o.abi == v.cur_abi, o.aln == 1)
        copy_ok = L.And(L.Not(live(o.st, L)), restorable(v, L, j), header_version(v, kind, j) == cur)
        if cfg.prompts > 1 and cfg.offload_enabled and r is not None:
            copy_ok = L.And(copy_ok, v.disk(j).dcid == chain_of(L, cfg, v.req(r).rp, j))
        conds.append(L.Or(here_ok, copy_ok))
    return L.And(*conds)


class Decision:
    """The decision of request r's lookup as terms of the chosen logic."""

    def __init__(self, v: Any, L: Logic, cfg: Config, r: int, fault: "str | F.Planted | None") -> None:
        fault = F.planted_spec_fault(fault)
        req = v.req(r)
        n = cfg.blocks
        self.ok: dict[int, Any] = {0: True}
        self.hit: dict[int, Any] = {0: True}
        layers: dict[int, list[tuple[Any, Any]]] = {}
        prefix: Any = True
        for k in range(1, n + 1):
            same = [hash_matches(v, L, cfg, r, k - 1, fault)] if cfg.prompts > 1 else []
            prefix = L.let(L.And(prefix, v.disk(k - 1).hashed == 1, *same))
            self.hit[k] = L.let(L.And(prefix, k <= req.rlen))
            layers[k] = layers_at(v, L, cfg, k, fault)
            self.ok[k] = L.let(L.And(*[p for p, _ in layers[k]]))
        kstar: Any = 0
        hmax: Any = 0
        for k in range(1, n + 1):
            kstar = L.If(L.And(self.hit[k], self.ok[k]), k, kstar)
            hmax = L.If(self.hit[k], k, hmax)
        self.k = L.let(kstar)
        self.logical = L.let(hmax)
        pf = []
        for k in range(1, n + 1):
            pf.append(L.And(self.hit[k], L.Not(self.ok[k]), self.k < k,
                            prefetch_ok_at(v, L, cfg, k, r)))
        self.prefetch = L.let(L.Or(*pf))
        self.kind = L.let(L.If(self.prefetch, PREFETCH,
                               L.If(L.And(self.k == self.logical, self.k > 0), REUSE,
                                    L.If(self.k > 0, PARTIAL, RECOMPUTE))))
        # reasons: why the longest logical hit was degraded (its first failing layer)
        bits: Any = 0
        for k in range(1, n + 1):
            first: Any = 0
            for passes, why in reversed(layers[k]):
                first = L.If(passes, first, why)
            bits = L.If(L.And(self.logical == k, self.k < k), first, bits)
        self.reasons = bits

    def ok_at(self, L: Logic, kexpr: Any) -> Any:
        """The funnel passes at a state-dependent k (used to re-check at bind)."""
        return L.Or(*[L.And(kexpr == k, ok) for k, ok in self.ok.items()])

    def hit_at(self, L: Logic, kexpr: Any) -> Any:
        """The published hashes still cover k blocks of this request's prefix."""
        return L.Or(*[L.And(kexpr == k, hit) for k, hit in self.hit.items()])
