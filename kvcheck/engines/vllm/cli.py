"""`kvcheck fuzz --sut vllm`: vLLM's KV cache manager on its own driver, per layout (drivers.py),
locally or as Ray shards; the command line's side of the vLLM engine."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcheck.fuzz.floor import undecided_lines
from kvcheck.checker.cmd_fuzz import on_ray, ray_line
from kvcheck.checker.common import UsageError, check_writable, emit
from kvcheck.fuzz.boundary import CannotExpress
from kvcheck.fuzz.campaign import Budget
from kvcheck.fuzz.known import known_lines, parse_cli
from kvcheck.fuzz.steer import rerun_args, steer_lines
from kvcheck.checker.common import steering
from kvcheck.spec.outputs import kvcheck_command

from . import drivers as v
from .drive_plan import AUTO, RAY_WHY, explicit_why
from .sched import POLICIES


def fuzz_command(args: argparse.Namespace) -> int:
    """vLLM's KV cache manager: its own driver per layout (kvcheck/engines/vllm/drivers.py)."""
    if args.list_layouts:
        try:
            gaps, release = v.supported_layouts(), v.vllm_version()
        except v.VllmUnavailable as e:
            gaps, release = {k: str(e) for k in v.LAYOUTS}, None
        emit(args, {"layouts": v.LAYOUTS, "vllm_version": release, "unsupported": {k: g for k, g in gaps.items() if g}},
             lambda: "\n".join([f"vLLM {release or 'not importable'}:"] + [
                 f"  {k:22} {d}" + (f"\n  {'':22} ({gaps[k]})" if gaps.get(k) else "") for k, d in v.LAYOUTS.items()]))
        return 0
    if args.layout_file:
        if args.layout or args.ray is not None:
            raise UsageError("--layout-file: give it instead of --layout, and without --ray")
        try:
            args.layout = v.load_layout_file(args.layout_file)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if not args.layout:
        raise UsageError("--sut vllm needs --layout NAME or --layout-file FILE (see --list-layouts)")
    try:
        budget = Budget.parse(args.budget)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.fault is not None and args.fault not in v.FAULTS:
        raise UsageError(f"unknown fault {args.fault!r} for --sut vllm; known: {', '.join(v.FAULTS)}")
    workload = args.workload or "random"
    if workload not in v.WORKLOADS:
        raise UsageError(f"--workload: unknown workload {workload!r}; known: {', '.join(v.WORKLOADS)}")
    if workload != "random" and args.ray is not None:
        raise UsageError("--workload: the Ray shards drive the random workload only (drop --ray or --workload)")
    drive = getattr(args, "drive", None) or AUTO        # auto: resolved by the campaign (drive_plan.py)
    if drive not in v.DRIVES:
        raise UsageError(f"--drive: unknown drive {drive!r}; known: {', '.join(v.DRIVES)}")
    ray_why = None
    if args.ray is not None:
        if drive not in (AUTO, "mixed"):
            raise UsageError("--drive: the Ray shards run the mixed drive only (drop --ray or --drive)")
        drive, ray_why = "mixed", RAY_WHY if drive == AUTO else explicit_why("mixed")
    # (not given: FCFS on the manager drive, drawn per episode on the engine drive)
    policy = args.sched_policy if drive in (AUTO, "engine") and args.sched_policy is None \
        else sched_policy(args.sched_policy)
    try:
        acknowledged = parse_cli(args.acknowledge)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if acknowledged and args.ray is not None:
        raise UsageError("--acknowledge: the Ray shards judge known defects unacknowledged (drop --ray)")
    if policy != "fcfs" and args.ray is not None:
        raise UsageError("--sched-policy: the Ray shards drive FCFS only (drop --ray or --sched-policy)")
    steer = steering(args, "vllm")
    out = Path(args.out)
    check_writable(out)
    layouts = args.layout.split(",") if args.ray is not None else [args.layout]
    for name in layouts:
        if name not in v.LAYOUTS:
            raise UsageError(f"unknown vLLM layout {name!r}; known: {', '.join(v.LAYOUTS)}")
    try:
        if args.ray is not None:       # layouts x seeds as Ray tasks
            v.VllmAdapter(layouts[0], 24, args.fault)      # vLLM importable here: one line if not
            from kvcheck.fuzz.ray_campaign import Shard

            def shards(cpus: int) -> list:
                n = args.workers or max(1, cpus // len(layouts))
                return [Shard("vllm", args.seed + k, args.fault, name, strict=args.strict_reuse)
                        for name in layouts for k in range(n)]
            res = on_ray(args, shards, budget, None, out, f"fuzz vllm {args.layout}")
            res.update(drive="mixed", drive_reason=ray_why)
        else:
            res = v.run_campaign(args.layout, budget_s=budget.seconds, steps=budget.steps, seed=args.seed,
                                 strict_reuse=args.strict_reuse, fault=args.fault, out_dir=str(out),
                                 workload=workload, sched_policy=policy, acknowledged=acknowledged, drive=drive,
                                 strict_known=bool(args.strict_known), steer=steer)
    except v.VllmUnavailable as e:
        raise UsageError(str(e)) from None
    except CannotExpress as e:          # (the JSON says so: kvcheck matrix shows "cannot express")
        if getattr(args, "json", False):
            print(json.dumps({"cannot_express": str(e), "exit_code": 2, "layout": args.layout}))
            print(f"kvcheck fuzz: error: {e}", file=sys.stderr)
            return 2
        raise UsageError(str(e)) from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.ray is None and not res.get("reuse_profile") and args.layout != "generated" and "cannot_drive" not in res:
        try:
            res["reuse_profile"] = v.reuse_profile(args.layout)   # usable hit by divergence position
        except ValueError:
            res["reuse_profile"] = {}
    code = res["exit_code"]
    which = ["--layout-file", args.layout_file] if args.layout_file else ["--layout", args.layout]
    cmd = ["fuzz", "--sut", "vllm", *which, "--budget", args.budget,
           "--seed", str(args.seed)] + (["--strict-reuse"] if args.strict_reuse else []) \
        + (["--fault", args.fault] if args.fault else []) \
        + (["--workload", workload] if workload != "random" else []) \
        + ["--drive", res.get("drive") or drive] \
        + (["--sched-policy", policy] if policy not in ("fcfs", None) or (policy and res.get("drive") == "engine")
           else []) \
        + [f"--acknowledge={n}={a.reason}" for n, a in acknowledged.items()] \
        + (["--strict-known"] if args.strict_known else []) \
        + (rerun_args(steer.strategy) if steer is not None else []) \
        + (["--ray", *([args.ray] if args.ray else []), "--workers", str(len(res["ray"]["shards"]) // len(layouts))]
           if args.ray is not None else [])
    res["command"] = kvcheck_command(*cmd)
    from .connector import SYNC_FAILURES_ENV, sync_failures_on
    if sync_failures_on():           # (an opt-in of the environment: the rerun names it)
        res["command"] = f"{SYNC_FAILURES_ENV}=1 {res['command']}"
    from .engine_async import ASYNC_ENV, async_on
    if not async_on():               # (vLLM's default is on: the rerun names only the opt-out)
        res["command"] = f"{ASYNC_ENV}=0 {res['command']}"

    def text() -> str:
        if "cannot_drive" in res:
            return res["cannot_drive"]["line"]
        lines = [f"kvcheck fuzz --sut vllm --layout {args.layout}: exit {code} (vLLM {res.get('vllm_version')})",
                 f"  {res.get('steps')} steps, seed {args.seed}"
                 + (f", {policy.upper()} scheduling" if policy not in ("fcfs", None) else "")
                 + (f"; drive {res['drive']} ({res.get('drive_reason')})" if res.get("drive") else "")
                 + f"; rerun: {res['command']}",
                 *steer_lines(res.get("steer")),
                 "  actions: " + ", ".join(f"{k} {n}" for k, n in sorted(res.get("coverage", {}).items())
                                           if isinstance(n, int))] + undecided_lines(res)
        if "ray" in res:
            lines.insert(2, ray_line(res["ray"]))
        for f in res.get("findings", []):
            lines.append(f"  FINDING [{f['kind']}] {f.get('check', '')}" + (f" ({f['layout']})" if "layout" in f else "")
                         + f": {f['message']}")
            if f.get("replay"):
                lines.append(f"    replay: {f['replay']}")
        lines += known_lines(res)
        return "\n".join(lines)

    emit(args, res, text)
    return code


def sched_policy(name: str | None) -> str:
    """--sched-policy (vLLM's scheduler policy in the scheduler-driven episodes): fcfs or priority."""
    if name is None:
        return "fcfs"
    if name not in POLICIES:
        raise UsageError(f"--sched-policy: unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return name
