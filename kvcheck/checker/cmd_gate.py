"""`kvcheck gate`: run the CI profile (gate.py), or the project file's systems (gate_project.py),
and print its verdict with every engine that ran; `--junit FILE` writes the checks as JUnit."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ..spec.outputs import kvcheck_command
from .common import UsageError, check_fault, check_out_file, check_writable, emit, load_config, progress
from .gate import publish, run_gate, write_report
from .project import find_project, load_project


def cmd_gate(args: argparse.Namespace) -> int:
    path = find_project(args.project)
    if path is not None and (args.fault is not None or args.steps is not None or args.seed is not None):
        raise UsageError(f"--fault/--steps/--seed apply to the default profile; with a project file "
                         f"({path}) list expected_faults, budgets and seeds there")
    proj = load_project(path) if path is not None else None
    if getattr(args, "strict_known", False):
        if proj is None:
            raise UsageError("--strict-known applies to a project gate (its known defects); the default "
                             "profile acknowledges none")
        proj.strict_known()
    cfg = load_config(args)
    if args.fault is not None:
        check_fault(args.fault, ("spec",), "`kvcheck gate`")
    out = Path(args.out)
    created = not out.exists()
    check_writable(out)
    junit = Path(args.junit) if args.junit else None
    if junit is not None:
        check_out_file(junit, "--junit", (".xml",))
    since = time.time() - 1.0
    if proj is None:
        with progress(args, "random walks") as bar:
            code, rep = run_gate(cfg, out, args.config, args.fault, args.seed or 0, args.steps, progress=bar)
    else:
        from .gate_project import run_project
        cmd = kvcheck_command("gate", "--project", path, *(["--config", args.config] if args.config else []),
                              *(["--strict-known"] if getattr(args, "strict_known", False) else []),
                              *(["--out", args.out] if args.out != "kvcheck-report" else []))
        check_corpus_location(proj.corpus)     # before the work: a finding must have somewhere to go
        with progress(args, f"gate: {path}") as bar:
            code, rep = run_project(proj, out, cfg, cmd, progress=bar)
        try:
            write_report(out, rep)
        except OSError as e:
            raise UsageError(f"the gate ran (exit {code}: {rep.get('verdict')}) but its report could not be "
                             f"written to {out}: {e.strerror or e}") from None
    if junit is not None:
        from .junit import write_junit
        write_junit(junit, rep)
    publish(out, since, created)
    emit(args, rep, lambda: (project_text(rep, code, out) if proj is not None else default_text(rep, code, out))
         + (f"\n  junit: {junit}" if junit is not None else ""))
    return code


def check_corpus_location(corpus: Path) -> None:
    """The corpus directory exists and takes files, or its nearest existing parent does (it is
    created only when there is a finding to save)."""
    import os
    if corpus.exists():
        check_writable(corpus, "corpus directory")
        return
    parent = next((p for p in corpus.parents if p.exists()), Path("."))
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write to corpus directory {corpus}: {parent} is "
                         + ("not a directory" if not parent.is_dir() else "not writable"))


def engine_rows(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """Every engine that ran, with its verdict, check tally, counts and time."""
    if "project" in rep:
        return list(rep["engines"].values())
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for c in rep.get("checks", []):
        r = rows.setdefault((c["system"], c["engine"]), {"system": c["system"], "engine": c["engine"],
                                                        "checks": {}, "counts": c["counts"], "seconds": 0.0})
        r["checks"][c["verdict"]] = r["checks"].get(c["verdict"], 0) + 1
        r["seconds"] = max(r["seconds"], c["seconds"])
    for r in rows.values():
        t = r["checks"]
        r["verdict"] = "failed" if t.get("failed") else "undecided" if t.get("undecided") else "holds"
    return list(rows.values())


def _engine_lines(rep: dict[str, Any]) -> list[str]:
    lines = ["  engines:"]
    rows = engine_rows(rep)
    width = max([len(f"{r['system']} {r['engine']}") for r in rows] + [20])
    for r in rows:
        counts = ", ".join(f"{k} {v}" for k, v in r["counts"].items() if not isinstance(v, (list, dict)))
        tally = ", ".join(f"{n} {k}" for k, n in r["checks"].items())
        lines.append(f"    {r['system'] + ' ' + r['engine']:{width}} {r['verdict']:9} {tally:24} "
                     f"{r['seconds']:8.2f} s  {counts}")
    return lines


def project_text(rep: dict[str, Any], code: int, out: Path) -> str:
    lines = [f"kvcheck gate: {rep['verdict']} (exit {code})",
             f"  project: {rep['project']}; corpus {rep['corpus']}: {rep['corpus_replayed']} traces replayed first, "
             f"{len(rep['corpus_saved'])} new findings saved"]
    if rep.get("corpus_error"):
        lines.append(f"  NOT SAVED: {rep['corpus_error']}")
    lines += _engine_lines(rep)
    for f in rep["findings"]:
        lines.append(f"  FINDING {f['system']} {f['engine']} [{f['kind']}] {f['check']}: {f['message']}")
        lines += [f"    {i:3}. {s}" for i, s in enumerate(f["trace_steps"])]
        if f["replay"]:
            lines.append(f"    replay: {f['replay']}")
    if rep.get("interrupted"):
        lines.append(f"  interrupted during {rep['interrupted']}: what ran is in {out / 'report.json'}")
    lines.append(f"  rerun: {rep['command']}\n  report: {out / 'report.md'}")
    return "\n".join(lines)


def default_text(rep: dict[str, Any], code: int, out: Path) -> str:
    lines = [f"kvcheck gate: {rep['verdict']} (exit {code})"]
    if rep.get("interrupted"):
        lines.append(f"  interrupted during {rep['interrupted']}: what ran is in {out / 'report.json'}, "
                     "nothing is claimed")
    if "walk" not in rep["engines"]:
        return "\n".join(lines)
    w = rep["engines"]["walk"]
    cov = w["coverage"]
    lines += [
             f"  walk: {w['steps']} steps, {w['episodes']} episodes, {w['seconds']} s, "
             f"{w['steps_per_s']} steps/s, {w['invariants_checked']} invariants after every step",
             "  decisions: " + ", ".join(f"{k} {v}" for k, v in cov["decisions"].items()),
             f"  actions reached: {sum(1 for v in cov['actions'].values() if v)}/{len(cov['actions'])}",
             f"  seed: {rep['seed']}   rerun: {rep['command']}"]
    if "violation" in rep:
        v = rep["violation"]
        lines.append(f"  violated: {', '.join(v['invariants'])} at `{v['action']}`")
        if "fault_result" in rep:
            fr = rep["fault_result"]
            lines.append(f"  fault {rep['fault']}: expected {fr['expected']} -> "
                         + ("caught" if fr["caught"] else f"MIS-ATTRIBUTED (caught by {', '.join(fr['caught_by'])})"))
        lines.append(f"  shrunk trace ({len(v['trace_steps'])} steps):")
        lines += [f"    {i:3}. {s}" for i, s in enumerate(v["trace_steps"])]
        lines.append(f"  replay: {v['replay']}")
    if rep.get("coverage_missing"):
        lines.append("  coverage below the minimum: " + "; ".join(rep["coverage_missing"]))
    if rep.get("fault_result") and not rep["fault_result"]["caught"] and "violation" not in rep:
        lines.append(f"  fault {rep['fault']} SURVIVED: no violation within the budget")
    lines += _engine_lines(rep)
    lines.append(f"  report: {out / 'report.md'}")
    return "\n".join(lines)
