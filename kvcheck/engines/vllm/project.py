"""The vLLM engine in a project file: `layouts` (names or layout files) and `sched_policy` of a
`[tool.kvcheck.systems.vllm]` table, and one layout's campaign as the gate's checks."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from kvcheck.checker.project import System
from kvcheck.checker.project_engines import (EngineRun, check, covered, coverage_check, finding, labels, per_check,
                                             skipped)
from kvcheck.fuzz.engine import ProjectKeyError
from kvcheck.spec.outputs import file_stem
from kvcheck.spec.verdict import ExitCode

from . import drivers as v
from .layout_file import parse_layout, read_layout_file
from .layouts import B, BOOKKEEPING_CHECKS, LAYOUTS, MAX_MODEL_LEN, SAFETY_CHECKS
from .sched import POLICIES


def project_system(layouts: list[str] | None, body: Mapping[str, Any],
                   base: Path) -> tuple[list[str], dict[str, Any]]:
    """The layouts to check (files resolved against the project file's folder) and the options."""
    if layouts is None:
        raise ProjectKeyError("layouts", f"missing: name the vLLM layouts to check (known: {', '.join(LAYOUTS)})")
    names = list(layouts)
    for i, n in enumerate(names):
        if n.endswith(".json") or "/" in n:
            p = base / n
            try:
                parse_layout(read_layout_file(str(p)), n, B, MAX_MODEL_LEN)
            except ValueError as e:
                raise ProjectKeyError(f"layouts[{i}]", str(e)) from None
            names[i] = str(p)
        elif n not in LAYOUTS:
            raise ProjectKeyError(f"layouts[{i}]", f"unknown layout {n!r} (known: {', '.join(LAYOUTS)})")
    policy = body.get("sched_policy", "fcfs")
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ProjectKeyError("sched_policy", f"must be one of {', '.join(POLICIES)} (got {policy!r})")
    return names, {"sched_policy": policy}


def known_checks(label: str, r: dict[str, Any], strict: bool) -> list[dict[str, Any]]:
    """One check per known defect of the run (fuzz/known.py): recognised and not acknowledged,
    failed where its kind fails (a known lost reuse: passed, with the note); acknowledged (JUnit:
    skipped, with the reason); a stale acknowledgement (`fixed?`: failed under known_strict)."""
    out = []
    for row in r.get("known", []):
        name, secs = f"known:{row['name']}", r["elapsed_s"]
        counts = {"recognised": row["recognised"], "releases": row.get("releases")}
        if row["status"] == "finding":              # recognised, not acknowledged
            f = finding(row["kind"], row["message"], row.get("reproducer"), [])
            out.append(check(label, "fuzz", name, "failed" if row.get("fails") else "passed", secs, counts,
                             f if row.get("fails") else None, note=None if row.get("fails") else row["message"]))
        elif row["status"].startswith("acknowledged"):
            out.append(check(label, "fuzz", name, "acknowledged", secs, counts,
                             note=f"{row['status']}: {row.get('reason')}" + (f" [{row['upstream']}]" if row.get("upstream") else "")))
        elif row["status"] in ("fixed?", "unknown"):
            out.append(check(label, "fuzz", name, "failed" if strict and row["status"] == "fixed?" else "passed",
                             secs, counts, finding("stale_acknowledgement", row["message"], None, [])
                             if strict and row["status"] == "fixed?" else None, note=row["message"]))
    return out


def run_vllm(sys: System, layout: str, seed: int, out: Path, fault: str | None = None) -> EngineRun:
    label = f"vllm[{layout}]"
    if layout.endswith(".json") or "/" in layout:
        try:
            layout = v.load_layout_file(layout)      # the project file resolved its path
        except ValueError as e:
            return skipped(label, "fuzz", str(e))
    return covered(sys, "vllm", label, "fuzz", f"{layout} seed {seed}", out / f"engine-coverage-vllm-"
                   f"{file_stem(Path(layout).stem)}-seed{seed}", fault, lambda: _campaign(sys, layout, seed, out, fault))


def _campaign(sys: System, layout: str, seed: int, out: Path, fault: str | None) -> EngineRun:
    label = f"vllm[{layout}]"
    b = sys.fault_budget if fault else sys.budgets["fuzz"]
    try:                                # drive: auto (vLLM's own scheduler where it runs the layout)
        r = v.run_campaign(layout, budget_s=b.seconds, steps=b.steps, seed=seed, fault=fault, out_dir=str(out),
                           sched_policy=sys.sched_policy, acknowledged=sys.options.get("acknowledged"),
                           strict_known=bool(sys.options.get("strict_known")))
    except v.VllmUnavailable as e:
        return skipped(label, "fuzz", str(e))
    except ValueError as e:             # a fault this layout cannot plant (no sliding window)
        return skipped(label, "fuzz", str(e))
    counts = {"steps": r["steps"], "episodes": r["episodes"], "lookups_with_hit": r["lookups_with_hit"],
              "lost_reuse_lookups": r["lost_reuse_lookups"]}
    failed, traces, lost = {}, [], 0
    for x in r["findings"]:
        if x["kind"] == "lost_reuse" and r["exit_code"] == ExitCode.OK:
            lost += 1                  # kept as findings, not failures, without strict reuse
            continue
        failed[x["check"]] = finding(x["kind"], x["message"], x["replay"], labels(x["trace"]))
        traces.append(x["trace"])
    checks = per_check(label, "fuzz", list(SAFETY_CHECKS) + list(BOOKKEEPING_CHECKS), failed, r["elapsed_s"], counts)
    checks += known_checks(label, r, bool(sys.options.get("strict_known")))
    checks.append(coverage_check(label, r["missing_actions"], r["elapsed_s"], counts))
    code = ExitCode.OK if r["exit_code"] == ExitCode.UNDECIDED and not failed else r["exit_code"]
    if lost:
        checks.append(check(label, "fuzz", "lost_reuse", "passed", r["elapsed_s"], counts,
                            note=f"{lost} kinds of lost reuse saved as findings (not failing without strict reuse)"))
    profile = r.get("reuse_profile") or _reuse_profile(v, layout)
    drives = {layout: {"drive": r["drive"], "reason": r.get("drive_reason")}} if r.get("drive") else {}
    return EngineRun(code, r["elapsed_s"], counts, checks, traces, {"reuse_profile": profile, "drives": drives})


def _reuse_profile(v: Any, layout: str) -> dict:
    """The layout's reuse profile (usable hit by divergence position; with its dense twin where
    the layout sets a retention interval), for the HTML report's plot."""
    try:
        return v.reuse_profile(layout)
    except (v.VllmUnavailable, ValueError):
        return {}
