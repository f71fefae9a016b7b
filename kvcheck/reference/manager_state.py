"""What the cache manager's collaborators see of it, as Protocols.

`ManagerState`: the records and current versions one CacheManager holds and its collaborators
(structure.py, funnel.py, tier_coordinator.py, slots.py) read and update. `RequestOps`: the
request operations the allocator (slots.py) drives. The collaborators depend on these
interfaces, never on manager.py; CacheManager builds them with itself as the state, so that
manager.py alone imports them and the import graph has no cycle.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from kvcheck.spec.config import Config
from kvcheck.spec.faults import Planted

from .pools import PoolSet
from .records import BlockEntry, Request, Slots
from .tiers import TierStore


class ManagerState(Protocol):
    """One cache manager's records (see CacheManager.__init__ for their meaning)."""

    cfg: Config
    model_id: str
    planted: Planted                    # the engine fault probe (faults.py)
    B: int                              # tokens per block
    cur: dict[str, int]                 # current versions: ver (weights), ix, cmp, abi
    pools: PoolSet
    tiers: TierStore | None             # the host/disk tiers (None: offload disabled)
    entries: dict[str, BlockEntry]      # the prefix table: chained hash -> entry
    requests: dict[int, Request]
    inflight: int                       # transfers in flight
    graph: dict[str, Any] | None        # the captured graph: {"win", "pos", "ptrs"}
    stats: dict[str, Any]
    slots: Slots | None                 # prompts > 1: each position's physical block
    bpart: list[int]                    # per block: written from a partial block (decode)
    last_use: list[int]                 # per block: the clock of its last use (LRU)
    clock: int
    base_hashes: list[str]              # the hashes of prompt 0, naming each position's block


class RequestOps(Protocol):
    """The manager's request operations an allocation that evicts or fails runs (slots.py)."""

    def request_in(self, rid: int, states: tuple[int, ...]) -> Request: ...

    def write_plan(self, req: Request, j: int, key: str | None = None, prefix: tuple[int, ...] | None = None
                   ) -> tuple[BlockEntry, dict, dict[str, int], bool]: ...

    def append(self, rid: int, j: int, data: dict[tuple[int, str], torch.Tensor], key: str | None = None,
               prefix: tuple[int, ...] | None = None, decoding: bool = False, done: bool = True) -> None: ...

    def preempt(self, rid: int) -> None: ...
