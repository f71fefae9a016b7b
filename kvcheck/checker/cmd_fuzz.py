"""`kvcheck fuzz`: a Hypothesis campaign (fuzz/campaign.py), or vLLM's own driver."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from typing import TYPE_CHECKING, Callable

from ..spec.outputs import kvcheck_command
from ..spec.verdict import ExitCode
from .common import UsageError, check_out_file, check_sut_fault, check_writable, emit, load_config, progress

if TYPE_CHECKING:
    from ..fuzz.campaign import Budget
    from ..spec.config import Config


def _fuzz_vllm(args: argparse.Namespace) -> int:
    """vLLM's KV cache manager: its own driver per layout (kvcheck/engines/vllm/drivers.py)."""
    from kvcheck.engines.vllm import drivers as v
    from ..fuzz.campaign import Budget
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
    policy = sched_policy(args.sched_policy)
    if policy != "fcfs" and args.ray is not None:
        raise UsageError("--sched-policy: the Ray shards drive FCFS only (drop --ray or --sched-policy)")
    out = Path(args.out)
    check_writable(out)
    layouts = args.layout.split(",") if args.ray is not None else [args.layout]
    for name in layouts:
        if name not in v.LAYOUTS:
            raise UsageError(f"unknown vLLM layout {name!r}; known: {', '.join(v.LAYOUTS)}")
    try:
        if args.ray is not None:       # layouts x seeds as Ray tasks
            v.VllmAdapter(layouts[0], 24, args.fault)      # vLLM importable here: one line if not
            from ..fuzz.ray_campaign import Shard

            def shards(cpus: int) -> list:
                n = args.workers or max(1, cpus // len(layouts))
                return [Shard("vllm", args.seed + k, args.fault, name, strict=args.strict_reuse)
                        for name in layouts for k in range(n)]
            res = _on_ray(args, shards, budget, None, out, f"fuzz vllm {args.layout}")
        else:
            res = v.run_campaign(args.layout, budget_s=budget.seconds, steps=budget.steps, seed=args.seed,
                                 strict_reuse=args.strict_reuse, fault=args.fault, out_dir=str(out),
                                 workload=workload, sched_policy=policy)
    except v.VllmUnavailable as e:
        raise UsageError(str(e)) from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.ray is None and not res.get("reuse_profile") and args.layout != "generated":
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
        + (["--sched-policy", policy] if policy != "fcfs" else []) \
        + (["--ray", *([args.ray] if args.ray else []), "--workers", str(len(res["ray"]["shards"]) // len(layouts))]
           if args.ray is not None else [])
    res["command"] = kvcheck_command(*cmd)

    def text() -> str:
        lines = [f"kvcheck fuzz --sut vllm --layout {args.layout}: exit {code} (vLLM {res.get('vllm_version')})",
                 f"  {res.get('steps')} steps, seed {args.seed}"
                 + (f", {policy.upper()} scheduling" if policy != "fcfs" else "") + f"; rerun: {res['command']}",
                 "  actions: " + ", ".join(f"{k} {n}" for k, n in sorted(res.get("coverage", {}).items())
                                           if isinstance(n, int))]
        if "ray" in res:
            lines.insert(2, _ray_line(res["ray"]))
        for f in res.get("findings", []):
            lines.append(f"  FINDING [{f['kind']}] {f.get('check', '')}" + (f" ({f['layout']})" if "layout" in f else "")
                         + f": {f['message']}")
            if f.get("replay"):
                lines.append(f"    replay: {f['replay']}")
        return "\n".join(lines)

    emit(args, res, text)
    return code


def sched_policy(name: str | None) -> str:
    """--sched-policy (vLLM's scheduler policy in the scheduler-driven episodes): fcfs or priority."""
    from kvcheck.engines.vllm.sched import POLICIES
    if name is None:
        return "fcfs"
    if name not in POLICIES:
        raise UsageError(f"--sched-policy: unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return name


def _fuzz_sglang(args: argparse.Namespace) -> int:
    """SGLang's radix caches on the lockstep core (kvcheck/fuzz/adapters/sglang*.py)."""
    from kvcheck.engines.sglang import drivers as sg
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


def _undecided(cov: dict, steps: int) -> str:
    """Why a clean run claims nothing: which declared actions never ran, and of those, which the
    spec never even enabled (declared in the SUT's `actions`, unreachable with the others)."""
    never = cov.get("actions_never_enabled", [])
    drawn = [a for a in cov["actions_missing"] if a not in never]
    parts = []
    if never:
        parts.append(f"the SUT declares {', '.join(never)}, which the spec never enabled in {steps} "
                     "steps (unreachable with the actions it declares in this config: drop them from "
                     "`actions`, or declare what enables them; `kvcheck adapter-check` lints this)")
    if drawn:
        parts.append(f"{', '.join(drawn)} enabled but never exercised (a longer --budget)")
    return "undecided: " + "; ".join(parts)


def cmd_fuzz(args: argparse.Namespace) -> int:
    """Hypothesis stateful campaign against a system under test, in lockstep with the spec."""
    redis = args.redis or os.environ.get("KVCHECK_REDIS") or None
    if getattr(args, "workload", None) is not None and args.sut != "vllm":
        raise UsageError("--workload applies to --sut vllm only")
    if getattr(args, "sched_policy", None) is not None and args.sut != "vllm":
        raise UsageError("--sched-policy applies to --sut vllm only")
    if args.sut == "sglang" and (args.ray is not None or args.redis):
        raise UsageError("--ray/--redis apply to the Hypothesis machines (spec, reference, "
                         "MODULE:CLASS) and --ray to --sut vllm, not --sut sglang")
    if args.sut == "vllm" and args.redis:
        raise UsageError("--redis is the Hypothesis example database: --sut vllm has its own driver, without one")
    if args.sut == "sglang":
        return _fuzz_sglang(args)
    if args.layout_file and args.sut != "vllm":
        raise UsageError("--layout-file applies to --sut vllm and --sut sglang only")
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
    if args.db is not None and redis:
        raise UsageError("--db and --redis (or KVCHECK_REDIS) both name an example database: give one")
    if args.db is not None:
        check_writable(Path(args.db), "example database directory (--db)")
    db = _check_redis(redis) if redis else args.db
    if args.ray is not None:
        if obs is not None:
            raise UsageError("--observability is not available with --ray (it would write on each worker's node)")
        res = _fuzz_ray(args, cfg, budget, db, out)
    else:
        workers, note = cap_workers(args.workers or 1)
        if note:
            print(f"kvcheck fuzz: {note}", file=sys.stderr)
        if workers > 1:
            res = run_workers(cfg, args.sut, budget, args.seed, args.fault, db, out, workers, obs)
        else:
            with progress(args, f"fuzz {args.sut} ({budget.describe()})") as bar:
                res = run_campaign(cfg, args.sut, budget, args.seed, args.fault, db, out,
                                   progress=bar, observability=obs)
    cmd = ["fuzz", "--sut", args.sut, "--budget", args.budget, "--seed", str(args.seed)]
    if args.config:
        cmd += ["--config", args.config]
    if args.fault:
        cmd += ["--fault", args.fault]
    if args.ray is not None:
        cmd += ["--ray", *([args.ray] if args.ray else []), "--workers", str(len(res["ray"]["shards"]))]
    res["command"] = kvcheck_command(*cmd)
    code = res["exit_code"]
    if code == ExitCode.INTERRUPTED:
        res["verdict"] = "interrupted: nothing is claimed"
    elif code == ExitCode.OK and res["coverage"]["actions_missing"]:
        res["verdict"] = _undecided(res["coverage"], res["steps"])
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
        if "ray" in res:
            lines.insert(2, _ray_line(res["ray"]))
        for f in res["findings"]:
            lines.append(f"  FINDING [{f['kind']}] {', '.join(f['checks'])}: {f['message']}")
            lines += [f"    {i:3}. {s}" for i, s in enumerate(f["trace_steps"])]
            lines.append(f"  trace: {f['trace']}\n  reproducer: {f['reproducer']}\n  replay: {f['replay']}")
        return "\n".join(lines)

    emit(args, res, text)
    return code


def _ray_line(r: dict) -> str:
    return (f"  Ray: {len(r['answered'])} of {len(r['shards'])} shards answered, {r['nodes']} node(s)"
            + (f"; retried: {', '.join(r['retries'])}" if r["retries"] else "")
            + (f"; lost: {', '.join(r['errors'])}" if r["errors"] else ""))


def _check_redis(url: str) -> str:
    from ..fuzz.exampledb import DatabaseError, check_redis, is_redis_url
    if not is_redis_url(url):
        raise UsageError(f"--redis wants a URL like redis://HOST:6379/0, got {url!r}")
    try:
        check_redis(url)
    except DatabaseError as e:
        raise UsageError(str(e)) from None
    return url


def _fuzz_ray(args: argparse.Namespace, cfg: Config, budget: Budget, db: str | None, out: Path) -> dict:
    """The campaign's shards (by seed) as Ray tasks on a cluster (kvcheck/fuzz/ray_campaign.py)."""
    from ..fuzz import ray_campaign as rc
    from ..fuzz.exampledb import is_redis_url
    try:
        rc.require_ray()               # the install line first, before any note
    except rc.ScaleUnavailable as e:
        raise UsageError(str(e)) from None
    note = ("no --redis: the shards share no example database" if db is None else None if is_redis_url(db)
            else f"--db {db} is a directory on each node (shared only on a shared filesystem)")
    return _on_ray(args, lambda cpus: rc.plan([(args.sut, args.fault)], args.seed, args.workers or cpus),
                   budget, db, out, f"fuzz {args.sut}", cfg, note)


def _on_ray(args: argparse.Namespace, shards_for: Callable[[int], list], budget: Budget, db: str | None,
            out: Path, label: str, cfg: Config | None = None, note: str | None = None) -> dict:
    """Join the cluster, run the shards (`shards_for(the cluster's CPUs)`), leave; `note` goes
    to stderr once the cluster answered."""
    from ..fuzz import ray_campaign as rc
    from ..spec.config import Config
    try:
        ray = rc.require_ray()
    except rc.ScaleUnavailable as e:
        raise UsageError(str(e)) from None
    # Ray prints its workers' errors ("(raylet) A worker died ...") on stdout: keep stdout for
    # the result (--json) and let them go to stderr
    with contextlib.redirect_stdout(sys.stderr):
        try:
            rc.connect(args.ray or None)
        except rc.ScaleUnavailable as e:
            raise UsageError(str(e)) from None
        if note:
            print(f"kvcheck fuzz: {note}", file=sys.stderr)
        try:
            shards = shards_for(rc.cluster_cpus())
            with progress(args, f"{label} on Ray ({len(shards)} shards, {budget.describe()} each)") as bar:
                return rc.run_ray(cfg or Config(), shards, budget, db, out, progress=bar)
        finally:
            ray.shutdown()
