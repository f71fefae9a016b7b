"""`kvcheck report`: one Markdown page and one self-contained HTML page from a report directory.

Owns reading the directory and the Markdown page: the JSON the engines wrote (report.json from
the gate, prove.json, explore.json, and mutants.json when `kvcheck mutants --json` was saved
there) is checked and handed to report_html (the page) and never rerun. The engines' traces
are replayed on the spec for the HTML timelines (report_findings, timeline).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ..spec.config import read_json
from ..spec.outputs import write_atomic
from .common import UsageError, check_out_file
from .report_findings import collect
from .report_html import render_html


class _Bad(UsageError):
    pass


def load_dir(d: Path) -> dict[str, Any]:
    """The JSON files of a report directory, each an object with a verdict and an exit code."""
    if not d.is_dir():
        raise UsageError(f"report directory {d} does not exist or is not a directory")
    out: dict[str, Any] = {}
    for name in ("report", "prove", "explore", "mutants"):
        p = d / f"{name}.json"
        if p.exists():
            data = read_json(p, f"{name}.json", _Bad)
            if not isinstance(data, dict):
                raise UsageError(f"{p} is not a kvcheck report: expected a JSON object, "
                                 f"got a {type(data).__name__}")
            if name == "mutants":
                _check_mutants(p, data)
            elif not isinstance(data.get("verdict"), str):
                raise UsageError(f"{p} is not a kvcheck report: no 'verdict' string")
            if isinstance(data.get("exit_code"), bool) or not isinstance(data.get("exit_code"), int):
                raise UsageError(f"{p} is not a kvcheck report: no integer 'exit_code'")
            out[name] = data
    if not out:
        raise UsageError(f"no report.json, prove.json, explore.json or mutants.json in {d}")
    return out


def _check_mutants(p: Path, data: dict[str, Any]) -> None:
    """mutants.json is `kvcheck mutants --json` saved by hand: its rows are checked here, so a
    bad one is refused whatever is rendered."""
    what = f"{p} is not `kvcheck mutants --json` output"
    if not isinstance(data.get("faults"), list):
        raise UsageError(f"{what}: no 'faults' list")
    for i, r in enumerate(data["faults"]):
        if not isinstance(r, dict) or not isinstance(r.get("fault"), str) or not isinstance(r.get("engines"), dict):
            raise UsageError(f"{what}: faults[{i}] must be an object with a 'fault' name and an 'engines' object")
        for e, c in r["engines"].items():
            secs = c.get("seconds") if isinstance(c, dict) else None
            if isinstance(secs, bool) or not isinstance(secs, (int, float)):
                raise UsageError(f"{what}: faults[{i}].engines.{e} must be an object with numeric 'seconds'")


def _invariant_rows(data: dict[str, Any]) -> list[list[str]]:
    rows = []
    for o in data.get("prove", {}).get("invariants", []):
        rows.append([o["name"], o.get("kind", ""), o["status"], o["method"],
                     "" if o["bound"] is None else str(o["bound"]), f"{o['seconds']:.2f}"])
    return rows


def render_markdown(data: dict[str, Any], d: Path) -> str:
    L = ["# kvcheck report", ""]
    if "report" in data:
        r = data["report"]
        L += [f"- gate verdict: **{r.get('verdict')}** (exit {r.get('exit_code')}); command `{r.get('command')}`"]
    if "prove" in data:
        p = data["prove"]
        L += [f"- prove: **{p['verdict']}** (exit {p['exit_code']}) in {p['seconds']} s; "
              f"BMC depth {p['bmc']['checked']}"]
    if "explore" in data:
        e = data["explore"]
        L += [f"- explore: **{e['verdict']}** (exit {e['exit_code']}): {e['states']} states, "
              f"{e['transitions']} transitions, {e['seconds']} s"]
    rows = _invariant_rows(data)
    if rows:
        L += ["", "## Invariants", "", "| invariant | kind | status | method | bound | seconds |",
              "|---|---|---|---|---|---|"] + ["| " + " | ".join(r) + " |" for r in rows]
    if "explore" in data:
        e = data["explore"]
        L += ["", "## Coverage (explore)", "", f"- decisions reached: {', '.join(e['decisions']) or 'none'}",
              f"- object states reached: {', '.join(e['object_states'])}",
              f"- deadlocks: {e['deadlocks']}",
              f"- states from which every-request-idle is unreachable: "
              f"{(e.get('idle_unreachable') or {}).get('count', 'n/a')}",
              f"- sometimes-properties not reached: {', '.join(e['sometimes_missing']) or 'none'}",
              "", "| action | transitions |", "|---|---|"]
        L += [f"| {a} | {n} |" for a, n in e["actions"].items()]
        if e.get("diagrams"):
            L += ["", "## State diagrams", ""]
            for kind, files in e["diagrams"].items():
                pic = files.get("png") or files.get("svg") or files.get("dot")
                L.append(f"![{kind}]({Path(pic).name})")
    found = collect(data, d)
    if found:
        L += ["", "## Counterexamples", ""]
        for f in found:
            L += [f"### {f.system} / {f.engine}: [{f.kind}] {f.check}", "", f.message, "",
                  f"replay: `{f.replay}`", "", "```"] + f.trace_steps + ["```", ""]
    w = data.get("report", {}).get("engines", {}).get("walk")
    if w:
        m = w["metrics"]
        L += ["", "## Metrics (walk)", "", f"- steps: {w['steps']} ({w['steps_per_s']} steps/s)",
              f"- logical hit rate: {m['logical_hit_rate']}; usable hit rate: {m['usable_hit_rate']}",
              "", "| degradation reason | count |", "|---|---|"]
        L += [f"| {k} | {v} |" for k, v in m["degradations"].items()]
    if "explore" in data:
        L += ["", "## Metrics (checker)", "", f"- explore: {data['explore']['states_per_s']} states/s"]
    if "prove" in data:
        L += [f"- prove: {data['prove']['seconds']} s for {len(data['prove']['invariants'])} obligations"]
    return "\n".join(L) + "\n"


def _render(fn: Callable[[dict[str, Any], Path], str], data: dict[str, Any], d: Path) -> str:
    """Render, turning a report file of the wrong shape into one line (exit 2)."""
    try:
        return fn(data, d)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as e:
        raise UsageError(f"the JSON files in {d} do not have the shape kvcheck writes "
                         f"({type(e).__name__}: {str(e)[:80]})") from None


def cmd_report(args: Any) -> int:
    d = Path(args.in_dir)
    data = load_dir(d)
    check_out_file(d / "summary.md", "summary")
    if args.html:
        check_out_file(d / "report.html", "report.html")
    md = _render(render_markdown, data, d)
    page = _render(render_html, data, d) if args.html else None
    write_atomic(d / "summary.md", md)
    out = {"markdown": str(d / "summary.md")}
    if page is not None:
        write_atomic(d / "report.html", page)
        out["html"] = str(d / "report.html")
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(md)
        print(f"written: {', '.join(out.values())}")
    return 0
