"""The report's per-engine sections and the numbers its plots are drawn from.

Owns reading each engine's block of report.json (and the fuller prove.json, explore.json and
an optional mutants.json, `kvcheck mutants --json` saved next to them) into one section each:
walk, fuzz per system, diff, the mutants matrix, prove, explore, and a plain table for an engine
this page does not know. Optional keys any engine may add, plotted when present:
  engines.<name>.reuse_profile = {layout: [[divergence_pos, usable_hit_tokens], ...]}
  engines.<name>.matrix = the `faults` rows of `kvcheck mutants --json` (detection times)
"""
from __future__ import annotations

import base64
from html import escape as e
from pathlib import Path
from typing import Any

from . import plots as pl
from .report_findings import ShapeError, lst, obj

ORDER = ("walk", "fuzz_spec", "fuzz_reference", "diff_reference", "mutants_smoke", "prove", "explore")
TITLES = {"walk": "Random walks of the spec", "fuzz_spec": "Fuzz --sut spec", "fuzz_reference": "Fuzz --sut reference",
          "diff_reference": "Diff: reuse vs full recompute (reference engine)", "mutants_smoke": "Mutants (gate smoke)",
          "mutants": "Mutants matrix", "prove": "Z3 proofs", "explore": "Explicit-state exploration",
          "exhaustive_reference": "Exhaustive small scope (reference engine)"}


def num(x: Any, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ShapeError(f"{where} must be a number, got {type(x).__name__}")
    return x


def counts(x: Any, where: str) -> dict[str, float]:
    return {str(k): num(v, f"{where}.{k}") for k, v in obj(x, where).items()}


def table(head: list[str], rows: list[list[Any]], cls: str = "") -> str:
    h = "".join(f"<th>{e(x)}</th>" for x in head)
    body = "".join("<tr>" + "".join(f"<td class='{e(str(c)) if str(c) in _TONES else ''}'>{e(str(c))}</td>"
                                    for c in r) + "</tr>" for r in rows)
    return f"<table class='{cls}'><tr>{h}</tr>{body}</table>"


_TONES = {"proved", "holds", "violated", "unknown", "killed", "survived", "mis-attributed", "yes", "NO"}


def engines(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every engine's block, the full files preferred over the gate's digest of them."""
    out = {k: obj(v, f"report.json: engines.{k}")
           for k, v in obj(data.get("report", {}).get("engines", {}), "report.json: engines").items()}
    for key in ("prove", "explore"):
        if key in data:
            out[key] = {**out.get(key, {}), **data[key]}
    if "mutants" in data:
        out["mutants"] = data["mutants"]
    order = [k for k in ORDER if k in out] + [k for k in out if k not in ORDER]
    return {k: out[k] for k in order}


def _verdict(name: str, x: dict[str, Any], data: dict[str, Any]) -> str:
    if isinstance(x.get("verdict"), str):
        return x["verdict"]
    if name == "walk":
        rep = data.get("report", {})
        return "violated" if rep.get("violation") else "holds" if not rep.get("coverage_missing") else "undecided"
    if x.get("findings"):
        return f"{len(x['findings'])} finding(s)"
    if "mutation_score" in x:
        return f"score {num(x['mutation_score'], f'{name}.mutation_score'):.0%}"
    if "bitwise_equal" in x:
        return "holds" if x["bitwise_equal"] and not x.get("mismatches") else "violated"
    return "holds" if x.get("exit_code") == 0 else f"exit {x.get('exit_code')}"


def summary_table(data: dict[str, Any]) -> str:
    rows = []
    for name, x in engines(data).items():
        size = next((f"{x[k]} {k}" for k in ("steps", "states", "scenarios", "scored") if k in x), "")
        rows.append([name, _verdict(name, x, data), x.get("exit_code", ""), size, x.get("seconds", "")])
    if not rows:
        return ""
    return "<h2 id='engines'>Engines</h2>" + table(["engine", "result", "exit", "size", "seconds"], rows, "engines")


def _counts(x: dict[str, Any], key: str, where: str, head: str, col: str = "count") -> str:
    """A two-column table of one of an engine's {name: count} maps."""
    return table([head, col], [[k, v] for k, v in counts(x.get(key) or {}, f"{where}.{key}").items()])


def _names(x: Any, where: str) -> str:
    return e(", ".join(map(str, lst(x, where)))) or "none"


def _walk(x: dict[str, Any], data: dict[str, Any]) -> str:
    cov, met = obj(x["coverage"], "walk.coverage"), obj(x["metrics"], "walk.metrics")
    H = [f"<p>{x['steps']} steps in {x.get('episodes', '?')} episodes, {x.get('seconds')} s "
         f"({x.get('steps_per_s')} steps/s); {x.get('invariants_checked')} invariants "
         f"({x.get('conjuncts')} conjuncts) checked after every step.</p>",
         f"<p>logical hit rate {met['logical_hit_rate']}, usable hit rate {met['usable_hit_rate']} "
         f"over {met.get('lookups')} lookups.</p>"]
    missing = data.get("report", {}).get("coverage_missing") or []
    if missing:
        H.append(f"<p class='warn'>coverage below the profile minimum: {_names(missing, 'coverage_missing')}</p>")
    H += ["<div class='pics'>", _counts(cov, "decisions", "walk.coverage", "decision"),
          _counts(cov, "actions", "walk.coverage", "action"),
          _counts(cov, "object_states", "walk.coverage", "object state", "entries"), "</div>"]
    return "\n".join(H)


def _fuzz(x: dict[str, Any]) -> str:
    cov = obj(x.get("coverage", {}), "fuzz.coverage")
    H = [f"<p>{x.get('steps')} steps in {x.get('seconds')} s ({x.get('steps_per_s')} steps/s), exit "
         f"{x.get('exit_code')}; {len(lst(x.get('findings', []), 'fuzz.findings'))} finding(s).</p>"]
    if cov.get("decisions"):
        H.append(_counts(cov, "decisions", "fuzz.coverage", "decision"))
    if cov.get("actions_missing") is not None:
        H.append(f"<p>actions never exercised: {_names(cov['actions_missing'], 'fuzz.coverage.actions_missing')}</p>")
    return "\n".join(H)


def _diff(x: dict[str, Any]) -> str:
    eq = x.get("bitwise_equal")
    H = [f"<p>{x.get('scenarios')} scenarios; output with reuse bitwise equal to a full recompute: "
         f"<span class='{'proved' if eq else 'violated'}'>{e(str(eq))}</span>; logical hit rate "
         f"{x.get('logical_hit_rate')}, usable {x.get('usable_hit_rate')}.</p>", "<div class='pics'>"]
    H += [_counts(x, key, "diff", key.replace("_", " ")) for key in ("decisions", "objects_exercised", "degradations")
          if x.get(key)]
    H.append("</div>")
    H += [f"<pre>{e(str(m))}</pre>" for m in lst(x.get("mismatches") or [], "diff.mismatches")[:20]]
    return "\n".join(H)


def _matrix_rows(x: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The full matrix rows (`matrix`, or mutants.json's `faults` list); none for the smoke's
    {fault: status} digest."""
    rows = x.get("matrix") if "matrix" in x else x.get("faults") if isinstance(x.get("faults"), list) else None
    if rows is None:
        return []
    out = [obj(r, f"{where}[{i}]") for i, r in enumerate(lst(rows, where))]
    for i, r in enumerate(out):
        for en, c in obj(r.get("engines", {}), f"{where}[{i}].engines").items():
            obj(c, f"{where}[{i}].engines.{en}")
    return out


def _cell(c: dict[str, Any] | None) -> str:
    if c is None:
        return "-"
    verdict = "OK" if c.get("expected_caught") else "other" if c.get("detected") else "miss"
    return f"{verdict} {c.get('seconds')}s"


def _mutants(x: dict[str, Any], name: str) -> str:
    clean = x.get("negative_control_clean")
    H = [f"<p>mutation score {num(x.get('mutation_score', 0), f'{name}.mutation_score'):.0%} "
         f"({x.get('killed')}/{x.get('scored')} killed by their expected check); negative control "
         + ("<span class='proved'>clean</span>" if clean else "<span class='violated'>NOT clean</span>") + "</p>"]
    rows = _matrix_rows(x, f"{name}.matrix")
    if rows:
        names = list(dict.fromkeys(en for r in rows for en in r.get("engines", {})))
        body = [[r.get("fault"), r.get("expected"), r.get("status")] + [_cell(r.get("engines", {}).get(en))
                                                                      for en in names] for r in rows]
        H.append(table(["fault", "expected check", "status"] + names, body))
    elif isinstance(x.get("faults"), dict):
        H.append(table(["fault", "status"], [[k, v] for k, v in x["faults"].items()]))
    for s in lst(x.get("survivors", []), f"{name}.survivors") + lst(x.get("misattributed", []),
                                                                   f"{name}.misattributed"):
        H.append(f"<p class='warn'>{e(str(obj(s, name).get('fault')))}: {e(str(s.get('why')))}</p>")
    return "\n".join(H)


def _prove(x: dict[str, Any]) -> str:
    bmc = obj(x.get("bmc") or {}, "prove.bmc")
    v = e(str(x.get("verdict")))
    H = [f"<p>verdict <span class='{v}'>{v}</span> in {x.get('seconds')} s; bounded model checking to "
         f"depth {bmc.get('checked')}.</p>"]
    rows = [[o["name"], o.get("kind", ""), o["status"], o["method"], "" if o.get("bound") is None else o["bound"],
             f"{num(o['seconds'], 'prove.invariants.seconds'):.2f}"]
            for o in (obj(o, "prove.invariants[]") for o in lst(x.get("invariants", []), "prove.invariants"))]
    H.append(table(["invariant", "kind", "status", "method", "bound", "seconds"], rows))
    return "\n".join(H)


def _picture(files: dict[str, Any], d: Path) -> str:
    for key in ("svg", "png"):
        if isinstance(files.get(key), str):
            p = Path(files[key])
            if not p.is_file():
                p = d / p.name
            if not p.is_file():
                continue
            if key == "svg":
                t = p.read_text(errors="replace")
                return t[t.index("<svg"):] if "<svg" in t else ""
            return (f"<img alt='{e(p.stem)}' src='data:image/png;base64,"
                    f"{base64.b64encode(p.read_bytes()).decode()}'>")
    return ""


def _explore(x: dict[str, Any], d: Path) -> str:
    H = [f"<p>verdict <b>{e(str(x.get('verdict')))}</b>: {x.get('states')} distinct states, "
         f"{x.get('transitions')} transitions, depth {x.get('depth')}, {x.get('seconds')} s "
         f"({x.get('states_per_s')} states/s), "
         f"{'exhaustive' if x.get('exhaustive') else 'not exhaustive'}; deadlocks {x.get('deadlocks')}.</p>"]
    some = obj(x.get("sometimes") or {}, "explore.sometimes")
    if some:
        missing = [k for k, ok in some.items() if not ok]
        H.append(f"<p>{len(some) - len(missing)}/{len(some)} sometimes-properties reached"
                 + (": not reached: " + e(", ".join(missing)) if missing else "") + ".</p>")
    elif x.get("sometimes_missing"):
        H.append(f"<p>not reached: {_names(x['sometimes_missing'], 'explore.sometimes_missing')}</p>")
    dia = obj(x.get("diagrams") or {}, "explore.diagrams")
    if dia:
        H.append("<h3>Object state diagrams (as observed)</h3><div class='pics'>")
        H += [f"<div>{_picture(obj(f, 'explore.diagrams.' + k), d)}</div>" for k, f in dia.items()]
        H.append("</div>")
    return "\n".join(H)


def _generic(x: dict[str, Any]) -> str:
    rows = [[k, v] for k, v in x.items() if isinstance(v, (str, int, float, bool)) or v is None]
    return table(["key", "value"], rows)


def _coverage(runs: dict[str, Any]) -> str:
    """`cover = true`: per campaign and module, the engine's cache code reached (lines, branches),
    the lines never reached, and coverage.py's annotated listing."""
    rows = []
    for run, c in runs.items():
        c = obj(c, f"report.json: engine_coverage.{run}")
        for mod, f in obj(c.get("files", {}), f"report.json: engine_coverage.{run}.files").items():
            f = obj(f, f"report.json: engine_coverage.{run}.files.{mod}")
            miss = lst(f.get("missing_lines", []), f"report.json: engine_coverage.{run}.files.{mod}.missing_lines")
            rows.append([run, mod, f.get("lines_pct"), f.get("runtime_pct"), f.get("branches_pct"),
                         ", ".join(map(str, miss[:12])) + (" ..." if len(miss) > 12 else "")])
        if c.get("annotated"):
            rows.append([run, "annotated listing", "", "", "", str(c["annotated"])])
    return "<h3>Engine-code coverage</h3>" + table(["campaign", "module", "lines %", "run-time lines %", "branches %",
                                                    "never reached"], rows)


def sections(data: dict[str, Any], d: Path) -> list[tuple[str, str, str]]:
    out = []
    for name, x in engines(data).items():
        if name == "walk":
            body = _walk(x, data)
        elif name.startswith("fuzz"):
            body = _fuzz(x)
        elif name.startswith("diff"):
            body = _diff(x)
        elif name.startswith("mutants"):
            body = _mutants(x, name)
        elif name == "prove":
            body = _prove(x)
        elif name == "explore":
            body = _explore(x, d)
        else:
            body = _generic(x)
        if isinstance(x.get("engine_coverage"), dict):
            body += _coverage(x["engine_coverage"])
        title = TITLES.get(name, name.replace("_", " "))
        out.append((f"engine-{name}", title, body))
    checks = data.get("report", {}).get("checks")
    if checks:
        rows = [obj(c, f"report.json: checks[{i}]") for i, c in enumerate(lst(checks, "report.json: checks"))]
        head = list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, (dict, list))))
        out.append(("checks", f"Checks ({len(rows)})", table(head, [[r.get(k, "") for k in head] for r in rows])))
    return out


class PlotData:
    """The numbers the plots are drawn from, pulled out of engine blocks (or adapted into this
    shape from elsewhere, as the project gate's per-system page does: report_project.py)."""

    def __init__(self) -> None:
        self.rates: list[tuple[str, float, float]] = []        # (source, logical, usable)
        self.degr: dict[str, dict[str, float]] = {}             # source -> {reason: count}
        self.times: list[tuple[str, str, float, str]] = []      # (fault, engine, seconds, status)
        self.profiles: list[tuple[str, str, list[tuple[float, float]]]] = []   # (source, layout, points)

    def __bool__(self) -> bool:
        return bool(self.rates or self.degr or self.times or self.profiles)


def plot_data(eng: dict[str, dict[str, Any]], pd: PlotData | None = None) -> PlotData:
    """Every plottable number of these engine blocks, keyed by their names."""
    pd = pd or PlotData()
    for name, x in eng.items():
        src = x.get("metrics") if isinstance(x.get("metrics"), dict) else x
        if "logical_hit_rate" in src and "usable_hit_rate" in src:
            pd.rates.append((name, num(src["logical_hit_rate"], f"{name}.logical_hit_rate"),
                             num(src["usable_hit_rate"], f"{name}.usable_hit_rate")))
        if src.get("degradations"):
            pd.degr[name] = counts(src["degradations"], f"{name}.degradations")
        for r in _matrix_rows(x, f"{name}.matrix") if name.startswith("mutants") or "matrix" in x else []:
            for en, c in obj(r.get("engines", {}), f"{name}.matrix.engines").items():
                c = obj(c, f"{name}.matrix.engines.{en}")
                if c.get("detected"):
                    st = "killed" if c.get("expected_caught") else "mis-attributed"
                    pd.times.append((str(r.get("fault")), en, num(c.get("seconds"), f"{name}.matrix.seconds"), st))
        for layout, pts in obj(x.get("reuse_profile", {}), f"{name}.reuse_profile").items():
            w = f"engines.{name}.reuse_profile.{layout}"
            pairs = [lst(p, w) for p in lst(pts, w)]
            if any(len(p) != 2 for p in pairs):
                raise ShapeError(f"{w} must be a list of [divergence_pos, usable_hit_tokens] pairs")
            pd.profiles.append((name, layout, [(num(a, w), num(b, w)) for a, b in pairs]))
    return pd


def draw(pd: PlotData) -> list[tuple[str, str]]:
    """(img, caption) for every plot the numbers support; one line instead when matplotlib is
    missing."""
    why = pl.available()
    if why:
        return [("", why)] if pd else []
    out = []
    if pd.rates:
        out.append((pl.hit_rates(pd.rates), "Logical hit rate (the prefix table matched) vs usable hit rate "
                                            "(every object needed to resume was valid)."))
    if pd.degr:
        out.append((pl.degradations(pd.degr), "Why lookups were degraded, per reason (one lookup can have several)."))
    if pd.times:
        out.append((pl.detection_times(pd.times), "Seconds each engine needed to catch each planted fault."))
    for name, layout, pts in pd.profiles:
        out.append((pl.reuse_profile(layout, pts), f"Reuse profile of layout {layout} ({name}): usable hit "
                                                   "tokens by divergence position."))
    return out


def plots(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(img, caption) for every plot the data supports."""
    return draw(plot_data(engines(data)))
