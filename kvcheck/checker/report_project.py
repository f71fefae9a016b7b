"""The project gate's plots, one group per system (each vLLM layout and model type its own).

Owns adapting a project's report.json into the numbers the default gate's plots take
(report_engines.PlotData), so the same pictures are drawn by the same code: per system, its
engines' logical vs usable hit rate and degradations per reason (`engines.<system engine>.metrics`,
written by the walk and the diff), the reuse profile of a vLLM layout (`reuse_profile`), and the
detection time of each planted expected fault (its `expected_fault:NAME` check: seconds to the
first failure, green when the expected check caught it). What a system has no numbers for is
said in one line instead of an empty plot.
"""
from __future__ import annotations

from typing import Any

from . import report_engines as eng
from .report_findings import lst, obj

PREFIX = "expected_fault:"


def is_project(data: dict[str, Any]) -> bool:
    return isinstance(data.get("report"), dict) and "project" in data["report"]


def _faults(rep: dict[str, Any]) -> dict[str, tuple[list[tuple[str, str, float, str]], list[str]]]:
    """Per system: detection-time rows (fault, engine, seconds, status) and the faults not caught."""
    out: dict[str, tuple[list[tuple[str, str, float, str]], list[str]]] = {}
    for i, c in enumerate(lst(rep.get("checks") or [], "report.json: checks")):
        c = obj(c, f"report.json: checks[{i}]")
        name = str(c.get("check", ""))
        if not name.startswith(PREFIX) or c.get("verdict") == "skipped":
            continue
        rows, missed = out.setdefault(str(c.get("system")), ([], []))
        fault, counts = name[len(PREFIX):], obj(c.get("counts") or {}, f"report.json: checks[{i}].counts")
        caught_by = lst(counts.get("caught_by") or [], f"report.json: checks[{i}].counts.caught_by")
        if c.get("verdict") != "passed" and not caught_by:
            missed.append(fault)
            continue
        secs = counts.get("seconds_to_detection", c.get("seconds"))
        rows.append((fault, str(c.get("engine")), eng.num(secs, f"report.json: checks[{i}] seconds"),
                     "killed" if c.get("verdict") == "passed" else "mis-attributed"))
    return out


def _not_plotted(pd: eng.PlotData, names: list[str], missed: list[str]) -> list[str]:
    why = []
    if not pd.rates and not pd.degr:
        why.append(f"hit rates and degradations (its engines, {', '.join(names)}, do not measure them; "
                   "walk and diff do)")
    elif not pd.degr:
        why.append("degradations (no lookup was degraded)")
    if not pd.times:
        why.append(f"detection time (no planted fault was caught: {', '.join(missed)})" if missed else
                   "detection time (no expected faults planted)")
    if not pd.profiles:
        why.append("reuse profile (none recorded: vLLM layouts record one)")
    return why


def system_plots(data: dict[str, Any]) -> list[tuple[str, list[tuple[str, str]], str | None]]:
    """(system, [(img, caption)], the one line saying what is not plotted and why, or None)."""
    rep = data["report"]
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    for key, x in obj(rep.get("engines") or {}, "report.json: engines").items():
        x = obj(x, f"report.json: engines.{key}")
        system = str(x.get("system", key))
        if system != "corpus":             # the corpus replay: traces, nothing to plot
            groups.setdefault(system, {})[str(x.get("engine", key))] = x
    faults = _faults(rep)
    for system in faults:
        groups.setdefault(system, {})
    out = []
    for system, blocks in groups.items():
        pd = eng.plot_data(blocks)
        rows, missed = faults.get(system, ([], []))
        pd.times += rows
        figs = eng.draw(pd)
        why = _not_plotted(pd, list(blocks) or ["none"], missed)
        note = None
        if why:
            note = (f"Not plotted for {system}: " if figs else f"No plots for {system}: ") + "; ".join(why) + "."
        out.append((system, figs, note))
    return out
