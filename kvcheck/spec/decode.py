"""Decode as an action (config `decode = true`): a running request that has computed its
prompt appends one token at a time; the block is written and its hash published when it fills.

Owns `decode(r, j)`, registered into the action table (actions.py imports this module last).
State: per request `rtok` (tokens decoded into the partial block at rpos), per block `bpart`
(1 if its objects were written from a partial block: only a fault does that, and
`hit_full_blocks` forbids a hit reading one).
"""
from __future__ import annotations

from typing import Any

from . import faults as F
from .action_registry import action
from .context import write_block
from .context import Ctx
from .objects import R_RUNNING


@action(lambda lay: ({"r": r, "j": j} for r in range(lay.cfg.requests) for j in range(lay.cfg.blocks))
        if lay.cfg.decode else [])
def decode(c: Ctx, r: int, j: int) -> Any:
    """Decode one token into block j = rpos past the prompt; when the block fills it is written
    (objects, pins) and its hash published, and the request's length grows by a block."""
    L, q, b = c.L, c.v.req(r), c.cfg.block_size
    full = L.let(q.rtok == b - 1)
    early = c.planted(F.DECODE_PUBLISHES_PARTIAL)
    write = L.let(L.Or(full, q.rtok == 0)) if early else full
    guard = write_block(c, r, j, write, full)
    c.set(("r", r, "rtok"), L.If(full, 0, q.rtok + 1))
    c.set(("r", r, "rlen"), L.If(full, j + 1, j))
    c.set(("b", j, "bpart"), L.If(full, 0, 1) if early else L.If(full, 0, c.v.disk(j).bpart))
    return L.And(q.rst == R_RUNNING, q.rpos == j, q.rlen == j, *guard)
