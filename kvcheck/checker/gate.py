"""`kvcheck gate`: the CI profile of every engine present, one verdict.

Owns the profile (minimum steps and coverage), the verdict and its exit code, and the report
directory. Engines: seeded random walks of the spec with every invariant checked after every
step, then Z3 proofs and exhaustive exploration at CI bounds, then the fuzz, diff and mutants
profiles. With `--fault NAME` the walk must fail, and with the fault's expected invariant; the
shrunk counterexample is saved as a trace with its replay command. Ctrl-C writes the report of
what ran, with verdict "interrupted" and exit 130. (With a project file the gate runs the
user's systems instead: gate_project.py; both write report.json's per-check records.)
"""
from __future__ import annotations


import json
import os
import shlex
from ..spec.outputs import file_stem
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .. import __version__
from ..fuzz.walk import Walker, shrink, to_trace
from ..fuzz import faults as faultlib
from ..spec.config import Config
from ..spec.objects import DECISION_KINDS
from ..spec.outputs import umask_mode, write_atomic
from ..spec.system import Spec
from ..spec.verdict import ExitCode
from .coverage_min import required_states
from .gate_profiles import render_profiles_md, run_profiles



@dataclass(frozen=True)
class Profile:
    """CI bounds. A run that ends below these minimums proved nothing: exit 3."""

    steps: int = 10_000
    fault_steps: int = 400_000       # budget to find a planted fault
    fault_seconds: float = 120.0
    shrink_seconds: float = 10.0

    def required_states(self, cfg: Config) -> list[str]:
        """Object states every clean run must reach (vacuity check)."""
        return required_states(cfg)


def run_gate(cfg: Config, out: Path, config_path: str | None = None, fault: str | None = None,
             seed: int = 0, steps: int | None = None, profile: Profile = Profile(),
             progress: Callable[[int, int], None] | None = None,
             checkers: bool | None = None) -> tuple[int, dict[str, Any]]:
    if fault is not None:
        f = faultlib.get(fault)
        if f.layer != "spec":
            raise faultlib.UnknownFault(f"{fault} (a {f.layer} fault: the gate plants spec faults only)")
    spec = Spec(cfg, fault)
    target = steps if steps is not None else (profile.fault_steps if fault else profile.steps)
    walker = Walker(spec, seed=seed)
    cmd = ["kvcheck", "gate", "--seed", str(seed)]
    if config_path:
        cmd += ["--config", config_path]
    if fault:
        cmd += ["--fault", fault]
    report: dict[str, Any] = {
        "kvcheck": __version__, "command": shlex.join(cmd), "seed": seed, "fault": fault,
        "config": cfg.to_dict(), "engines": {}}
    try:
        res = walker.run(target, seconds=profile.fault_seconds if fault else None,
                         progress=(lambda n: progress(n, target)) if progress else None)
    except KeyboardInterrupt:
        return _interrupted(out, report, "walk")
    cov = res.coverage
    report["engines"] = {"walk": {
            "steps": cov.steps, "episodes": cov.episodes, "seconds": round(res.seconds, 3),
            "steps_per_s": round(cov.steps / max(res.seconds, 1e-9)),
            "invariants_checked": len({k.invariant for k in spec.conjuncts}),
            "conjuncts": len(spec.conjuncts),
            "coverage": cov.to_dict(), "metrics": res.metrics.to_dict()}}
    code = ExitCode.OK
    if res.violation is not None:
        v = res.violation
        keep = set(v.invariants)
        short = shrink(spec, v.trace, keep, profile.shrink_seconds)
        trace = to_trace(spec, short, seed)
        name = f"counterexample-{file_stem(fault or 'clean')}-seed{seed}.json"
        path = trace.save(out / name)
        caught_by = trace.violation["invariants"] if trace.violation else v.invariants
        report["violation"] = {
            "step": v.step, "action": v.action, "invariants": v.invariants,
            "where": [f"{inv}: {w}" for inv, w in v.violations][:20],
            "trace": str(path), "trace_steps": [s.label() for s in trace.steps],
            "replay": f"kvcheck replay {shlex.quote(str(path))}"}
        if fault:
            expected = faultlib.get(fault).expected
            report["fault_result"] = {"expected": expected, "caught_by": caught_by,
                                      "caught": expected in caught_by}
        code = ExitCode.INVARIANT
        report["verdict"] = "violated"
    else:
        missing = []
        if cov.steps < (steps if steps is not None else profile.steps):
            missing.append(f"steps {cov.steps} < {steps or profile.steps}")
        missing += [f"action {a}" for a in spec.actions if cov.actions.get(a, 0) == 0]
        missing += [f"decision {d}" for d in DECISION_KINDS if cov.decisions.get(d, 0) == 0]
        missing += [f"state {s}" for s in profile.required_states(cfg) if cov.object_states.get(s, 0) == 0]
        report["coverage_missing"] = missing
        if fault:
            expected = faultlib.get(fault).expected
            report["fault_result"] = {"expected": expected, "caught_by": [], "caught": False}
            report["verdict"] = "fault survived"
            code = ExitCode.OK
        elif missing:
            report["verdict"] = "undecided: coverage below the profile minimum"
            code = ExitCode.UNDECIDED
        else:
            report["verdict"] = "holds"
    if checkers is None:
        checkers = os.environ.get("KVCHECK_GATE_CHECKERS", "1") != "0"
    phase = "prove/explore"
    try:
        if checkers:
            code = run_checkers(cfg, out, fault, report, code, config_path)
            phase = "fuzz/diff/mutants profiles"
            if fault is None:
                code = run_profiles(cfg, out, seed, report, code)
    except KeyboardInterrupt:
        return _interrupted(out, report, phase, code)
    report["exit_code"] = int(code)
    write_report(out, report)
    return code, report


def write_report(out: Path, report: dict[str, Any]) -> None:
    """report.json and report.md, readable by other users (see write_public). The default
    profile's report gets the per-check records a project gate writes ("checks", "findings")."""
    from .gate_project import findings_of, render_project_md
    if "project" in report:
        md = render_project_md(report)
    else:
        from .gate_checks import default_checks
        report["checks"] = default_checks(report)
        report["findings"] = findings_of(report["checks"])
        md = render_md(report) if "walk" in report["engines"] else f"# kvcheck gate: {report['verdict']}\n"
        md += render_checkers_md(report) + render_profiles_md(report)
    write_public(out / "report.json", json.dumps(report, indent=1) + "\n")
    write_public(out / "report.md", md)
    write_html(out)


def write_html(out: Path) -> None:
    """report.html beside them, the page `kvcheck report --html` makes (with the plots the
    data has), so the gate needs no second command; a page that cannot be rendered leaves
    the JSON and Markdown as they are and says why in the page's place."""
    from .report import load_dir
    from .report_html import render_html
    try:
        page = render_html(load_dir(out), out)
    except Exception as e:  # noqa: BLE001 - the report files are written; the page is a view of them
        page = (f"<!doctype html><meta charset=utf-8><title>kvcheck gate</title><p>report.html could not be "
                f"rendered ({type(e).__name__}); see report.md and report.json in this folder.</p>\n")
    write_public(out / "report.html", page)


def write_public(path: Path, data: str | bytes) -> Path:
    """Write atomically, then make the file readable by everyone (at least 0644, whatever the
    umask): CI artifact uploaders and web servers read the gate's reports as another user."""
    p = write_atomic(path, data)
    os.chmod(p, umask_mode() | 0o644)
    return p


def publish(out: Path, since: float, created: bool) -> None:
    """The files this run wrote in the report directory (traces, reproducers, JSON) readable by
    others (0644 at least), and the directory listable (0755) when this run created it; files
    that were there before are left as they are."""
    for p in [out] if created else []:
        os.chmod(p, (p.stat().st_mode & 0o7777) | 0o755)
    for p in out.iterdir():
        try:
            st = p.lstat()
            if p.is_file() and not p.is_symlink() and st.st_mtime >= since:
                os.chmod(p, (st.st_mode & 0o7777) | 0o644)
        except OSError:
            pass                  # not ours: leave it as it is


FAILURES = (ExitCode.INVARIANT, ExitCode.DIFF, ExitCode.Z3, ExitCode.CONFORMANCE)


def _interrupted(out: Path, report: dict[str, Any], phase: str,
                 code: int = ExitCode.OK) -> tuple[int, dict[str, Any]]:
    """Ctrl-C: the report of what ran, exit 130, never a pass; a failure already found (the
    walk's violation) keeps its code."""
    report["interrupted"] = phase
    if code in FAILURES:
        report["verdict"] = f"{report['verdict']} (then interrupted during {phase})"
    else:
        code = ExitCode.INTERRUPTED
        report["verdict"] = f"interrupted during {phase}"
    report["exit_code"] = int(code)
    write_report(out, report)
    return ExitCode(code), report


def run_checkers(cfg: Config, out: Path, fault: str | None, report: dict[str, Any], code: int,
                 config_path: str | None = None) -> int:
    """Z3 proofs (clean runs) and explicit-state exploration at CI bounds. Writes prove.json /
    explore.json next to report.json; a violation gives its engine's exit code unless the walk
    already decided the verdict."""
    from .explore import fault_config, run_explore
    if fault is None:
        # the two engines are independent: run them side by side (one core each); Ctrl-C stops both
        from ..fuzz.pool import Interrupted, run_jobs
        got: dict[str, Any] = {}
        try:
            for key, r in run_jobs(_checker_job, {"prove": ("prove", cfg, out, config_path),
                                                  "explore": ("explore", cfg, out, config_path)}, 2):
                if isinstance(r, BaseException):
                    raise r
                got[key] = r
        except Interrupted:
            raise KeyboardInterrupt from None
        (pcode, prep), (ecode, erep) = got["prove"], got["explore"]
        write_atomic(out / "prove.json", json.dumps(prep, indent=1) + "\n")
        report["engines"]["prove"] = {k: prep[k] for k in ("verdict", "exit_code", "seconds", "bmc", "invariants")}
    else:
        pcode = ExitCode.OK
        ecode, erep = run_explore(fault_config(fault), out, fault)
    write_atomic(out / "explore.json", json.dumps(erep, indent=1) + "\n")
    report["engines"]["explore"] = {k: erep.get(k) for k in (
        "verdict", "exit_code", "states", "transitions", "depth", "seconds", "states_per_s", "exhaustive",
        "sometimes_missing", "deadlocks", "idle_unreachable", "violation", "fault_result")}
    if code in (ExitCode.OK, ExitCode.UNDECIDED) and fault is None:
        if pcode == ExitCode.Z3:
            report["verdict"] = "violated (prove: Z3 counterexample)"
            return ExitCode.Z3
        if ecode == ExitCode.INVARIANT:
            report["verdict"] = "violated (explore)"
            return ExitCode.INVARIANT
        if code == ExitCode.OK and ExitCode.UNDECIDED in (pcode, ecode):
            report["verdict"] = "undecided: prove/explore could not decide"
            return ExitCode.UNDECIDED
    return code


def _checker_job(which: str, cfg: Config, out: Path, config_path: str | None) -> tuple[int, dict[str, Any]]:
    if which == "prove":
        from .prove import run_prove
        return run_prove(cfg, out, None, None, config_path)
    from .explore import run_profile
    return run_profile(out)


def render_checkers_md(rep: dict[str, Any]) -> str:
    lines: list[str] = []
    p = rep["engines"].get("prove")
    if p:
        lines += ["", "## Z3 proofs (kvcheck prove)", "", f"- verdict: {p['verdict']} in {p['seconds']} s; "
                  f"BMC to depth {p['bmc']['checked']}", "",
                  "| invariant | status | method | bound | seconds |", "|---|---|---|---|---|"]
        lines += [f"| {o['name']} | {o['status']} | {o['method']} | {o['bound']} | {o['seconds']} |"
                  for o in p["invariants"]]
    e = rep["engines"].get("explore")
    if e:
        lines += ["", "## Explicit-state exploration (kvcheck explore)", "",
                  f"- verdict: {e['verdict']}: {e['states']} states, {e['transitions']} transitions, depth "
                  f"{e['depth']}, {e['seconds']} s, {'exhaustive' if e['exhaustive'] else 'not exhaustive'}",
                  f"- sometimes-properties not reached: {', '.join(e['sometimes_missing'] or []) or 'none'}",
                  f"- deadlocks: {e['deadlocks']}"]
        if e.get("violation"):
            v = e["violation"]
            lines += [f"- shortest violation ({v['depth']} steps): {', '.join(v['invariants'])}; "
                      f"replay: `{v['replay']}`"]
    return "\n".join(lines) + ("\n" if lines else "")


def render_md(rep: dict[str, Any]) -> str:
    w = rep["engines"]["walk"]
    cov, met = w["coverage"], w["metrics"]
    lines = [f"# kvcheck gate: {rep['verdict']}", "",
             f"- command: `{rep['command']}` (exit {rep['exit_code']})",
             f"- kvcheck {rep['kvcheck']}, seed {rep['seed']}, fault: {rep['fault'] or 'none'}",
             f"- random walks of the spec: {w['steps']} steps in {w['episodes']} episodes, "
             f"{w['seconds']} s ({w['steps_per_s']} steps/s); {w['invariants_checked']} invariants "
             f"({w['conjuncts']} conjuncts) checked after every step", ""]
    if "violation" in rep:
        v = rep["violation"]
        lines += ["## Violation", "", f"- first violating step {v['step']}: `{v['action']}`",
                  f"- invariants: {', '.join(v['invariants'])}"]
        if "fault_result" in rep:
            fr = rep["fault_result"]
            lines.append(f"- planted fault expected `{fr['expected']}`: "
                         f"{'caught' if fr['caught'] else 'NOT caught by it (mis-attributed)'}")
        lines += [f"- shrunk trace ({len(v['trace_steps'])} steps): `{v['trace']}`",
                  f"- replay: `{v['replay']}`", "", "```"] + v["trace_steps"] + ["```", ""]
    if rep.get("coverage_missing"):
        lines += ["## Coverage below the minimum", ""] + [f"- {m}" for m in rep["coverage_missing"]] + [""]
    lines += ["## Decisions", "", "| decision | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in cov["decisions"].items()]
    lines += ["", "## Actions", "", "| action | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in cov["actions"].items()]
    lines += ["", "## Object states reached", "", "| kind:state | entries |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in cov["object_states"].items()]
    lines += ["", "## Metrics", "",
              f"- lookups: {met['lookups']}",
              f"- logical hit rate (blocks): {met['logical_hit_rate']}; usable hit rate: {met['usable_hit_rate']}",
              f"- lookups with a logical hit: {met['logical_hit_share']}; with a usable hit: {met['usable_hit_share']}",
              "", "| degradation reason | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in met["degradations"].items()]
    lines += ["", "## State transitions", "", "| transition | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in cov["transitions"].items()]
    return "\n".join(lines) + "\n"
