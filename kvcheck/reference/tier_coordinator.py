"""The reference engine's tier coordinator: write-back offload, prefetch, verification before
placement, corruption injection — the manager's side of the host/disk tiers (tiers.py owns the
file format and the transfers).

"Durable" is the completion of the write, never its submission; loaded bytes are checked
(checksum, then header) before any object becomes ready; a copy that fails is quarantined and
never served. A collaborator of CacheManager: it reads and updates the manager's records and
current versions through `ManagerState`.
"""
from __future__ import annotations

import json
import struct

import torch

from kvcheck.spec.objects import (D_DURABLE, D_LOADING, D_NONE, D_OFFLOADING, D_QUARANTINED,
                                  D_UNVERIFIED, READY)

from . import faults as EF
from .kinds import manager_for
from .manager_state import ManagerState
from .records import BlockEntry, CopyRec, Refused
from .structure import Structure
from .tiers import MAGIC, CopyInvalid, check_header, unpack


class TierCoordinator:
    """The manager's side of the tiers: one block's copy at a time (its `CopyRec`)."""

    def __init__(self, m: ManagerState, structure: Structure) -> None:
        self.m, self.s = m, structure

    def copy_restorable(self, e: BlockEntry) -> bool:
        """A copy a load can bring back: durable or in flight, of the current model weights and
        ABI, and intact — the engine scrubs the bytes (checksum) rather than trusting a flag."""
        c = e.copy
        if c.dst not in (D_DURABLE, D_LOADING, D_UNVERIFIED):
            return False
        if c.hdr["ver"] != self.m.cur["ver"] or c.hdr["abi"] != self.m.cur["abi"]:
            return False
        return self._intact(e)

    def _intact(self, e: BlockEntry) -> bool:
        if self.m.tiers is None:
            return False
        try:
            if e.copy.dst in (D_LOADING, D_UNVERIFIED):
                blob = self.m.tiers.loaded(e.key)
            else:
                blob = self.m.tiers._read(e.key)
            unpack(blob)
            return True
        except (CopyInvalid, OSError, KeyError, AssertionError):
            return False

    def offload_start(self, e: BlockEntry) -> None:
        if self.m.tiers is None:
            raise Refused("no host/disk tier")
        if e.copy.dst not in (D_NONE, D_QUARANTINED):
            raise Refused("copy already exists")
        if self.m.inflight >= self.m.cfg.max_inflight:
            raise Refused("admission: transfers in flight")
        for o in e.objs.values():
            if not (o.state == READY and o.ver == self.s.version_of(o.kind) and o.abi == self.m.cur["abi"]):
                raise Refused(f"{o.kind} of block {e.j} is not ready and current")
        objs, chunks, off = [], [], 0
        for (g, kind), o in sorted(e.objs.items()):
            raw = o.page.pool.read_raw(o.page).numpy().tobytes()       # DMA: exact bytes
            objs.append({"g": g, "kind": kind, "offset": off, "nbytes": len(raw), "ver": o.ver, "abi": o.abi})
            chunks.append(raw)
            off += len(raw)
        header = {"model_id": self.m.model_id, "block": e.j, "key": e.key, **self.m.cur,
                  "layouts": self.m.pools.layouts(), "objects": objs}
        self.m.tiers.offload(e.key, header, b"".join(chunks))
        e.copy = CopyRec(D_OFFLOADING, dict(self.m.cur), 0)
        self.m.inflight += 1
        if self.m.planted(EF.OFFLOAD_READY_BEFORE_WRITE):
            e.copy.dst = D_DURABLE                     # acknowledged at submission
            self.m.inflight -= 1
        self.s.count("on_disk:none->offloading")

    def offload_ack(self, e: BlockEntry) -> None:
        if e.copy.dst != D_OFFLOADING:
            raise Refused("no write in flight")
        self.m.tiers.wait_durable(e.key)               # durable = the write future completed
        e.copy.dst = D_DURABLE
        self.m.inflight -= 1
        self.s.count("on_disk:offloading->durable")

    def _restore_fits(self, e: BlockEntry, reserve: int) -> bool:
        missing: dict[str, int] = {}
        for o in e.objs.values():
            missing[o.kind] = missing.get(o.kind, 0) + (not o.live)
        return all(self.s.occupancy(k) + n <= self.m.cfg.cap(k) - reserve for k, n in missing.items())

    def prefetch_start(self, e: BlockEntry) -> None:
        if e.copy.dst != D_DURABLE or all(o.live for o in e.objs.values()):
            raise Refused("nothing to prefetch")
        if self.m.inflight >= self.m.cfg.max_inflight:
            raise Refused("admission: transfers in flight")
        if not self._restore_fits(e, self.m.cfg.reserve):
            raise Refused("admission: restore reserve")
        self.m.tiers.load(e.key)
        e.copy.dst = D_LOADING
        self.m.inflight += 1

    def prefetch_complete(self, e: BlockEntry) -> None:
        if e.copy.dst != D_LOADING:
            raise Refused("no load in flight")
        try:
            self.m.tiers.loaded(e.key)
        except OSError:
            pass                      # a missing/unreadable file fails verification next
        e.copy.dst = D_UNVERIFIED
        self.m.inflight -= 1

    def verify(self, e: BlockEntry, aligned: int, want_ok: bool | None = None) -> bool:
        """Verify the loaded bytes (checksum, then header) before any object becomes ready;
        place the missing objects on success, quarantine on failure. `want_ok` (the adapter's
        action: verify_ok / checksum_fail) makes a mismatching outcome a refusal."""
        if e.copy.dst != D_UNVERIFIED:
            raise Refused("nothing loaded")
        header = payload = None
        try:
            blob = self.m.tiers.loaded(e.key)
            if self.m.planted(EF.LOAD_BEFORE_CHECKSUM):
                header, payload = _unpack_unchecked(blob)
            else:
                header, payload = unpack(blob)
                check_header(header, self.m.model_id, self.m.cur)
            ok = True
        except (CopyInvalid, OSError, ValueError):
            ok = False
        trusting = self.m.planted(EF.LOAD_BEFORE_CHECKSUM) or self.m.planted(EF.DISK_COPY_KEY_UNCHECKED)
        if want_ok is not None and ok != want_ok and not trusting:     # a faulty engine places what it trusts
            raise Refused("verification outcome differs")
        if not ok:
            self.m.tiers.quarantine(e.key)
            e.copy.dst = D_QUARANTINED
            self.s.count("on_disk:loaded_unverified->quarantined")
            return False
        if not self._restore_fits(e, 0):
            if want_ok is False:                   # (fault path) cannot place it: drop it
                self.m.tiers.quarantine(e.key)
                e.copy.dst = D_QUARANTINED
                return False
            raise Refused("admission: no room to restore")
        for meta in header["objects"]:
            o = e.objs.get((meta["g"], meta["kind"]))
            if o is None or o.live:
                continue
            raw = torch.frombuffer(bytearray(payload[meta["offset"]:meta["offset"] + meta["nbytes"]]),
                                   dtype=torch.float32)
            pool = self.m.pools[o.kind]
            o.page = pool.alloc(aligned=bool(aligned))
            pool.write_raw(o.page, raw)
            o.state, o.aln, o.pool_id, o.moved = READY, int(o.page.aligned), pool.pool_id, 1
            o.ver = header[manager_for(o.kind).stamp]
            o.abi = header["abi"]
            o.epoch = header["ver"]
            self.s.count(f"{o.kind}:restore")
        e.copy.dst = D_DURABLE
        e.published = True
        return True

    def corrupt(self, e: BlockEntry) -> None:
        if e.copy.dst not in (D_OFFLOADING, D_DURABLE, D_LOADING) or e.copy.damaged:
            raise Refused("no intact copy to damage")
        self.m.tiers.corrupt(e.key, in_flight_load=e.copy.dst == D_LOADING)
        if e.copy.dst == D_LOADING:
            self.m.tiers.corrupt(e.key)
        e.copy.damaged = 1


def _unpack_unchecked(blob: bytes) -> tuple[dict, bytes]:
    """The fault `load_before_checksum`: parse the framing, skip checksum and header checks."""
    start = len(MAGIC) + 4
    (hlen,) = struct.unpack("<I", blob[len(MAGIC):start])
    header = json.loads(blob[start:start + hlen])
    return header, blob[start + hlen:-32]
