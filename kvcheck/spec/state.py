"""The spec's state: every variable declared and documented once, laid out as a flat tuple.

A state is a tuple of small ints (hashable, canonical, cheap to copy); `Layout` names each
slot and `View` reads a state through those names whatever the semantics of its slots
(Python ints, compiled-code fragments or z3 terms).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .config import Config
from .objects import (D_NONE, DECISIONS, DEVICE_STATES, DISK_STATES, FREE, R_IDLE,
                      REQUEST_STATES)

# Per device object (group g, kind, block j):
OBJ_FIELDS = {
    "st": "lifecycle state: free | writing | ready | evicted",
    "ver": "version stamp it was written with: compressor version for compressed_kv, indexer "
           "version for indexer, model version for tail and swa_window",
    "abi": "kernel ABI / layout fingerprint it was written with",
    "aln": "1 if its physical address meets the hardware alignment",
    "pool": "physical pool its page came from (must be its own kind's pool)",
    "ref": "reference count: the number of requests holding it",
    "gmv": "1 if it moved to another address since the last graph capture",
}
# Per logical block j:
BLOCK_FIELDS = {
    "hashed": "1 once the block's hash is published in the prefix table",
    "dst": "on-disk copy state: none | offloading | durable | loading | loaded_unverified | quarantined",
    "dver": "model version recorded in the copy's header",
    "dix": "indexer version recorded in the copy's header",
    "dcmp": "compressor version recorded in the copy's header",
    "dabi": "ABI/layout recorded in the copy's header",
    "dbad": "1 if the copy's bytes are corrupted (torn write, bit flip)",
}
# Per request slot r:
REQ_FIELDS = {
    "rst": "request state: idle | waiting | decided | bound | running | preempted",
    "rlen": "blocks of the shared prefix this request covers (its suffix is private)",
    "rk": "blocks reused by its last lookup (the lease)",
    "rpos": "blocks computed or reused so far (the resume position)",
    "rwin": "first block of its retained SWA window (pins below it were released)",
    "rdec": "decision of its last lookup: none | RECOMPUTE | PARTIAL | PREFETCH | REUSE",
    "rver": "model version at lease time (re-validated at use)",
    "rix": "indexer version at lease time",
    "rabi": "ABI at lease time",
    "rcmp": "compressor version at lease time",
}
# Globals:
GLOBAL_FIELDS = {
    "cur_ver": "current model version (weights)",
    "cur_ix": "current indexer version",
    "cur_cmp": "current compressor version (compressed-KV quantization/format)",
    "cur_abi": "current kernel ABI / layout version",
    "inflight": "transfers in flight (offloads + prefetches)",
    "graph": "1 while a captured execution graph is live",
    "gwin": "captured graph's first SWA block",
    "gpos": "captured graph's position (pages it references end here)",
}

VALUE_NAMES = {"st": DEVICE_STATES, "dst": DISK_STATES, "rst": REQUEST_STATES, "rdec": DECISIONS}


@dataclass(frozen=True)
class ObjSlot:
    group: int
    kind: str
    block: int


class Layout:
    """Names every slot of the flat state tuple."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.index: dict[tuple, int] = {}
        self.names: list[tuple] = []
        self.objects: list[ObjSlot] = []
        present = {(g, kind, j) for j in range(cfg.blocks) for g, kind in cfg.block_objects(j)}
        for g in cfg.groups:
            for kind in g.objects:
                for j in range(cfg.blocks):
                    if (g.index, kind, j) not in present:
                        continue
                    self.objects.append(ObjSlot(g.index, kind, j))
                    for f in OBJ_FIELDS:
                        self._add(("o", g.index, kind, j, f))
        for j in range(cfg.blocks):
            for f in BLOCK_FIELDS:
                self._add(("b", j, f))
        for r in range(cfg.requests):
            for f in REQ_FIELDS:
                self._add(("r", r, f))
        for f in GLOBAL_FIELDS:
            self._add(("g", f))
        self.size = len(self.names)
        self.obj_set = {(o.group, o.kind, o.block) for o in self.objects}

    def _add(self, key: tuple) -> None:
        self.index[key] = len(self.names)
        self.names.append(key)

    def has(self, g: int, kind: str, j: int) -> bool:
        return (g, kind, j) in self.obj_set

    def o(self, g: int, kind: str, j: int, f: str) -> int:
        return self.index[("o", g, kind, j, f)]

    def b(self, j: int, f: str) -> int:
        return self.index[("b", j, f)]

    def r(self, r: int, f: str) -> int:
        return self.index[("r", r, f)]

    def g(self, f: str) -> int:
        return self.index[("g", f)]

    def init(self) -> tuple[int, ...]:
        """Init: empty pools, nothing hashed, no copies, idle requests, version 0, aligned."""
        s = [0] * self.size
        for o in self.objects:
            s[self.o(o.group, o.kind, o.block, "st")] = FREE
            s[self.o(o.group, o.kind, o.block, "aln")] = 1
        for j in range(self.cfg.blocks):
            s[self.b(j, "dst")] = D_NONE
        for r in range(self.cfg.requests):
            s[self.r(r, "rst")] = R_IDLE
        return tuple(s)

    def domains(self) -> list[tuple[int, int]]:
        """TypeOK: the (lo, hi) range of every slot in every state reachable without faults."""
        cfg, n, mv = self.cfg, self.cfg.blocks, self.cfg.max_version
        ranges = {"st": (0, 3), "ver": (0, mv), "abi": (0, mv), "aln": (0, 1), "pool": (0, 3),
                  "ref": (0, cfg.requests), "gmv": (0, 1),
                  "hashed": (0, 1), "dst": (0, 5), "dver": (0, mv), "dix": (0, mv), "dcmp": (0, mv),
                  "dabi": (0, mv), "dbad": (0, 1),
                  "rst": (0, 5), "rlen": (0, n), "rk": (0, n), "rpos": (0, n), "rwin": (0, n),
                  "rdec": (0, 4), "rver": (0, mv), "rix": (0, mv), "rabi": (0, mv), "rcmp": (0, mv),
                  "cur_ver": (0, mv), "cur_ix": (0, mv), "cur_cmp": (0, mv), "cur_abi": (0, mv),
                  "inflight": (0, cfg.max_inflight), "graph": (0, 1), "gwin": (0, n), "gpos": (0, n)}
        return [ranges[key[-1]] for key in self.names]

    def describe(self, s: Sequence[int]) -> dict[str, Any]:
        """A readable dict of a concrete state (for traces and counterexamples)."""
        out: dict[str, Any] = {}
        for key, val in zip(self.names, s):
            field = key[-1]
            if field in VALUE_NAMES and 0 <= val < len(VALUE_NAMES[field]):
                val = VALUE_NAMES[field][val]
            name = ".".join(str(p) for p in key[1:]) if key[0] != "g" else key[1]
            out[name] = val
        return out


class _Fields:
    __slots__ = ("_v", "_key")

    def __init__(self, v: "View", key: tuple) -> None:
        self._v = v
        self._key = key

    def __getattr__(self, f: str) -> Any:
        return self._v.vec[self._v.lay.index[self._key + (f,)]]


class View:
    """Reads a state vector (ints, Exprs or z3 terms) by name."""

    __slots__ = ("vec", "lay")

    def __init__(self, vec: Sequence[Any], lay: Layout) -> None:
        self.vec = vec
        self.lay = lay

    def obj(self, g: int, kind: str, j: int) -> _Fields:
        return _Fields(self, ("o", g, kind, j))

    def disk(self, j: int) -> _Fields:
        return _Fields(self, ("b", j))

    def req(self, r: int) -> _Fields:
        return _Fields(self, ("r", r))

    def __getattr__(self, f: str) -> Any:
        return self.vec[self.lay.index[("g", f)]]
