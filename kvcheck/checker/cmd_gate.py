"""`kvcheck gate`: run the CI profile and print its verdict (the profile is gate.py)."""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import check_fault, check_writable, emit, load_config, progress
from .gate import run_gate


def cmd_gate(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    if args.fault is not None:
        check_fault(args.fault, ("spec",), "`kvcheck gate`")
    out = Path(args.out)
    check_writable(out)
    with progress(args, "random walks") as bar:
        code, rep = run_gate(cfg, out, args.config, args.fault, args.seed, args.steps, progress=bar)

    def text() -> str:
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
        lines.append(f"  report: {out / 'report.md'}")
        return "\n".join(lines)

    emit(args, rep, text)
    return code


