"""`kvcheck diff --sut transformers`: one model type (exit 0/11, 2 unsupported, 3 cannot drive this
release), or `--list-models`."""
from __future__ import annotations

import argparse

from kvcheck.checker.common import UsageError, emit
from kvcheck.fuzz.boundary import CannotDrive
from kvcheck.fuzz.known import judge, known_lines, parse_cli
from kvcheck.spec.outputs import kvcheck_command
from kvcheck.spec.verdict import ExitCode

from . import known
from . import oracle as hf
from .pattern_runs import render as render_patterns
from .pattern_runs import run_patterns
from .patterns import SETS
from .ratios import SIZES


def finding(res: dict, cmd: str) -> dict:
    """A divergent (or crashed) run as a finding record, in the fields fuzz findings have."""
    op = res.get("first_divergent_operation")
    layer = res.get("first_divergent_layer")
    if res["verdict"] == "error":
        what = "; ".join(res.get("errors") or [res.get("error") or "a model call crashed"])[:300]
    else:
        what = (f"reuse differs from the full recompute by {res.get('max_abs_diff', 0):.3g} (tolerance "
                f"{res.get('tolerance', 0):.3g})" + (f", first at layer {layer}" if layer is not None else "")
                + (f", in {op}" if op else ""))
    if res.get("pattern_label"):         # --patterns: which pattern's run it is
        what = f"pattern {res['pattern_label']}: {what}"
    return {"kind": "differential", "check": "reuse_equals_recompute", "message": what, "replay": cmd,
            "layout": res.get("model_type")} | ({"pattern": res["pattern"]} if res.get("pattern") else {})


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
                for kind, c in (m.get("layer_caches") or {}).items():
                    objs = ", ".join(f"{a} {k}" for a, k in c["objects"].items()) or "nothing cached"
                    lines.append(f"      {kind:30} {c['cache_class'] or 'no cache layer class'}: {objs}")
            return "\n".join(lines)

        emit(args, {"models": models, "verdicts_file": hf.verdicts_path(args.out)}, listing)
        return 0
    if not args.model_type:
        raise UsageError("--sut transformers needs --model-type NAME (see --list-models)")
    which = getattr(args, "patterns", None) or "default"
    if which not in SETS:
        raise UsageError(f"unknown --patterns {which!r}; use one of {', '.join(SETS)}")
    sizes = getattr(args, "sizes", None) or "fixed"
    if sizes not in SIZES:
        raise UsageError(f"unknown --sizes {sizes!r}; use one of {', '.join(SIZES)}")
    try:
        acks = parse_cli(getattr(args, "acknowledge", None))
    except ValueError as e:
        raise UsageError(str(e)) from None
    cmd = kvcheck_command(*["diff", "--sut", "transformers", "--model-type", args.model_type,
                            "--dtype", args.dtype, "--scenarios", str(args.scenarios), "--seed", str(args.seed)]
                          + (["--config-json", args.config_json] if args.config_json else [])
                          + (["--fault", args.fault] if args.fault else [])
                          + (["--patterns", which] if which != "default" else [])
                          + (["--sizes", sizes] if sizes != "fixed" else [])
                          + [x for a in (getattr(args, "acknowledge", None) or []) for x in ("--acknowledge", a)])
    try:
        res, others = run_patterns(args.model_type, which, hf.run_diff, config_json=args.config_json,
                                   dtype=args.dtype, scenarios=args.scenarios, seed=args.seed, fault=args.fault,
                                   out_dir=args.out, cover=True, **({"sizes": sizes} if sizes != "fixed" else {}))
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
    if res["verdict"] == "unsupported":      # the release cannot build this model type (kvcheck matrix)
        res["cannot_express"] = f"transformers {res.get('transformers_version')}: {res.get('reason')}"
    bad = ("divergent", "error")
    runs = [r for r in [res] + others if r.get("verdict") in bad and (r is not res or res.get("default_verdict",
                                                                                              res["verdict"]) in bad)]
    res["findings"] = [finding(r, cmd) for r in runs]
    counts, explained = {}, bool(runs)
    for r in runs:                           # a known defect's signature, in any pattern's run
        c, e = known.recognise(r)
        explained = explained and e
        for k, n in c.items():
            counts[k] = counts.get(k, 0) + n
    if counts or acks:                       # a known defect's signature (known.py): named, never silent
        res["coverage"] = counts
        if explained:                        # its row is the finding; only what it explains is accepted
            res["findings"], res["exit_code"] = [], int(ExitCode.OK)
        judge(res, known.KNOWN, acks, res.get("transformers_version"))
    emit(args, res, lambda: "\n".join([hf.render_text(res, int(res["exit_code"])), *render_patterns(res),
                                        *known_lines(res),
                                        f"  seed {args.seed}; rerun: {res['command']}"]))
    return int(res["exit_code"])
