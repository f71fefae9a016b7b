"""Speed of the reference model on this machine: one JSON object on stdout.

decode_step_ms: median of one decode step at position ~512 (default config); prefill_512_ms:
median of a one-shot 512-token prefill. Speed is never asserted by tests.
"""
from __future__ import annotations

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


def _median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main() -> None:
    model = HybridLM()
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, 256, (513,), generator=g).tolist()
    prefill = _median_ms(lambda: model.prefill(toks[:512]), 15)
    _, st = model.prefill(toks[:512])
    decode = _median_ms(lambda: model.decode(toks[512], st), 200)
    _, st0 = model.prefill(toks[:8])
    decode_short = _median_ms(lambda: model.decode(toks[8], st0), 200)
    print(json.dumps({
        "decode_step_ms": round(decode, 3),
        "decode_step_at_8_ms": round(decode_short, 3),
        "prefill_512_ms": round(prefill, 3),
        "decode_target_ms": 2.0, "prefill_target_ms": 100.0,
        "layers": [l.kind for l in model.config.layers],
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(), "machine": platform.machine(),
        "fingerprint": model.fingerprint[:16],
    }))


if __name__ == "__main__":
    main()
