"""`kvcheck fuzz`: a Hypothesis campaign (fuzz/campaign.py), or vLLM's own driver."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from typing import TYPE_CHECKING, Any, Callable

from ..spec.outputs import kvcheck_command
from ..spec.verdict import ExitCode
from ..fuzz import registry
from ..fuzz.engine import Engine
from ..fuzz.floor import shortfall as floor_shortfall
from .common import UsageError, covering, check_out_file, check_sut_fault, check_writable, emit, load_config, progress

if TYPE_CHECKING:
    from ..fuzz.campaign import Budget
    from ..spec.config import Config


# Options of one kind of driver; the Hypothesis machines (spec, reference, MODULE:CLASS, any
# engine with a SUT class) take MACHINE_OPTIONS, an engine's own driver its `fuzz_options`.
ENGINE_OPTIONS = {"workload": "--workload", "sched_policy": "--sched-policy", "layout": "--layout",
                  "list_layouts": "--list-layouts", "layout_file": "--layout-file",
                  "strict_reuse": "--strict-reuse", "ray": "--ray", "redis": "--redis",
                  "observability": "--observability", "acknowledge": "--acknowledge",
                  "strict_known": "--strict-known", "drive": "--drive", "steer": "--steer"}
MACHINE_OPTIONS = frozenset({"ray", "redis", "observability"})


def engine_of(sut: str) -> Engine | None:
    """The registered engine `--sut NAME` names (None: spec or MODULE:CLASS); exit 2 if unknown."""
    if sut == "spec" or ":" in sut:
        return None
    try:
        return registry.get(sut)
    except registry.UnknownEngine:
        raise UsageError(f"--sut: unknown system under test {sut!r}; registered engines: "
                         f"{', '.join(registry.engines())} (`kvcheck engines`), or spec, or MODULE:CLASS "
                         "for your own adapter") from None


def _not_here(flag: str, dest: str, sut: str) -> str:
    """Why `flag` does not apply to --sut SUT: the engines whose drivers take it."""
    takers = [n for n, e in registry.engines().items() if dest in e.fuzz_options and e.own_driver()]
    if dest in MACHINE_OPTIONS:
        return (f"{flag} applies to the Hypothesis machines (spec, reference, MODULE:CLASS)"
                + (f" and --sut {', '.join(takers)}" if takers else "") + f": --sut {sut} has its own driver, without it")
    return f"{flag} applies to --sut {' and --sut '.join(takers) or '(no engine)'} only"


def cmd_fuzz(args: argparse.Namespace) -> int:
    """Hypothesis stateful campaign against a system under test, in lockstep with the spec."""
    redis = args.redis or os.environ.get("KVCHECK_REDIS") or None
    eng = engine_of(args.sut)
    own = eng is not None and eng.own_driver()
    if args.cover and not own:
        with covering(args, None, "fuzz"):    # refused, naming the engines that take it
            pass
    accepted = eng.fuzz_options if own else MACHINE_OPTIONS
    for dest, flag in ENGINE_OPTIONS.items():
        if getattr(args, dest, None) not in (None, False) and dest not in accepted:
            raise UsageError(_not_here(flag, dest, args.sut))
    if getattr(args, "exhaustive", None) is not None:
        if own:
            raise UsageError(f"--exhaustive: --sut {args.sut} runs its own driver, which cannot be enumerated "
                             "generically; it applies to spec, reference and MODULE:CLASS adapters")
        return _exhaustive(args)
    if own:
        with covering(args, eng, "fuzz"):
            code = eng.fuzz_command(args)
        if code is None:
            raise UsageError(f"--sut {args.sut}: the engine runs no campaign of its own and has no SUT class")
        return code
    from ..fuzz.campaign import run_campaign, run_workers
    from ..fuzz.pool import cap_workers
    cfg, budget, out = _prepared(args)
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
    elif code == ExitCode.OK and (why := floor_shortfall(
            {"steps": res["steps"], "examples": res["examples"], **res["coverage"]["decisions"]},
            res["coverage"]["actions_missing"], res["coverage"].get("actions_never_enabled", ()), res["steps"])):
        res["verdict"] = "undecided: " + why
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
            lines.insert(2, ray_line(res["ray"]))
        raised = res.get("checks_raised") or []
        if raised:
            lines.append("  checks raised (most serious first): " + "; ".join(
                f"{c['check']} [{c['kind']}] x{c['count']}, first at step {c['first_step']} ({c['first_seconds']} s)"
                for c in raised[:8]) + (f"; ... {len(raised) - 8} more" if len(raised) > 8 else ""))
        if res.get("detection_check"):
            lines.append(f"  reported: {res['detection_check']}"
                         + (f", first raised after {res['seconds_to_detection']} s ({res['steps_to_detection']} steps)"
                            if res.get("seconds_to_detection") is not None else ""))
        return "\n".join(lines + finding_lines(res["findings"]))

    emit(args, res, text)
    return code


def _exhaustive(args: argparse.Namespace) -> int:
    """`--exhaustive DEPTH`: every program up to DEPTH steps (fuzz/exhaustive.py)."""
    from ..fuzz.exhaustive import run_exhaustive, summary
    for flag, given in (("--workers", (args.workers or 1) > 1), ("--ray", args.ray is not None),
                        ("--db", args.db is not None), ("--redis", bool(args.redis)),
                        ("--observability", bool(args.observability))):
        if given:
            raise UsageError(f"{flag} drives Hypothesis campaigns; --exhaustive is one deterministic search without it")
    cfg, budget, out = _prepared(args)
    with progress(args, f"fuzz {args.sut} --exhaustive {args.exhaustive} ({budget.describe()})") as bar:
        res = run_exhaustive(cfg, args.sut, args.exhaustive, budget, args.fault, out, args.seed, progress=bar)
    cmd = ["fuzz", "--sut", args.sut, "--exhaustive", str(args.exhaustive), "--budget", args.budget]
    if args.config:
        cmd += ["--config", args.config]
    if args.fault:
        cmd += ["--fault", args.fault]
    res["command"] = kvcheck_command(*cmd)
    code = res["exit_code"]

    def text() -> str:
        lines = [f"kvcheck fuzz --sut {args.sut} --exhaustive {args.exhaustive}: {res['verdict']} (exit {code})",
                 "  " + summary(res),
                 f"  actions exercised: {len(res['coverage']['actions'])}"
                 + (f"; never: {', '.join(res['coverage']['actions_missing'])}" if res["coverage"]["actions_missing"] else ""),
                 "  seed: none used (breadth-first order is deterministic; the SUT's reset takes no seed); "
                 f"rerun: {res['command']}"]
        return "\n".join(lines + finding_lines(res["findings"]))

    emit(args, res, text)
    return code


def finding_lines(findings: list[dict]) -> list[str]:
    """A campaign's or an exhaustive search's findings: check, shrunk trace, and how to replay."""
    lines: list[str] = []
    for f in findings:
        lines.append(f"  FINDING [{f['kind']}] {', '.join(f['checks'])}: {f['message']}")
        lines += [f"    {i:3}. {s}" for i, s in enumerate(f["trace_steps"])]
        lines.append(f"  trace: {f['trace']}\n  reproducer: {f['reproducer']}\n  replay: {f['replay']}")
    return lines


def ray_line(r: dict) -> str:
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
    return on_ray(args, lambda cpus: rc.plan([(args.sut, args.fault)], args.seed, args.workers or cpus),
                   budget, db, out, f"fuzz {args.sut}", cfg, note)


def on_ray(args: argparse.Namespace, shards_for: Callable[[int], list], budget: Budget, db: str | None,
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


def _prepared(args: argparse.Namespace) -> tuple[Any, Any, Path]:
    """What a campaign and an exhaustive search both read first: the config, the budget (one line
    on a bad one), the fault checked against the SUT, and a writable --out."""
    from ..fuzz.campaign import Budget
    cfg = load_config(args)
    try:
        budget = Budget.parse(args.budget)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.fault is not None:
        check_sut_fault(args.sut, args.fault)
    out = Path(args.out)
    check_writable(out)
    return cfg, budget, out
