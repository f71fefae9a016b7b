"""Speed of the reference model on this machine: one JSON object on stdout.

decode_step_ms: median of one decode step at position 512 (default config); prefill_512_ms:
median of a one-shot 512-token prefill; single-threaded (the headline: the model is small and
per-op overhead bound), then again with torch's default threads (`default_threads`), plus the
cost of the GEMM rule (`gemm_rule`: kernels.projection.linear vs plain `x @ w`, summed over
the model's weight shapes, at 1 and 512 rows, single-threaded medians), and the
load average (other processes on a 2-core box distort multi-thread numbers badly: an OpenMP
region waits for a descheduled worker). Bits do not depend on the thread count.
Speed is never asserted by tests. --smoke: a tiny run that only checks this script works (a
16-token prefill, decode at position 16, 2 repetitions, GEMM rows 1 and 16; the keys name the
size it ran, e.g. prefill_16_ms): its figures are not comparable with a full run's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

if __package__ in (None, ""):  # run as a script: make the repo root importable
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcheck.reference.model import HybridLM  # noqa: E402


def _times_ms(fn, reps: int) -> list[float]:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return ts


def _measure(model: HybridLM, toks: list[int], smoke: bool = False) -> dict:
    """Medians (the targets' measure) and minima (the cost without other processes' noise)."""
    n, pre_reps, dec_reps = (16, 2, 2) if smoke else (512, 11, 200)
    pre = _times_ms(lambda: model.prefill(toks[:n]), pre_reps)
    _, st = model.prefill(toks[:n])
    dec = _times_ms(lambda: model.decode(toks[n], st), dec_reps)
    _, st0 = model.prefill(toks[:8])
    dec8 = _times_ms(lambda: model.decode(toks[8], st0), dec_reps)
    r = lambda v: round(v, 3)  # noqa: E731
    return {"decode_step_ms": r(statistics.median(dec)), f"prefill_{n}_ms": r(statistics.median(pre)),
            "decode_step_at_8_ms": r(statistics.median(dec8)),
            "decode_step_min_ms": r(min(dec)), f"prefill_{n}_min_ms": r(min(pre))}


def _gemm_rule_cost(model: HybridLM, smoke: bool = False) -> dict:
    """linear (the batch-invariant GEMM rule) vs plain x @ w at the model's weight shapes."""
    from kvcheck.kernels.projection import linear
    shapes = sorted({tuple(w.shape) for w in [*model._w_in, *model.weights.values()]
                     if w.dim() == 2 and w.shape[0] in (model.width, model.mlp)})
    g = torch.Generator().manual_seed(2)
    out = {}
    for m, reps in ((1, 2), (16, 2)) if smoke else ((1, 300), (512, 30)):
        t = {"plain": 0.0, "linear": 0.0}
        for k, n in shapes:
            x, w = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
            t["plain"] += statistics.median(_times_ms(lambda: x @ w, reps))
            t["linear"] += statistics.median(_times_ms(lambda: linear(x, w), reps))
        out[f"rows_{m}"] = {"plain_ms": round(t["plain"], 4), "linear_ms": round(t["linear"], 4),
                            "ratio": round(t["linear"] / t["plain"], 2)}
    return {"shapes": [list(s) for s in shapes], **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes and 2 repetitions: checks the script runs, figures not comparable")
    smoke = ap.parse_args().smoke
    model = HybridLM()
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, 256, (513,), generator=g).tolist()
    default_threads = torch.get_num_threads()
    load_before = os.getloadavg()[0]
    torch.set_num_threads(1)
    one = _measure(model, toks, smoke)
    gemm = _gemm_rule_cost(model, smoke)
    torch.set_num_threads(default_threads)
    multi = _measure(model, toks, smoke)
    print(json.dumps({
        **one, "threads": 1, "smoke": smoke,
        "decode_target_ms": 2.0, "prefill_target_ms": 100.0,
        "gemm_rule": gemm, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "default_threads": {"threads": default_threads, **multi},
        "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "layers": [l.kind for l in model.config.layers],
        "torch": torch.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
        "fingerprint": model.fingerprint[:16],
    }))


if __name__ == "__main__":
    main()
