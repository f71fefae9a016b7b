"""`kvcheck diff --sut reference`: reuse vs recompute on the reference engine, bitwise, over
generated workloads (the driver is diff.py); `--backend triton` also compares the backends."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvcheck.checker.common import UsageError, check_fault, check_writable, emit
from kvcheck.reference import engine as refengine
from kvcheck.spec.config import Config
from kvcheck.spec.outputs import kvcheck_command
from kvcheck.spec.verdict import ExitCode

from . import diff as refdiff
from . import sut as refadapter


def diff_command(args: argparse.Namespace) -> int:
    """Reuse vs recompute on the reference engine, bitwise, over generated workloads."""
    if args.list_models:
        raise UsageError("--list-models applies to --sut transformers only")
    cfg = Config.load(args.config)
    if args.fault is not None:
        check_fault(args.fault, ("engine",), "`kvcheck diff --sut reference`")
    if args.model_type or args.config_json or getattr(args, "patterns", None):
        raise UsageError("--model-type/--config-json/--patterns apply to --sut transformers only")
    out = Path(args.out)
    check_writable(out)
    if args.cache_dir:
        check_writable(Path(args.cache_dir), "cache directory")
        refadapter.CACHE_ROOT = args.cache_dir
    refengine.use_backend(args.backend)
    try:
        res = refdiff.run_reference_diff(args.scenarios, args.seed, args.fault, out, cfg)
        if args.backend != "torch":
            res["cross_backend"] = _cross_backend(cfg, args.backend, args.seed)
    finally:
        refengine.use_backend("torch")
        refadapter.CACHE_ROOT = None
    res["backend"] = args.backend
    code = res["exit_code"]
    if args.backend != "torch" and code == 0 and not res["cross_backend"]["within_1e-5"]:
        code = res["exit_code"] = int(ExitCode.DIFF)
    cmd = ["diff", "--sut", "reference", "--scenarios", str(args.scenarios), "--seed", str(args.seed)]
    cmd += (["--backend", args.backend] if args.backend != "torch" else []) + \
        (["--config", args.config] if args.config else []) + (["--fault", args.fault] if args.fault else [])
    res["command"] = kvcheck_command(*cmd)

    def text() -> str:
        lines = [f"kvcheck diff --sut reference ({args.backend}): "
                 f"{'bitwise equal' if res.get('bitwise_equal') else 'MISMATCH'} (exit {code})",
                 f"  {res['scenarios']} scenarios; decisions: "
                 + ", ".join(f"{k} {v}" for k, v in res["decisions"].items()),
                 "  objects exercised: " + ", ".join(f"{k} {v}" for k, v in res["objects_exercised"].items()),
                 f"  logical hit rate {res['logical_hit_rate']}, usable hit rate {res['usable_hit_rate']}",
                 "  degradations: " + (", ".join(f"{k} {v}" for k, v in res["degradations"].items()) or "none")]
        if "cross_backend" in res:
            cb = res["cross_backend"]
            lines.append(f"  {args.backend} vs torch: max relative difference {cb['max_rel_diff']:.2e} "
                         f"over {cb['sequences']} sequences ({'within' if cb['within_1e-5'] else 'NOT within'} 1e-5)")
        for m in res.get("mismatches", []):
            lines.append(f"  FINDING [{m.get('kind', 'mismatch')}] {', '.join(m.get('checks', []))}: {m.get('message', '')}")
            if m.get("replay"):
                lines.append(f"    replay: {m['replay']}")
        lines.append(f"  seed {args.seed}; rerun: {res['command']}")
        return "\n".join(lines)

    emit(args, res, text)
    return code


def _cross_backend(cfg: Config, backend: str, seed: int, sequences: int = 3) -> dict[str, Any]:
    """The other backend's logits agree with the torch backend's (reduction orders differ)."""
    import random as _random

    from kvcheck.reference.model import HybridLM
    rng = _random.Random(seed)
    ref, other = HybridLM(cfg, seed=cfg.seed), HybridLM(cfg, seed=cfg.seed, backend=backend)
    worst = 0.0
    for _ in range(sequences):
        toks = [rng.randrange(256) for _ in range(rng.randrange(8, 3 * cfg.block_size * cfg.blocks))]
        a, b = ref.prefill(toks)[0], other.prefill(toks)[0]
        worst = max(worst, float((a - b).abs().max() / a.abs().max().clamp_min(1e-12)))
    return {"sequences": sequences, "max_rel_diff": worst, "within_1e-5": worst <= 1e-5}
