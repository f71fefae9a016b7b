"""The named invariants: the four consistency rules, the bookkeeping rule and hit soundness.

Owns what must hold in every reachable state. Each invariant is a list of conjuncts (one per
object or request) so that a violation names the exact object, and so that engines can check
only the conjuncts an action could have changed (exact frame reasoning, see system.py).
Hit soundness is split per object kind so that a planted fault is caught by the rule a
reviewer would name ("no hit without a covering window").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .actions import Ctx
from .config import Config
from .content import holds_prefix
from .objects import (DEVICE_KINDS, D_LOADING, D_OFFLOADING, PARTIAL, POOL, R_BOUND, R_RUNNING, REUSE,
                      layout_ok, live, needed_objects, recovery, resident)


@dataclass(frozen=True)
class Invariant:
    name: str
    kind: str          # consistency | safety
    doc: str
    conjuncts: Callable[[Ctx], list[tuple[str, Any]]]   # [(where, predicate)]
    when: Callable[[Config], bool] = lambda cfg: True   # the semantic it states is on


INVARIANTS: dict[str, Invariant] = {}


def invariant(kind: str, doc: str, when: Callable[[Config], bool] = lambda cfg: True):
    def deco(fn: Callable[[Ctx], list[tuple[str, Any]]]):
        INVARIANTS[fn.__name__] = Invariant(fn.__name__, kind, doc, fn, when)
        return fn
    return deco


def invariants_for(cfg: Config) -> dict[str, Invariant]:
    """The invariants of a config: those of a configurable semantic only where it is on."""
    return {n: i for n, i in INVARIANTS.items() if i.when(cfg)}


@invariant("consistency", "Admission cap: transfers in flight, requests holding leases and every "
           "pool's occupancy stay within their caps, and the in-flight count is exact.")
def admission_cap(c: Ctx) -> list[tuple[str, Any]]:
    L, v, cfg = c.L, c.v, c.cfg
    out = [("inflight<=max_inflight", v.inflight <= cfg.max_inflight),
           ("inflight==transfers", v.inflight == L.Count(
               L.In(v.disk(j).dst, (D_OFFLOADING, D_LOADING)) for j in range(cfg.blocks))),
           ("active<=max_active", c.n_active() <= cfg.max_active)]
    for kind in DEVICE_KINDS:
        if any(o.kind == kind for o in c.lay.objects):
            out.append((f"occupancy[{kind}]<=capacity", c.occupancy(kind) <= cfg.cap(kind)))
    return out


@invariant("consistency", "Five-state routing: every live object sits in its own kind's pool; "
           "no page is aliased across object types.")
def five_state_routing(c: Ctx) -> list[tuple[str, Any]]:
    L = c.L
    return [(c.lay.label(o), L.Implies(live(c.ob(o).st, L), c.ob(o).pool == POOL[o.kind]))
            for o in c.lay.objects]


@invariant("consistency", "TOCTOU: a bound object is never evicted or freed while held (no "
           "use-after-free), and a running request's lease was re-validated at use against "
           "the current versions.")
def toctou_bound_stable(c: Ctx) -> list[tuple[str, Any]]:
    L = c.L
    out = [(c.lay.label(o), L.Implies(c.ob(o).ref > 0, live(c.ob(o).st, L))) for o in c.lay.objects]
    out += [(f"request {r}", L.Implies(c.v.req(r).rst == R_RUNNING, c.lease_current(r)))
            for r in range(c.cfg.requests)]
    return out


@invariant("consistency", "Static graph topology: pages referenced by a captured execution graph "
           "stay resident at the addresses captured until the graph is released.")
def graph_topology(c: Ctx) -> list[tuple[str, Any]]:
    L = c.L
    return [(c.lay.label(o), L.Implies(c.gpin(o), L.And(live(c.ob(o).st, L), c.ob(o).gmv == 0)))
            for o in c.lay.objects]


@invariant("safety", "Reference counts equal holders: every object's count is exactly the number "
           "of requests holding it (no leak, no double free).")
def refcount_equals_holders(c: Ctx) -> list[tuple[str, Any]]:
    L = c.L
    return [(c.lay.label(o), c.ob(o).ref == L.Count(c.holds(r, o) for r in range(c.cfg.requests)))
            for o in c.lay.objects]


def _hit_sound(pred: Callable[[Ctx, int], Any]) -> Callable[[Ctx], list[tuple[str, Any]]]:
    def conj(c: Ctx) -> list[tuple[str, Any]]:
        L, out = c.L, []
        for r in range(c.cfg.requests):
            q = c.v.req(r)
            granted = L.And(q.rst == R_BOUND, c.lease_current(r), L.In(q.rdec, (REUSE, PARTIAL)))
            for k in range(1, c.cfg.blocks + 1):
                p = pred(c, k)
                if p is True:
                    continue
                out.append((f"request {r} at k={k}", L.Implies(L.And(granted, q.rk == k), p)))
        return out
    return conj


def _kind_sound(kind: str) -> Callable[[Ctx, int], Any]:
    return lambda c, k: recovery(kind, c.v, c.L, c.cfg, k)


HIT_DOCS = {
    "compressed_kv": "No hit without every compressed entry before it complete and current.",
    "tail": "No hit at a boundary inside a compression block without the tail snapshot taken "
            "exactly there (junction with the last entry exact).",
    "swa_window": "No hit without a covering window: every page of [L-W+1, L) present.",
    "indexer": "No hit on a sparse layer whose indexer lags the KV or is of another version.",
}
for _kind, _doc in HIT_DOCS.items():
    _fn = _hit_sound(_kind_sound(_kind))
    _name = f"hit_sound_{_kind}"
    INVARIANTS[_name] = Invariant(_name, "safety", _doc + " (bound, lease current)", _fn)

INVARIANTS["hit_sound_on_disk"] = Invariant(
    "hit_sound_on_disk", "safety",
    "No hit on a block whose objects are only on disk/host in flight or unverified: "
    "'registered' is not 'ready'. (bound, lease current)",
    _hit_sound(lambda c, k: resident(c.v, c.L, c.cfg, k)))
INVARIANTS["hit_sound_layout"] = Invariant(
    "hit_sound_layout", "safety",
    "No hit on an object of a foreign kernel ABI/layout or at a misaligned address. "
    "(bound, lease current)",
    _hit_sound(lambda c, k: layout_ok(c.v, c.L, c.cfg, k)))


@invariant("consistency", "Published hashes name resident content (eviction = drop_hash): a block "
           "whose hash a lookup can find has every device object live; eviction unpublished it.",
           when=lambda cfg: cfg.eviction == "drop_hash")
def published_hash_resident(c: Ctx) -> list[tuple[str, Any]]:
    L, out = c.L, []
    if c.cfg.eviction != "drop_hash":
        return out
    for j in range(c.cfg.blocks):
        objs = [live(c.ob(o).st, L) for o in c.block_objects(j)]
        out.append((f"block {j}", L.Implies(c.v.disk(j).hashed == 1, L.And(*objs))))
    return out


def blocks_read(cfg: Config, k: int) -> list[int]:
    """Blocks whose objects a resume at k reads (any group, any kind)."""
    return sorted({j for g in cfg.groups for bl in needed_objects(cfg, g, k).values() for j in bl})


@invariant("safety", "No hit on content of another prefix (prompts > 1): every block a granted "
           "hit reads holds exactly this request's prefix up to it (bound, lease current).",
           when=lambda cfg: cfg.prompts > 1)
def hit_content_sound(c: Ctx) -> list[tuple[str, Any]]:
    L, out = c.L, []
    if c.cfg.prompts == 1:
        return out
    for r in range(c.cfg.requests):
        q = c.v.req(r)
        granted = L.And(q.rst == R_BOUND, c.lease_current(r), L.In(q.rdec, (REUSE, PARTIAL)))
        for k in range(1, c.cfg.blocks + 1):
            same = [holds_prefix(c.v, L, c.cfg, r, j) for j in blocks_read(c.cfg, k)]
            out.append((f"request {r} at k={k}", L.Implies(L.And(granted, q.rk == k), L.And(*same))))
    return out


@invariant("safety", "No hit on a partial block (decode = true): every block a granted hit reads "
           "was written when it was full (bound, lease current).", when=lambda cfg: cfg.decode)
def hit_full_blocks(c: Ctx) -> list[tuple[str, Any]]:
    L, out = c.L, []
    if not c.cfg.decode:
        return out
    for r in range(c.cfg.requests):
        q = c.v.req(r)
        granted = L.And(q.rst == R_BOUND, c.lease_current(r), L.In(q.rdec, (REUSE, PARTIAL)))
        for k in range(1, c.cfg.blocks + 1):
            whole = [c.v.disk(j).bpart == 0 for j in blocks_read(c.cfg, k)]
            out.append((f"request {r} at k={k}", L.Implies(L.And(granted, q.rk == k), L.And(*whole))))
    return out


@invariant("consistency", "Second copies are cached copies (duplicates = allow): a second physical "
           "copy exists only of a ready object (evicting or rewriting it frees both).",
           when=lambda cfg: cfg.duplicates == "allow")
def copies_cached(c: Ctx) -> list[tuple[str, Any]]:
    if c.cfg.duplicates != "allow":
        return []
    from .objects import READY
    return [(c.lay.label(o), c.L.Implies(c.ob(o).dup == 1, c.ob(o).st == READY)) for o in c.lay.objects]


HIT_SOUNDNESS = tuple(n for n in INVARIANTS if n.startswith("hit_sound_"))
INVARIANT_NAMES = tuple(INVARIANTS)
