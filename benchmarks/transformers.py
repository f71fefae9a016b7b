"""Every hybrid model type of the installed transformers through `kvcheck diff --sut transformers`.

Discovers the model types (as `--list-models` does), runs each once (tiny derived config,
--scenarios scenarios, one dtype, one thread) and reports per model type the verdict, the first
divergent operation and the seconds it took, plus the discovery time and the verdict counts.
Timings are wall-clock on a shared machine: noisy. Prints one JSON object.

    PYTHONPATH=. python benchmarks/transformers.py [--scenarios 3] [--dtype float32] [--only a,b]

--no-discovery (with --only): describe just the named model types instead of discovering every
one first (a quick run; model_types_listed and discovery_seconds then cover only those).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# this file is named like the library: keep its folder off the path so `import transformers` finds
# the real one
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import torch  # noqa: E402


def _describe(model_types: list[str]) -> list[dict]:
    """`hf.list_models()`'s rows for just these model types (what it finds for each)."""
    from kvcheck.engines.transformers.models import decoder_type, describe

    rows = []
    for mt in model_types:
        info = describe(mt)
        if info is not None:
            if decoder_type(mt) != mt:
                info["runs_as"] = decoder_type(mt)
            rows.append(dict(info, last_verdicts={}))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="comma-separated model types (default: all listed)")
    ap.add_argument("--no-discovery", action="store_true",
                    help="with --only: describe just those model types, not every one (a quick run; "
                         "model_types_listed and discovery_seconds then cover only them)")
    args = ap.parse_args()
    if args.no_discovery and not args.only:
        ap.error("--no-discovery needs --only")
    torch.set_num_threads(1)
    import transformers

    from kvcheck.engines.transformers import oracle as hf

    only = set(args.only.split(",")) if args.only else None
    t0 = time.monotonic()
    listed = _describe(sorted(only)) if args.no_discovery else hf.list_models()
    discovery_s = time.monotonic() - t0
    rows = hf.sweep(None if only is None else sorted(only), dtypes=(args.dtype,), scenarios=args.scenarios,
                    seed=args.seed, listed=listed)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    print(json.dumps(dict(
        transformers_version=transformers.__version__, torch_version=torch.__version__, dtype=args.dtype,
        scenarios_per_model=args.scenarios, seed=args.seed, discovery=not args.no_discovery,
        model_types_listed=len(listed),
        model_types_run=len(rows), discovery_seconds=round(discovery_s, 2),
        total_seconds=round(time.monotonic() - t0, 2), verdicts=counts,
        models=[dict(model_type=r["model_type"], runs_as=r["runs_as"], verdict=r["verdict"],
                     seconds=r["seconds"], max_abs_diff=r["max_abs_diff"],
                     first_divergent_operation=r["first_divergent_operation"]) for r in rows],
    ), indent=1, default=str))


if __name__ == "__main__":
    main()
