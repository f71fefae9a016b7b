"""The reference engine's four-layer funnel and its decision (the engine's own implementation).

Owns what a lookup answers: the logical hit from the prefix table, then, from the longest
candidate down, alignment, fingerprints, the intersection of every group's object states and
the physical alignment; PREFETCH when a longer hit is usable once an in-flight or durable copy
is loaded. A collaborator of CacheManager: it reads the manager's records and current versions
(`ManagerState`), the recovery sets (structure.py) and whether a copy can be loaded
(tier_coordinator.py); it changes nothing.
"""
from __future__ import annotations

from kvcheck.spec.objects import KIND, PARTIAL, PREFETCH, READY, REASONS, RECOMPUTE, REUSE, WRITING

from . import faults as EF
from .kinds import manager_for
from .manager_state import ManagerState
from .records import Decision, ObjRec, Request
from .structure import Structure
from .tier_coordinator import TierCoordinator

REASON = dict(REASONS)


class Funnel:
    """What a lookup answers, and whether a hit still passes at bind (queries only)."""

    def __init__(self, m: ManagerState, structure: Structure, coordinator: TierCoordinator) -> None:
        self.m, self.s, self.coordinator = m, structure, coordinator

    def layers_at(self, req: Request, k: int) -> list[tuple[bool, int]]:
        """The four layers at candidate k, each (passes, reason bits if it fails)."""
        need = self.s.needed(req, k)
        l1 = (k % self.m.cfg.align_blocks == 0, REASON["lcm_alignment"])
        cur_abi = self.m.cur["abi"]
        skip_abi = self.m.planted(EF.ABI_VERSION_IGNORED)
        skip_ix = self.m.planted(EF.INDEXER_VERSION_IGNORED)
        stale = {"model_version": False, "indexer_version": False}
        abi_ok = aligned = True
        for o in need:                        # layers 2 and 4 read the same objects: one pass
            if not o.aln:
                aligned = False
            if o.state != WRITING and o.state != READY:
                continue
            if o.abi != cur_abi and not skip_abi:
                abi_ok = False
            if o.ver != self.s.version_of(o.kind):
                reason = manager_for(o.kind).stale_reason
                stale[reason] = stale[reason] or not (skip_ix and reason == "indexer_version")
        ver_ok, ix_ok = not stale["model_version"], not stale["indexer_version"]
        l2 = (abi_ok and ver_ok and ix_ok,
              (0 if abi_ok else REASON["abi_mismatch"]) + (0 if ver_ok else REASON["model_version"])
              + (0 if ix_ok else REASON["indexer_version"]))
        bits, ok3, on_disk = 0, True, False
        for o in self._presence_set(req, k, need):
            if o.state == READY or (o.state == WRITING and o.kind == "indexer"
                                    and self.m.planted(EF.INDEXER_LAG_NOT_CHECKED)):
                continue
            ok3 = False
            bits |= REASON[KIND[o.kind].missing_reason]
            if not on_disk and self.coordinator.copy_restorable(self.s.entry(req.hashes[o.j], o.j)):
                on_disk = True
        if on_disk:
            bits |= REASON["on_disk_not_ready"]
        l3 = (ok3, bits)
        l4 = (aligned or self.m.planted(EF.MISALIGNED_ADDRESS_ACCEPTED), REASON["misaligned"])
        return [l1, l2, l3, l4]

    def _presence_set(self, req: Request, k: int, need: list[ObjRec]) -> list[ObjRec]:
        if self.m.planted(EF.TAIL_CHECK_SKIPPED):
            return [o for o in need if o.kind != "tail"]
        if self.m.planted(EF.SWA_WINDOW_OFF_BY_ONE):
            out = []
            for g in self.m.cfg.groups:
                rs = self.s.recovery_set(g, k)
                swa = [j for kind, j in rs if kind == "swa_window"]
                for kind, j in rs:
                    if kind == "swa_window" and swa and j == swa[0] and g.window is not None:
                        continue
                    o = self.s.obj(req, g.index, kind, j)
                    if o is not None:
                        out.append(o)
            return out
        return need

    def usable_after_load(self, req: Request, k: int) -> bool:
        if k % self.m.cfg.align_blocks:
            return False
        for o in self.s.needed(req, k):
            cur = self.s.version_of(o.kind)
            if o.state == READY and o.ver == cur and o.abi == self.m.cur["abi"] and o.aln == 1:
                continue
            e = self.s.entry(req.hashes[o.j], o.j)
            if o.live or not self.coordinator.copy_restorable(e) or e.copy.hdr[manager_for(o.kind).stamp] != cur:
                return False
        return True

    def logical_hit(self, req: Request) -> int:
        h = 0
        for j in range(min(req.n, len(req.hashes))):
            e = self.m.entries.get(req.hashes[j])
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
