"""`kvcheck matrix`'s outputs: the data (matrix-ENGINE.json), the Markdown page, the HTML page and
the console table, all from one dict (`matrix_data`).

The table is release x layout, one short verdict per cell; every cell that is not clean or
"cannot express" has a numbered note below it (the finding with its replay command, or the one
line of a cannot-drive, undecided or error cell, with the command that reruns the cell). The
console shows the table the narrower way round (layouts as rows when there are more layouts than
releases)."""
from __future__ import annotations

import datetime as _dt
import json
import re
import shlex
from html import escape as esc
from pathlib import Path
from typing import Any

from ..spec.outputs import file_stem, write_atomic
from ..spec.verdict import ExitCode
from .matrix import LEGEND, UNPROVEN, VERDICTS, count, fill_cell
from .matrix_envs import ROOT

FORMAT = "kvcheck-matrix/1"
NOTED = ("finding",) + tuple(sorted(UNPROVEN))


def matrix_data(engine: str, rows: list[dict[str, Any]], columns: list[str], *, command: str, seed: int,
                budget: str, code: int, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    cols = list(columns)
    for r in rows:
        cols += [k for k in r["cells"] if k not in cols]
    counts = count(c for r in rows for c in r["cells"].values())
    return {"format": FORMAT, "engine": engine, "command": command,
            "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            "seed": seed, "budget_per_cell": budget, "layouts": cols, "exit_code": code,
            "verdict": summary(code, counts, len(rows)), "counts": counts, "legend": dict(LEGEND),
            **(meta or {}), "rows": rows}


def summary(code: int, counts: dict[str, int], releases: int) -> str:
    what = ", ".join(f"{n} {v}" for v, n in counts.items() if n) or "no cells"
    if code == ExitCode.INTERRUPTED:
        head = "interrupted: nothing is claimed"
    elif code == ExitCode.UNDECIDED:
        head = "not proven: some cells did not reach a verdict" if any(counts[v] for v in UNPROVEN) \
            else "not proven: no cell ran"
    elif code == ExitCode.OK:
        head = "every cell that could run is clean"
    else:
        head = f"findings (exit {code})"
    return f"{head} ({releases} release(s): {what})"


def label(row: dict[str, Any]) -> str:
    return str(row.get("release") or row.get("requested") or row.get("python") or "?")


def notes(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Numbered notes, in table order: one per finding, one per distinct unproven line of a
    release (a release whose environment failed has one note, not one per layout)."""
    out: list[dict[str, Any]] = []
    for r in data["rows"]:
        shared: dict[tuple[str, str], dict[str, Any]] = {}
        for lay in data["layouts"]:
            c = r["cells"].get(lay)
            if not c or c["verdict"] not in NOTED:
                continue
            key = (c["verdict"], c["line"])
            if c["verdict"] != "finding" and key in shared:
                shared[key]["layouts"].append(lay)
                continue
            x = {"n": len(out) + 1, "release": label(r), "layouts": [lay], "cell": c}
            out.append(x)
            shared.setdefault(key, x)
    return out


def _refs(data: dict[str, Any]) -> dict[tuple[str, str], int]:
    return {(x["release"], lay): x["n"] for x in notes(data) for lay in x["layouts"]}


def cell_text(row: dict[str, Any], lay: str, refs: dict[tuple[str, str], int]) -> str:
    c = row["cells"].get(lay)
    if c is None:
        return "-"
    n = refs.get((label(row), lay))
    return c["short"] + (f" [{n}]" if n else "")


def inexpressible(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(label(r), lay, r["cells"][lay]["line"]) for r in data["rows"] for lay in data["layouts"]
            if lay in r["cells"] and r["cells"][lay]["verdict"] == "cannot express"]


def runs(data: dict[str, Any]) -> tuple[list[tuple[str, list[tuple[str, str, str]]]], list[str]]:
    """Each column across the releases as runs of one verdict, (first, last, short) in release
    order, for the columns whose verdict changes or is not clean; and the columns clean on every
    release that ran them. A matrix of many releases and columns reads this way round."""
    varied, clean = [], []
    for lay in data["layouts"]:
        seq = [(label(r), _verdict(r["cells"][lay]["short"])) for r in data["rows"] if lay in r["cells"]]
        out: list[tuple[str, str, str]] = []
        for rel, short in seq:
            if out and out[-1][2] == short:
                out[-1] = (out[-1][0], rel, short)
            else:
                out.append((rel, rel, short))
        if [r[2] for r in out] == ["clean"]:
            clean.append(lay)
        elif out:
            varied.append((lay, out))
    return varied, clean


KNOWN_UPSTREAM = re.compile(r" \(known, .*?\)(?= \+\d+$| \(\+\d+ known\)$|$)")


def _verdict(short: str) -> str:
    """A cell's verdict as the runs compare it: a known defect by its name alone (its upstream
    reference is in the cell's note, and may be worded anew between two releases' runs)."""
    return KNOWN_UPSTREAM.sub(" (known)", short)


def _runs_md(data: dict[str, Any]) -> list[str]:
    varied, clean = runs(data)
    if len(data["rows"]) < 3:
        return []
    col = str(data.get("column") or "layout")
    out = ["", f"## Across releases, by {col}", "",
           f"Each {col} whose verdict is not clean on every release, as runs of releases with one verdict "
           "(release order; `A–B` spans every release of the table between them).", "",
           f"| {col} | across releases |", "|---|---|"]
    out += [f"| `{_md(lay)}` | " + "; ".join(f"{a}{'–' + b if b != a else ''}: {_md(v)}" for a, b, v in rs) + " |"
            for lay, rs in varied]
    if clean:
        out += ["", f"Clean on every release that has it ({len(clean)}): " + ", ".join(f"`{c}`" for c in clean) + "."]
    return out


def _note_lines(x: dict[str, Any], md: bool) -> list[str]:
    c, q = x["cell"], (lambda s: f"`{s}`" if md else s)
    where = ", ".join(x["layouts"]) if len(x["layouts"]) <= 4 else f"{len(x['layouts'])} layouts"
    lines = [f"[{x['n']}] {x['release']} {where}: {c['verdict']}: {c['line']}"]
    f = c.get("finding") or {}
    for k in ("replay", "trace", "reproducer"):
        if f.get(k):
            lines.append(f"    {k}: {q(f[k])}")
    for k in c.get("known") or []:
        if k.get("reproducer") and k.get("reproducer") != f.get("reproducer"):
            lines.append(f"    {k['name']} reproducer: {q(k['reproducer'])}")
    if c.get("rerun"):
        lines.append(f"    rerun the cell: {q(c['rerun'])}" if len(x["layouts"]) == 1 else
                     f"    rerun a cell ({x['layouts'][0]}; the same for the others): {q(c['rerun'])}")
    return lines


# ---- console ---------------------------------------------------------------------------------
def _grid(head: list[str], body: list[list[str]]) -> list[str]:
    w = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "  ".join(x.ljust(n) for x, n in zip(cells, w)).rstrip()  # noqa: E731
    return [fmt(head), fmt(["-" * n for n in w])] + [fmt(b) for b in body]


def render_text(data: dict[str, Any]) -> str:
    refs, rows, cols = _refs(data), data["rows"], data["layouts"]
    lines = [f"kvcheck matrix --sut {data['engine']}: {len(rows)} release(s) x {len(cols)} {_col(data)}(s), "
             f"budget {data['budget_per_cell']} per cell, seed {data['seed']}"]
    if len(cols) > len(rows):
        lines += _grid([_col(data)] + [label(r) for r in rows],
                       [[lay] + [cell_text(r, lay, refs) for r in rows] for lay in cols])
    else:
        lines += _grid(["release"] + cols, [[label(r)] + [cell_text(r, lay, refs) for lay in cols] for r in rows])
    for x in notes(data):
        lines += _note_lines(x, md=False)
    gaps = inexpressible(data)
    if gaps:
        lines.append(f"cannot express ({len(gaps)} cells, not run): " + "; ".join(
            f"{rel} {lay}: {why}" for rel, lay, why in gaps[:6]) + (" ..." if len(gaps) > 6 else ""))
    lines.append(f"verdict: {data['verdict']}; exit {data['exit_code']}")
    lines.append(f"seed {data['seed']}; rerun the matrix: {data['command']}")
    for r in rows:
        if r.get("python") and r.get("out_dir"):
            lines.append(f"rerun a cell of {label(r)}: " + rerun_template(r, data))
    if data.get("outputs"):
        lines.append("wrote " + ", ".join(data["outputs"]))
    return "\n".join(lines)


def rerun_template(row: dict[str, Any], data: dict[str, Any]) -> str:
    col = _col(data).upper().replace(" ", "_")
    cell = fill_cell(data.get("cell_args"), data["engine"], data["budget_per_cell"], data["seed"], col)
    return shlex.join([f"PYTHONPATH={ROOT}", row["python"], "-m", "kvcheck", *cell,
                       *data.get("fuzz_args", []), "--out", row["out_dir"]])


def _col(data: dict[str, Any]) -> str:
    """What a column is: "layout", or the engine's (transformers: "model type")."""
    return str(data.get("column") or "layout")


# ---- Markdown --------------------------------------------------------------------------------
def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def render_md(data: dict[str, Any]) -> str:
    refs, cols = _refs(data), data["layouts"]
    out = [f"# kvcheck matrix: {data['engine']}", "",
           f"**{data['verdict']}** (exit {data['exit_code']})", "",
           f"`{data['command']}` — {data['date']}, seed {data['seed']}, budget {data['budget_per_cell']} per cell", "",
           "| release | " + " | ".join(f"`{_md(c)}`" for c in cols) + " |",
           "|---" * (len(cols) + 1) + "|"]
    for r in data["rows"]:
        out.append(f"| {_md(label(r))} | " + " | ".join(_md(cell_text(r, c, refs)) for c in cols) + " |")
    out += _runs_md(data)
    out += ["", "## Legend", ""] + [f"- **{v}**: {LEGEND[v]}" for v in VERDICTS]
    found = [x for x in notes(data) if x["cell"]["verdict"] == "finding"]
    other = [x for x in notes(data) if x["cell"]["verdict"] != "finding"]
    for title, xs in (("Findings", found), ("Cannot drive, undecided, errors", other)):
        if xs:
            out += ["", f"## {title}", ""]
            for x in xs:
                first, *rest = _note_lines(x, md=True)
                out.append(f"- {_md(first)}")
                out += [f"  - {line.strip()}" for line in rest]
    gaps = inexpressible(data)
    if gaps:
        out += ["", "## Cannot express (not run)", ""] + [f"- {rel} `{lay}`: {_md(why)}" for rel, lay, why in gaps]
    envs = [r for r in data["rows"] if r.get("env") or r.get("python")]
    if envs:
        out += ["", "## Environments", ""] + [
            f"- {label(r)}: `{r.get('python') or r.get('env')}`"
            + (" (built)" if r.get("env_built") else " (reused)" if r.get("env") else "")
            + (f" — {_md(r['error'])}" if r.get("error") else "") for r in envs]
    return "\n".join(out) + "\n"


# ---- HTML ------------------------------------------------------------------------------------
MATRIX_CSS = """
td.v{white-space:nowrap;font-weight:600}
td.v-clean{background:#dff3e4;color:#0a5a22}td.v-finding{background:#fbd3d8;color:#8a0018}
td.v-cannot-express{background:#eee;color:#777;font-weight:400}td.v-cannot-drive{background:#e9ddf7;color:#4b2a7a}
td.v-undecided{background:#fff1c2;color:#7a5600}td.v-error{background:#ffd9b3;color:#7a3300}
td.v a{color:inherit}ol.notes li{margin:6px 0}ol.notes code{background:#f6f8fa;padding:1px 4px}
"""


def render_html(data: dict[str, Any]) -> str:
    from .report_html import page
    refs, cols, code = _refs(data), data["layouts"], data["exit_code"]
    tone = "ok" if code == 0 else "bad" if code in (10, 11, 12, 13) else "warn"
    head = (f"<header class='verdict {tone}'><h1>{esc(data['engine'])}: {esc(data['verdict'])}</h1>"
            f"<p>exit {code} · seed {data['seed']} · budget {esc(str(data['budget_per_cell']))} per cell · "
            f"{esc(data['date'])}</p><p><code>{esc(data['command'])}</code></p></header>")
    H = [f"<h2>Release × {esc(_col(data))}</h2><table class='matrix'><tr><th>release</th>"
         + "".join(f"<th>{esc(c)}</th>" for c in cols) + "</tr>"]
    for r in data["rows"]:
        tds = []
        for c in cols:
            cell = r["cells"].get(c)
            if cell is None:
                tds.append("<td>-</td>")
                continue
            n = refs.get((label(r), c))
            text = esc(cell["short"]) + (f" <a href='#note-{n}'>[{n}]</a>" if n else "")
            tds.append(f"<td class='v v-{cell['verdict'].replace(' ', '-')}' title='{esc(cell['line'], quote=True)}'>"
                       f"{text}</td>")
        H.append(f"<tr><th>{esc(label(r))}</th>{''.join(tds)}</tr>")
    H.append("</table><h2>Legend</h2><table>" + "".join(
        f"<tr><td class='v v-{v.replace(' ', '-')}'>{esc(v)}</td><td>{esc(LEGEND[v])}</td></tr>" for v in VERDICTS)
        + "</table>")
    xs = notes(data)
    if xs:
        H.append("<h2>Notes</h2><ol class='notes'>")
        for x in xs:
            first, *rest = _note_lines(x, md=False)
            H.append(f"<li id='note-{x['n']}'>{esc(first.split('] ', 1)[1])}"
                     + "".join(f"<br>{esc(k.strip().split(': ', 1)[0])}: <code>{esc(k.strip().split(': ', 1)[-1])}</code>"
                               for k in rest) + "</li>")
        H.append("</ol>")
    gaps = inexpressible(data)
    if gaps:
        H.append("<h2>Cannot express (not run)</h2><ul>" + "".join(
            f"<li>{esc(rel)} <code>{esc(lay)}</code>: {esc(why)}</li>" for rel, lay, why in gaps) + "</ul>")
    return page(f"kvcheck matrix: {data['engine']}", head, H, css=MATRIX_CSS)


def write_outputs(data: dict[str, Any], out: Path) -> list[Path]:
    """matrix-ENGINE.json, .md and .html in `out` (atomically); their paths."""
    stem = f"matrix-{file_stem(data['engine'])}"
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.html"]
    data["outputs"] = [str(p) for p in paths]
    write_atomic(paths[0], json.dumps(data, indent=1, default=str) + "\n")
    write_atomic(paths[1], render_md(data))
    write_atomic(paths[2], render_html(data))
    return paths
