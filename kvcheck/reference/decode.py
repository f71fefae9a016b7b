"""Decode in the reference engine (config `decode = true`): a running request that has computed
its prompt appends one token at a time (the prompt's continuation, so that a later request of
the same prompt can hit it); the block is written and its hash published when it fills.

A collaborator of Engine: it runs the model and writes through the engine's cache manager, and
sees the engine only through `DecodeHost` (engine.py imports this module, not the other way
round). The request's tokens are its n full blocks, the tokens decoded into the partial block,
then its private suffix; a bind drops the partial tokens (they are decoded again after the
hit, as the spec's `rtok = 0` at bind says).
"""
from __future__ import annotations

from typing import Protocol

import torch

from kvcheck.spec.config import Config
from kvcheck.spec.objects import R_RUNNING

from . import faults as EF
from .manager import CacheManager
from .model import HybridLM, ModelState
from .records import Refused
from .run import Run
from .slots import content_key


class DecodeHost(Protocol):
    """What decode needs of the engine: its config, manager, runs and prompts, the model of the
    current weights, and how a state's block is cut into page data."""

    cfg: Config
    B: int
    mgr: CacheManager
    runs: dict[int, Run]
    prompts: list[list[int]]

    def model(self, ver: int | None = None) -> HybridLM: ...

    def block_data(self, st: ModelState, j: int) -> dict[tuple[int, str], torch.Tensor]: ...

    def fields(self, g: int, kind: str, j: int) -> list[tuple[int, str, tuple[int, ...]]]: ...

    def mgr_block_kinds(self, j: int) -> list[tuple[int, str]]: ...


class Decoder:
    """Decode for one engine (`Engine.decode` delegates here)."""

    def __init__(self, host: DecodeHost) -> None:
        self.host = host

    def decode(self, rid: int, j: int) -> None:
        """One decoded token into block j (j = the request's length in blocks)."""
        h = self.host
        mgr, B = h.mgr, h.B
        req, run = mgr.requests.get(rid), h.runs.get(rid)
        if not h.cfg.decode:
            raise Refused("decode is off (decode = false)")
        if req is None or run is None or req.st != R_RUNNING or req.pos != j or req.n != j \
                or j >= h.cfg.blocks:
            raise Refused(f"request {rid} cannot decode into block {j} now")
        at = j * B + req.tok
        tok = h.prompts[req.p][at]
        logits, st = h.model().prefill([tok], run.state)
        run.probe = None
        full = req.tok == B - 1
        if full:
            toks = req.tokens[:at] + [tok]
            key = mgr.hashes(toks, j + 1, req.extra)[j]
            old, req.hashes = req.hashes, req.hashes[:j] + [key]     # the pins reach block j
            try:
                mgr.append(rid, j, h.block_data(st, j), key=key, prefix=content_key(req.salt, toks), decoding=True)
            except Refused:
                req.hashes = old
                raise
            req.n = j + 1
        elif req.tok == 0 and mgr.planted(EF.DECODE_PUBLISHES_PARTIAL):
            # the faulty engine hashes the block from its scheduled token ids at the first token
            # and caches what the state holds so far (nothing of the block: zeros)
            toks = h.prompts[req.p][:(j + 1) * B]
            key = mgr.hashes(toks, j + 1, req.extra)[j]
            mgr.append(rid, j, self._zeros(j), key=key, prefix=content_key(req.salt, toks), decoding=True, done=False)
        req.tokens.insert(at, tok)
        req.tok = 0 if full else req.tok + 1
        run.logits.append(logits)
        run.state = st

    def _zeros(self, j: int) -> dict[tuple[int, str], torch.Tensor]:
        return {(g, kind): torch.zeros(sum(_numel(s) for _, _, s in self.host.fields(g, kind, j)))
                for g, kind in self.host.mgr_block_kinds(j)}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
