"""`kvcheck fuzz`: a Hypothesis campaign (fuzz/campaign.py), or vLLM's own driver."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..spec.outputs import kvcheck_command
from ..spec.verdict import ExitCode
from .common import UsageError, check_out_file, check_sut_fault, check_writable, emit, load_config, progress


def _fuzz_vllm(args: argparse.Namespace) -> int:
    """vLLM's KV cache manager: its own driver per layout (kvcheck/fuzz/adapters/vllm.py)."""
    from ..fuzz.adapters import vllm as v
    from ..fuzz.campaign import Budget
    if args.list_layouts:
        try:
            gaps, release = v.supported_layouts(), v.vllm_version()
        except v.VllmUnavailable as e:
            gaps, release = {k: str(e) for k in v.LAYOUTS}, None
        emit(args, {"layouts": v.LAYOUTS, "vllm_version": release, "unsupported": {k: g for k, g in gaps.items() if g}},
             lambda: "\n".join([f"vLLM {release or 'not importable'}:"] + [
                 f"  {k:22} {d}" + (f"\n  {'':22} ({gaps[k]})" if gaps[k] else "") for k, d in v.LAYOUTS.items()]))
        return 0
    if not args.layout:
        raise UsageError("--sut vllm needs --layout NAME (see --list-layouts)")
    try:
        budget = Budget.parse(args.budget)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.fault is not None and args.fault not in v.FAULTS:
        raise UsageError(f"unknown fault {args.fault!r} for --sut vllm; known: {', '.join(v.FAULTS)}")
    out = Path(args.out)
    check_writable(out)
    try:
        res = v.run_campaign(args.layout, budget_s=budget.seconds, steps=budget.steps, seed=args.seed,
                             strict_reuse=args.strict_reuse, fault=args.fault, out_dir=str(out))
    except v.VllmUnavailable as e:
        raise UsageError(str(e)) from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    code = res["exit_code"]
    cmd = ["fuzz", "--sut", "vllm", "--layout", args.layout, "--budget", args.budget,
           "--seed", str(args.seed)] + (["--strict-reuse"] if args.strict_reuse else []) \
        + (["--fault", args.fault] if args.fault else [])
    res["command"] = kvcheck_command(*cmd)

    def text() -> str:
        lines = [f"kvcheck fuzz --sut vllm --layout {args.layout}: exit {code} (vLLM {res.get('vllm_version')})",
                 f"  {res.get('steps')} steps, seed {args.seed}; rerun: {res['command']}",
                 "  actions: " + ", ".join(f"{k} {n}" for k, n in sorted(res.get("coverage", {}).items())
                                           if isinstance(n, int))]
        for f in res.get("findings", []):
            lines.append(f"  FINDING [{f['kind']}] {f.get('check', '')}: {f['message']}")
            if f.get("replay"):
                lines.append(f"    replay: {f['replay']}")
        return "\n".join(lines)

    emit(args, res, text)
    return code


def _fuzz_sglang(args: argparse.Namespace) -> int:
    """SGLang's radix caches on the lockstep core (kvcheck/fuzz/adapters/sglang*.py)."""
    from ..fuzz.adapters import sglang as sg
    from ..fuzz.campaign import Budget
    try:
        b = Budget.parse(args.budget)
        check_writable(Path(args.out))
        res, text = sg.cli_fuzz(args.layout, args.layout_file, args.list_layouts, b.seconds, b.steps,
                                args.seed, args.fault, args.out)
    except (sg.SglangUnavailable, ValueError) as e:
        raise UsageError(str(e)) from None
    emit(args, res, lambda: text)
    return 0 if args.list_layouts else res["exit_code"]


def cmd_fuzz(args: argparse.Namespace) -> int:
    """Hypothesis stateful campaign against a system under test, in lockstep with the spec."""
    if args.sut == "sglang":
        return _fuzz_sglang(args)
    if args.layout_file:
        raise UsageError("--layout-file applies to --sut sglang only")
    if args.sut == "vllm":
        if args.observability:
            raise UsageError("--observability applies to the Hypothesis machines (not --sut vllm)")
        return _fuzz_vllm(args)
    if args.list_layouts or args.layout or args.strict_reuse:
        raise UsageError("--list-layouts/--layout/--strict-reuse apply to --sut vllm only")
    from ..fuzz.campaign import Budget, run_campaign, run_workers
    from ..fuzz.pool import cap_workers
    cfg = load_config(args)
    try:
        budget = Budget.parse(args.budget)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.fault is not None:
        check_sut_fault(args.sut, args.fault)
    out = Path(args.out)
    check_writable(out)
    obs = Path(args.observability) if args.observability else None
    if obs is not None:
        check_out_file(obs, "--observability")
    if args.db is not None:
        check_writable(Path(args.db), "example database directory (--db)")
    workers, note = cap_workers(args.workers)
    if note:
        print(f"kvcheck fuzz: {note}", file=sys.stderr)
    if workers > 1:
        res = run_workers(cfg, args.sut, budget, args.seed, args.fault, args.db, out, workers, obs)
    else:
        with progress(args, f"fuzz {args.sut} ({budget.describe()})") as bar:
            res = run_campaign(cfg, args.sut, budget, args.seed, args.fault, args.db, out,
                               progress=bar, observability=obs)
    cmd = ["fuzz", "--sut", args.sut, "--budget", args.budget, "--seed", str(args.seed)]
    if args.config:
        cmd += ["--config", args.config]
    if args.fault:
        cmd += ["--fault", args.fault]
    res["command"] = kvcheck_command(*cmd)
    code = res["exit_code"]
    if code == ExitCode.INTERRUPTED:
        res["verdict"] = "interrupted: nothing is claimed"
    elif code == ExitCode.OK and res["coverage"]["actions_missing"]:
        res["verdict"] = "undecided: actions never exercised"
        code = res["exit_code"] = int(ExitCode.UNDECIDED)
    else:
        res.setdefault("verdict", "holds" if code == ExitCode.OK else "failed")

    def text() -> str:
        lines = [f"kvcheck fuzz --sut {args.sut}: {res['verdict']} (exit {code})",
                 f"  {res['steps']} steps in {res['seconds']} s ({res['steps_per_s']} steps/s), "
                 f"budget {budget.describe()}" + (", interrupted" if res.get("interrupted") else ""),
                 "  decisions: " + ", ".join(f"{k} {v}" for k, v in res["coverage"]["decisions"].items()),
                 f"  actions exercised: {len(res['coverage']['actions'])}"
                 + (f"; never: {', '.join(res['coverage']['actions_missing'])}" if res["coverage"]["actions_missing"] else ""),
                 f"  seed {args.seed}; rerun: {res['command']}"]
        for f in res["findings"]:
            lines.append(f"  FINDING [{f['kind']}] {', '.join(f['checks'])}: {f['message']}")
            lines += [f"    {i:3}. {s}" for i, s in enumerate(f["trace_steps"])]
            lines.append(f"  trace: {f['trace']}\n  reproducer: {f['reproducer']}\n  replay: {f['replay']}")
        return "\n".join(lines)

    emit(args, res, text)
    return code


