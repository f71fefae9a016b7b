"""Time to first token with prefix reuse vs full recompute on the reference engine.

A 2,048-token shared prefix (32 blocks of 64 tokens) is computed once through the engine (its
objects land in the pools); then a request with the same prefix and a private 16-token suffix
is served by reuse (lookup -> bind -> use: reconstruct the state at 2,048 from the pool pages,
then prefill the suffix) and by a full recompute of all 2,064 tokens. Reported (medians,
single-threaded): ttft_reuse_ms, ttft_recompute_ms, speedup (target >= 5x) and funnel_share:
the funnel + decision (lookup, and bind's atomic re-check) as a share of reuse TTFT (target
<= 2%); lookup_bind_share adds bind's pinning and lease bookkeeping. Prints one JSON object.

    python benchmarks/reuse.py [--repeats N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvcheck.reference.engine import Engine
from kvcheck.spec.config import Config, LayerSpec

PREFIX_BLOCKS, BLOCK, SUFFIX = 32, 64, 16


def bench_config() -> Config:
    big = 10_000
    return Config(layers=(LayerSpec("swa", window=6), LayerSpec("csa", window=6, m=8, topk=2),
                          LayerSpec("hca", window=6, m=16), LayerSpec("csa", window=6, m=8, topk=2),
                          LayerSpec("full")),
                  block_size=BLOCK, blocks=PREFIX_BLOCKS, requests=2, tiers=("device",),
                  capacity={"compressed_kv": big, "tail": big, "swa_window": big, "indexer": big})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = bench_config()
    eng = Engine(cfg)
    model = eng.model()
    suffix = list(range(40, 40 + SUFFIX))
    eng.serve(0, PREFIX_BLOCKS, suffix=suffix)           # warm the pools with the prefix
    tokens = eng.prefix + suffix
    reuse, recompute, funnel, manager, equal = [], [], [], [], True
    for _ in range(args.repeats):
        eng.submit(1, PREFIX_BLOCKS, suffix=suffix)
        req = eng.mgr.requests[1]
        t0 = time.perf_counter()
        d = eng.mgr.lookup(1)
        t1 = time.perf_counter()
        assert eng.mgr.bind_valid(req)            # bind's atomic re-check, timed on its own
        t2 = time.perf_counter()
        eng.mgr.bind(1)                           # (re-check +) pins + lease
        t3 = time.perf_counter()
        run = eng.use(1)                          # re-validate, rebuild the state from pages
        logits, _ = model.prefill(suffix, run.state)
        t4 = time.perf_counter()
        assert d.kind == 4 and d.k == PREFIX_BLOCKS, d.to_dict()
        eng.mgr.finish(1)
        reuse.append((t1 - t0) + (t4 - t2))
        funnel.append((t1 - t0) + (t2 - t1))
        manager.append((t1 - t0) + (t3 - t2))
        t3 = time.perf_counter()
        full, _ = model.prefill(tokens)
        recompute.append(time.perf_counter() - t3)
        equal = equal and torch.equal(logits, full[-SUFFIX:])
    eng.close()
    r, c = statistics.median(reuse), statistics.median(recompute)
    print(json.dumps({
        "prefix_tokens": PREFIX_BLOCKS * BLOCK, "suffix_tokens": SUFFIX, "repeats": args.repeats,
        "ttft_reuse_ms": round(r * 1e3, 2), "ttft_recompute_ms": round(c * 1e3, 2),
        "speedup": round(c / r, 2), "funnel_share": round(statistics.median(funnel) / r, 4),
        "funnel_ms": round(statistics.median(funnel) * 1e3, 3),
        "lookup_bind_ms": round(statistics.median(manager) * 1e3, 3),
        "lookup_bind_share": round(statistics.median(manager) / r, 4),
        "ttft_reuse_min_ms": round(min(reuse) * 1e3, 2), "ttft_recompute_min_ms": round(min(recompute) * 1e3, 2),
        "bitwise_equal": bool(equal), "threads": 1, "load_avg_1m": round(os.getloadavg()[0], 2),
    }))


if __name__ == "__main__":
    main()
