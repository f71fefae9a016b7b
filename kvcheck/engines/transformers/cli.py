"""`kvcheck diff --sut transformers`: one model type (exit 0/11, 2 unsupported, 3 cannot drive this
release), or `--list-models`."""
from __future__ import annotations

import argparse

from kvcheck.checker.common import UsageError, emit
from kvcheck.fuzz.boundary import CannotDrive
from kvcheck.spec.outputs import kvcheck_command
from kvcheck.spec.verdict import ExitCode

from . import oracle as hf


def diff_command(args: argparse.Namespace) -> int:
    """`--sut transformers`: one model type (exit 0/11, 2 unsupported, 3 cannot drive), or `--list-models`."""
    if args.backend != "torch":
        raise UsageError("--backend applies to --sut reference only")
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
    cmd = kvcheck_command(*["diff", "--sut", "transformers", "--model-type", args.model_type,
                            "--dtype", args.dtype, "--scenarios", str(args.scenarios), "--seed", str(args.seed)]
                          + (["--config-json", args.config_json] if args.config_json else [])
                          + (["--fault", args.fault] if args.fault else []))
    try:
        res = hf.run_diff(args.model_type, config_json=args.config_json, dtype=args.dtype,
                          scenarios=args.scenarios, seed=args.seed, fault=args.fault, out_dir=args.out,
                          cover=True)
    except hf.AdapterError as e:
        raise UsageError(str(e)) from None
    except CannotDrive as e:     # kvcheck's side of the boundary (interface.py, fuzz/boundary.py): no verdict
        res = e.result(sut="transformers", model_type=args.model_type, dtype=args.dtype, seed=args.seed,
                       fault=args.fault, transformers_version=e.release, verdict="cannot drive", command=cmd)
        emit(args, res, lambda: e.line)
        return int(res["exit_code"])
    code = int({"unsupported": ExitCode.USAGE, "divergent": ExitCode.DIFF,
                "error": ExitCode.DIFF}.get(res["verdict"], ExitCode.OK))
    res["exit_code"] = code
    res["command"] = cmd
    emit(args, res, lambda: hf.render_text(res, code) + f"\n  seed {args.seed}; rerun: {res['command']}")
    return code
