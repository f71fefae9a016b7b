"""The spec's state: every variable declared and documented once, laid out as a flat tuple.

A state is a tuple of small ints (hashable, canonical, cheap to copy); `Layout` names each
slot and `View` reads a state through those names whatever the semantics of its slots
(Python ints, compiled-code fragments or z3 terms).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .config import Config
from .objects import (D_NONE, DECISIONS, DEVICE_STATES, DISK_STATES, FREE, POOL, R_IDLE,
                      REQUEST_STATES, block_objects)

@dataclass(frozen=True)
class Field:
    """One state variable: what it means, its domain [0, hi(cfg)] (TypeOK) and its initial
    value (Init); `values` names its values where they are an enumeration."""

    doc: str
    hi: Callable[[Config], int] = lambda cfg: 1
    init: int = 0
    values: tuple[str, ...] = ()
    when: Callable[[Config], bool] = lambda cfg: True   # the semantic that needs it is on


def _enum(doc: str, values: tuple[str, ...], init: int = 0) -> Field:
    return Field(doc, lambda cfg: len(values) - 1, init, values)


def _versions(cfg: Config) -> int:
    return cfg.max_version


def _blocks(cfg: Config) -> int:
    return cfg.blocks


def _window_steps(cfg: Config) -> int:
    return len(cfg.window_steps()) - 1


def _prompt_ids(cfg: Config) -> int:
    return cfg.prompts - 1


def _with_prompts(cfg: Config) -> bool:
    return cfg.prompts > 1


# Per device object (group g, kind, block j):
OBJ_FIELDS = {
    "st": _enum("lifecycle state: free | writing | ready | evicted", DEVICE_STATES, FREE),
    "ver": Field("version stamp it was written with: compressor version for compressed_kv, "
                 "indexer version for indexer, model version for tail and swa_window", _versions),
    "abi": Field("kernel ABI / layout fingerprint it was written with", _versions),
    "aln": Field("1 if its physical address meets the hardware alignment", init=1),
    "pool": Field("physical pool its page came from (must be its own kind's pool)",
                  lambda cfg: max(POOL.values())),
    "ref": Field("reference count: the number of requests holding it", lambda cfg: cfg.requests),
    "gmv": Field("1 if it moved to another address since the last graph capture"),
    "dup": Field("1 if a second physical copy of it is cached (duplicates = allow: a request "
                 "recomputed it instead of sharing it; `ref` counts the holders of both: "
                 "duplicates.py)", when=lambda cfg: cfg.duplicates == "allow"),
}
# Per logical block j:
BLOCK_FIELDS = {
    "hashed": Field("1 once the block's hash is published in the prefix table"),
    "dst": _enum("on-disk copy state: none | offloading | durable | loading | loaded_unverified | "
                 "quarantined", DISK_STATES, D_NONE),
    "dver": Field("model version recorded in the copy's header", _versions),
    "dix": Field("indexer version recorded in the copy's header", _versions),
    "dcmp": Field("compressor version recorded in the copy's header", _versions),
    "dabi": Field("ABI/layout recorded in the copy's header", _versions),
    "dbad": Field("1 if the copy's bytes are corrupted (torn write, bit flip)"),
    # prompts > 1 (content.py): which prompt lineage's content the block slot holds, and under
    # which lineage's chained hash it is published (equal unless the hash table went stale)
    "bcid": Field("content the block holds: the prompt lineage whose prefix it was computed "
                  "from (content.py)", _prompt_ids, when=_with_prompts),
    "bkey": Field("content its published hash names (the lineage looked up)", _prompt_ids,
                  when=_with_prompts),
    "dcid": Field("content its on-disk copy holds (the lineage at offload time)", _prompt_ids,
                  when=lambda cfg: cfg.prompts > 1 and cfg.offload_enabled),
    "bpart": Field("1 if its objects were written from a partial block (decode.py)",
                   when=lambda cfg: cfg.decode),
}
# Per request slot r:
REQ_FIELDS = {
    "rst": _enum("request state: idle | waiting | decided | bound | running | preempted",
                 REQUEST_STATES, R_IDLE),
    "rlen": Field("blocks of the shared prefix this request covers (its suffix is private)", _blocks),
    "rk": Field("blocks reused by its last lookup (the lease)", _blocks),
    "rpos": Field("blocks computed or reused so far (the resume position)", _blocks),
    "rwin": Field("its retained SWA windows: a step of Config.window_steps, which gives every "
                  "group's first retained block (pins below them were released); with one "
                  "finite window, that window's first block", _window_steps),
    "rdec": _enum("decision of its last lookup: none | RECOMPUTE | PARTIAL | PREFETCH | REUSE", DECISIONS),
    "rver": Field("model version at lease time (re-validated at use)", _versions),
    "rix": Field("indexer version at lease time", _versions),
    "rabi": Field("ABI at lease time", _versions),
    "rcmp": Field("compressor version at lease time", _versions),
    "rp": Field("the request's prompt (content.py), drawn at submit", _prompt_ids, when=_with_prompts),
    "rtok": Field("tokens decoded into the partial block at rpos (decode.py)",
                  lambda cfg: cfg.block_size - 1, when=lambda cfg: cfg.decode),
}
# Globals:
GLOBAL_FIELDS = {
    "cur_ver": Field("current model version (weights)", _versions),
    "cur_ix": Field("current indexer version", _versions),
    "cur_cmp": Field("current compressor version (compressed-KV quantization/format)", _versions),
    "cur_abi": Field("current kernel ABI / layout version", _versions),
    "inflight": Field("transfers in flight (offloads + prefetches)", lambda cfg: cfg.max_inflight),
    "graph": Field("1 while a captured execution graph is live"),
    "gwin": Field("captured graph's SWA windows (a step of Config.window_steps, as rwin)",
                  _window_steps),
    "gpos": Field("captured graph's position (pages it references end here)", _blocks),
}
FIELDS: dict[str, Field] = {**OBJ_FIELDS, **BLOCK_FIELDS, **REQ_FIELDS, **GLOBAL_FIELDS}
assert len(FIELDS) == len(OBJ_FIELDS) + len(BLOCK_FIELDS) + len(REQ_FIELDS) + len(GLOBAL_FIELDS)


def field_docs(fields: dict[str, Field], cfg: Config | None = None) -> dict[str, str]:
    """What each field means (only those present under cfg's semantics, when given)."""
    return {name: f.doc for name, f in fields.items() if cfg is None or f.when(cfg)}


VALUE_NAMES = {name: f.values for name, f in FIELDS.items() if f.values}


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

        def on(fields: dict[str, Field]) -> list[str]:
            return [f for f, d in fields.items() if d.when(cfg)]
        present = {(g, kind, j) for j in range(cfg.blocks) for g, kind in block_objects(cfg, j)}
        for g in cfg.groups:
            for kind in g.objects:
                for j in range(cfg.blocks):
                    if (g.index, kind, j) not in present:
                        continue
                    self.objects.append(ObjSlot(g.index, kind, j))
                    for f in on(OBJ_FIELDS):
                        self._add(("o", g.index, kind, j, f))
        for j in range(cfg.blocks):
            for f in on(BLOCK_FIELDS):
                self._add(("b", j, f))
        for r in range(cfg.requests):
            for f in on(REQ_FIELDS):
                self._add(("r", r, f))
        for f in on(GLOBAL_FIELDS):
            self._add(("g", f))
        self.size = len(self.names)
        # per group, its first retained block at each window step (None: full attention)
        steps = cfg.window_steps()
        self.window_lo: list[list[int] | None] = [
            None if g.window is None else [s[g.index] for s in steps] for g in cfg.groups]
        self.narrowest_lo = [max(s) for s in steps]      # the latest start of any group's window
        self.obj_set = {(o.group, o.kind, o.block) for o in self.objects}

    def _add(self, key: tuple) -> None:
        self.index[key] = len(self.names)
        self.names.append(key)

    def has(self, g: int, kind: str, j: int) -> bool:
        return (g, kind, j) in self.obj_set

    def o(self, g: int, kind: str, j: int, f: str) -> int:
        return self.index[("o", g, kind, j, f)]

    def label(self, o: ObjSlot, block: bool = True) -> str:
        """An object as messages name it, in the config's vocabulary: a config whose layers are
        all full attention calls its pages `full` (its capacity key), not `swa_window`."""
        kind = self.cfg.kind_name(o.kind)
        return f"{kind}[g{o.group},b{o.block}]" if block else f"{kind}[g{o.group}]"

    def b(self, j: int, f: str) -> int:
        return self.index[("b", j, f)]

    def r(self, r: int, f: str) -> int:
        return self.index[("r", r, f)]

    def g(self, f: str) -> int:
        return self.index[("g", f)]

    def init(self) -> tuple[int, ...]:
        """Init: empty pools, nothing hashed, no copies, idle requests, version 0, aligned."""
        return tuple(FIELDS[key[-1]].init for key in self.names)

    def domains(self) -> list[tuple[int, int]]:
        """TypeOK: the (lo, hi) range of every slot in every state reachable without faults."""
        his = {name: f.hi(self.cfg) for name, f in FIELDS.items()}
        return [(0, his[key[-1]]) for key in self.names]

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
