"""The cache manager's records: objects over pages, block entries, copies, positions' physical
blocks (prompts > 1), requests, decisions.

Owns the engine's bookkeeping data (what a prefix table entry, a request's lease and a block's
on-disk copy hold); the behaviour lives in manager.py and its collaborators (structure.py,
funnel.py, slots.py, tier_coordinator.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvcheck.spec.config import Config
from kvcheck.spec.objects import D_NONE, DECISIONS, FREE, R_WAITING, READY, REASONS, WRITING

from .pools import Page


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


@dataclass
class Slots:
    """Position j's physical block (prompts > 1, see slots.py): its objects, its copy, the hash
    the table maps to it and the token prefixes its content and that hash were computed from."""

    objs: list[dict[tuple[int, str], ObjRec]]
    copy: list[CopyRec]
    key: list[str | None]
    content: list[tuple[int, ...]]
    keyed_by: list[tuple[int, ...]]

    @classmethod
    def make(cls, cfg: Config, kinds: Callable[[int], list[tuple[int, str]]]) -> "Slots":
        n = cfg.blocks
        return cls([{gk: ObjRec(gk[0], gk[1], j) for gk in kinds(j)} for j in range(n)],
                   [CopyRec() for _ in range(n)], [None] * n, [()] * n, [()] * n)


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
    win: tuple[int, ...] = ()            # per group: the first block of its window it pins
    dec: int = 0
    lease: dict = field(default_factory=lambda: {"ver": 0, "ix": 0, "abi": 0, "cmp": 0})
    pins: frozenset = frozenset()
    bound_ptrs: dict = field(default_factory=dict)   # ObjRec -> (page, gen) at bind
    p: int = 0                           # the prompt (prompts > 1)
    tok: int = 0                         # tokens decoded into the partial block at pos (decode)
    extra: Any = None                    # the extra keys its hashes were computed with
    serial: int = 0                      # submit order (the scheduler preempts the newest)


@dataclass
class Decision:
    kind: int
    k: int
    logical: int
    bits: int

    def to_dict(self) -> dict[str, Any]:
        return {"kind": DECISIONS[self.kind], "k": self.k, "logical": self.logical,
                "reasons": [n for n, b in REASONS if self.bits & b]}
