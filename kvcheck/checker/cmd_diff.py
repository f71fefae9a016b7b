"""`kvcheck diff`: reuse vs full recompute, on the reference engine or a transformers model."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..spec.config import Config
from ..spec.outputs import kvcheck_command
from ..spec.verdict import ExitCode
from .common import UsageError, check_fault, check_writable, emit


def cmd_diff(args: argparse.Namespace) -> int:
    """Reuse vs full recompute. `--sut transformers`: a Hugging Face model built from a config."""
    if args.scenarios is None:
        args.scenarios = 200 if args.sut == "reference" else 20
    if args.sut == "reference" and args.list_models:
        raise UsageError("--list-models applies to --sut transformers only")
    if args.sut == "reference":
        return _diff_reference(args)
    if args.backend != "torch":
        raise UsageError("--backend applies to --sut reference only")
    return _diff_transformers(args)


def _diff_transformers(args: argparse.Namespace) -> int:
    """`--sut transformers`: one model type (exit 0/11, 2 unsupported), or `--list-models`."""
    from kvcheck.engines.transformers import oracle as hf
    if args.list_models:
        try:
            models = hf.list_models(args.out)
        except hf.AdapterError as e:
            raise UsageError(str(e)) from None

        def listing() -> str:
            lines = [f"{len(models)} hybrid model types (last verdicts from {hf.verdicts_path(args.out)}):"]
            for m in models:
                last = ", ".join(f"{dt} {v['verdict']}" for dt, v in sorted(m["last_verdicts"].items())) or "not run"
                what = ", ".join(k for k in m["layer_kinds"] if k != "full_attention") or ", ".join(m["fields"])
                lines.append(f"  {m['model_type']:28} {what[:60]:60} {last}")
            return "\n".join(lines)

        emit(args, {"models": models, "verdicts_file": hf.verdicts_path(args.out)}, listing)
        return 0
    if not args.model_type:
        raise UsageError("--sut transformers needs --model-type NAME (see --list-models)")
    try:
        res = hf.run_diff(args.model_type, config_json=args.config_json, dtype=args.dtype,
                          scenarios=args.scenarios, seed=args.seed, fault=args.fault, out_dir=args.out,
                          cover=True)
    except hf.AdapterError as e:
        raise UsageError(str(e)) from None
    code = int({"unsupported": ExitCode.USAGE, "divergent": ExitCode.DIFF,
                "error": ExitCode.DIFF}.get(res["verdict"], ExitCode.OK))
    res["exit_code"] = code
    res["command"] = kvcheck_command(*["diff", "--sut", "transformers", "--model-type", args.model_type,
                               "--dtype", args.dtype, "--scenarios", str(args.scenarios), "--seed", str(args.seed)]
                              + (["--config-json", args.config_json] if args.config_json else [])
                              + (["--fault", args.fault] if args.fault else []))
    emit(args, res, lambda: hf.render_text(res, code) + f"\n  seed {args.seed}; rerun: {res['command']}")
    return code


def _diff_reference(args: argparse.Namespace) -> int:
    """Reuse vs recompute on the reference engine, bitwise, over generated workloads."""
    from ..fuzz import diff as refdiff
    from ..reference import engine as refengine
    cfg = Config.load(args.config)
    if args.fault is not None:
        check_fault(args.fault, ("engine",), "`kvcheck diff --sut reference`")
    if args.model_type or args.config_json:
        raise UsageError("--model-type/--config-json apply to --sut transformers only")
    out = Path(args.out)
    check_writable(out)
    from kvcheck.engines.reference import sut as refadapter
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

    from ..reference.model import HybridLM
    rng = _random.Random(seed)
    ref, other = HybridLM(cfg, seed=cfg.seed), HybridLM(cfg, seed=cfg.seed, backend=backend)
    worst = 0.0
    for _ in range(sequences):
        toks = [rng.randrange(256) for _ in range(rng.randrange(8, 3 * cfg.block_size * cfg.blocks))]
        a, b = ref.prefill(toks)[0], other.prefill(toks)[0]
        worst = max(worst, float((a - b).abs().max() / a.abs().max().clamp_min(1e-12)))
    return {"sequences": sequences, "max_rel_diff": worst, "within_1e-5": worst <= 1e-5}


