"""Helpers for disk-tier tests at the engine level: fill, offload, evict, restore."""
from __future__ import annotations

import dataclasses

import torch

from kvcheck.reference.engine import Engine, suffix_tokens
from kvcheck.spec.config import Config

ROOMY = Config(capacity={"compressed_kv": 20, "tail": 20, "swa_window": 40, "indexer": 20})


def other_weights(cfg: Config = ROOMY, seed: int = 1) -> Config:
    """The same architecture with other weights (another seed)."""
    return dataclasses.replace(cfg, seed=seed)


def entry(eng: Engine, j: int):
    return eng.mgr.entry(eng.prefix_hashes[j], j)


def filled(cfg: Config, cache_dir, **kw) -> Engine:
    """An engine that served the whole prefix once and offloaded every block (durable)."""
    eng = Engine(cfg, cache_dir=str(cache_dir), **kw)
    eng.serve(0, cfg.blocks)
    for j in range(cfg.blocks):
        e = entry(eng, j)
        eng.mgr.offload_start(e)
        eng.mgr.offload_ack(e)
    return eng


def evict(eng: Engine, j: int) -> None:
    for o in entry(eng, j).objs.values():
        if o.live:
            eng.mgr.evict(o)


def restore(eng: Engine, j: int) -> bool:
    """Load block j's copy back; True when it was verified and placed."""
    e = entry(eng, j)
    eng.mgr.prefetch_start(e)
    eng.mgr.prefetch_complete(e)
    return eng.mgr.verify(e, 1)


def decision(eng: Engine, n: int | None = None) -> dict:
    """What a lookup over the prefix would answer now (no state change)."""
    n = eng.cfg.blocks if n is None else n
    toks = eng.prefix[:n * eng.B] + suffix_tokens(1, 0)
    return eng.mgr.probe_decision(toks, n, eng.extra(eng.salt)).to_dict()


def served_equals_recompute(eng: Engine, rid: int = 1) -> tuple[dict, bool]:
    res = eng.serve(rid, eng.cfg.blocks)
    toks = eng.prefix[:eng.cfg.blocks * eng.B] + suffix_tokens(rid, 0)
    return res, torch.equal(res["logits"], eng.recompute(toks)[res["start"]:])
