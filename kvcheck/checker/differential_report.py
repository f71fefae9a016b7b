"""The cross-release differential's outputs: differential-ENGINE.json, .md and .html in --out,
and text.

Per layout a release x release table: each release's reuse ratio (tokens hit / prompt tokens over
every lookup) and lookups, and in the cell of row A, column B the number of lookups where A hit
less than B on the same step of the same workload; then the shrunk differences, each with the
command that replays it and its two-release reproducer, and every lookup that broke a check.
The HTML page is the gate report's shell (report_html.page) and tables (report_engines.table):
every text taken from the data (release names, layouts, commands) is escaped there or here.
"""
from __future__ import annotations

import json
from html import escape as e
from pathlib import Path
from typing import Any

from ..spec.outputs import file_stem, write_atomic
from .differential import Side

VERDICTS = {0: "every release reuses the same", 3: "undecided: a release could not replay, or nothing was compared",
            10: "a lookup broke a check", 13: "reuse differs between releases"}


def side_row(s: Side) -> dict[str, Any]:
    return {"release": s.label, "python": s.python, "status": s.status, "why": s.why, "ratio": s.ratio(),
            "lookups": len(s.records), "prompt_tokens": sum(int(r.get("prompt_tokens") or 0) for r in s.records),
            "hit_tokens": sum(r["hit"] for r in s.records)}


def layout_data(sides: list[Side], cmp: dict[str, Any], workloads: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"sides": [side_row(s) for s in sides],
            "less": {a: {b: len(keys) for b, keys in row.items()} for a, row in cmp["less"].items()},
            "first_less": {a: {b: list(keys[0]) for b, keys in row.items() if keys} for a, row in cmp["less"].items()},
            "classes": cmp["classes"], "unsound": cmp["unsound"],
            "workloads": [w["name"] for w in workloads or []]}


def _cell(v: Any) -> str:
    return "-" if v is None else str(v)


def render_md(data: dict[str, Any]) -> str:
    out = [f"# kvcheck matrix --differential: {data['engine']}", "",
           f"- command: `{data['command']}`", f"- date: {data['date']}", f"- seed: {data['seed']}, "
           f"workloads per layout: {data['workloads']}", f"- exit code: {data['exit_code']}", "",
           "Cell (row A, column B): lookups where A hit fewer tokens than B on the same step of the same "
           "workload (reuse available elsewhere). Reuse ratio: tokens hit / prompt tokens over every lookup.", ""]
    for lay, d in data["layouts"].items():
        ran = [s for s in d["sides"] if s["status"] == "ran"]
        out += [f"## {lay}", "", "| release | reuse ratio | lookups | " + " | ".join(s["release"] for s in ran) + " |",
                "|---|---|---|" + "---|" * len(ran)]
        for a in ran:
            cells = ["" if a is b else str(d["less"][a["release"]][b["release"]]) for b in ran]
            out.append(f"| {a['release']} | {_cell(a['ratio'])} | {a['lookups']} | " + " | ".join(cells) + " |")
        for s in d["sides"]:
            if s["status"] != "ran":
                out.append(f"\n{s['release']}: {s['status']}: {s['why']}")
        broke: dict[str, int] = {}
        for u in d["unsound"]:
            k = f"{u['release']} breaks {u['check']}" + (f" (known defect {u['known']})" if u.get("known") else "")
            broke[k] = broke.get(k, 0) + 1
        if broke:
            out += ["", "Lookups that broke a check: " + "; ".join(f"{k}: {n}" for k, n in broke.items())]
        groups = [" = ".join(c) for c in d["classes"]]
        out += ["", "Releases with identical hits on every lookup: " + ("; ".join(f"{{{g}}}" for g in groups) or "none"), ""]
    out += ["## Differences (shrunk)", ""]
    for x in data["differences"] or []:
        out += [f"- **{x['layout']}**: {_what(x)}; workload {x['origin']} step {x['step']} "
                f"(hit {x['hit_less']} vs {x['hit_more']}); shrunk to {len(x['trace']['steps'])} steps",
                f"  - reproducer: `{x['reproduce']}`", f"  - replay: `{x['replay']}`"]
    if not data["differences"]:
        out.append("None: every release that ran hit the same on every lookup, and no lookup broke a check.")
    return "\n".join(out) + "\n"


def _what(x: dict[str, Any]) -> str:
    if x.get("check"):
        known = f", known defect {x['known']}" if x.get("known") else ""
        return f"{x['less']} breaks {x['check']} ({x.get('kind') or 'a check'}{known})"

    def named(k: str) -> str:
        same = [r for r in x.get(f"{k}_class") or [] if r != x[k]]
        return x[k] + (f" (and {', '.join(same)}: the same hits)" if same else "")
    return (f"{named('less')} reuses less than {named('more')} on {x.get('lookups', '?')} lookups "
            "(reuse available elsewhere)")


def render_text(data: dict[str, Any]) -> str:
    lines = [f"kvcheck matrix --differential --sut {data['engine']}: seed {data['seed']}, "
             f"{data['workloads']} workloads per layout"]
    for lay, d in data["layouts"].items():
        parts = [f"{s['release']} {s['ratio']}" if s["status"] == "ran" else f"{s['release']} {s['status']}"
                 for s in d["sides"]]
        n = sum(v for row in d["less"].values() for v in row.values())
        lines.append(f"  {lay}: reuse ratio " + ", ".join(parts) + f"; {n} lookup pairs differ")
    for x in data["differences"] or []:
        lines += [f"  difference: {x['layout']}: {_what(x)}, shrunk to {len(x['trace']['steps'])} steps",
                  f"    reproducer: {x['reproduce']}", f"    replay: {x['replay']}"]
    names = [Path(p).name for p in data.get("outputs") or []]
    lines.append(f"exit {data['exit_code']}; outputs in {data['out']}" + (f": {', '.join(names)}" if names else ""))
    return "\n".join(lines)


def render_html(data: dict[str, Any]) -> str:
    """One self-contained page: the verdict, per layout the release x release table, then every
    shrunk difference with its steps, both releases' hits on each lookup and its commands."""
    from .report_engines import table
    from .report_html import page
    code = data["exit_code"]
    tone = "ok" if code == 0 else "bad" if code in (10, 13) else "warn"
    head = (f"<header class='verdict {tone}' id='verdict'><h1>kvcheck matrix --differential: {e(str(data['engine']))}"
            f": {e(VERDICTS.get(code, f'exit {code}'))}</h1><p>exit code {e(str(code))} &middot; seed "
            f"{e(str(data['seed']))} &middot; {e(str(data['workloads']))} workloads per layout &middot; "
            f"{e(str(data['date']))}</p><p><code>{e(str(data['command']))}</code></p></header>")
    H = ["<section id='layouts'><h2>Releases &times; releases, per layout</h2><p class='note'>Cell (row A, "
         "column B): lookups where A hit fewer tokens than B on the same step of the same workload (reuse "
         "available elsewhere). Reuse ratio: tokens hit / prompt tokens over every lookup.</p>"]
    for lay, d in data["layouts"].items():
        H.append(f"<h3 id='layout-{e(file_stem(lay))}'>{e(lay)}</h3>" + _layout_html(d, table))
    H.append("</section>")
    diffs = data["differences"] or []
    H.append(f"<section id='differences'><h2>Differences, shrunk ({len(diffs)})</h2>")
    H += [_difference_html(i, x, table) for i, x in enumerate(diffs)]
    if not diffs:
        H.append("<p class='ok'>None: every release that ran hit the same on every lookup, and no lookup broke "
                 "a check.</p>")
    H.append("</section>")
    return page(f"kvcheck matrix --differential: {data['engine']}", head, H,
                [("layouts", "layouts"), ("differences", "differences")])


def _layout_html(d: dict[str, Any], table: Any) -> str:
    ran = [s for s in d["sides"] if s["status"] == "ran"]
    rows = [[a["release"], _cell(a["ratio"]), a["lookups"], a["prompt_tokens"], a["hit_tokens"]]
            + ["" if a is b else d["less"][a["release"]][b["release"]] for b in ran] for a in ran]
    H = [table(["release", "reuse ratio", "lookups", "prompt tokens", "tokens hit"] + [b["release"] for b in ran],
               rows, "differential")]
    H += [f"<p>{e(s['release'])}: <b>{e(s['status'])}</b>: {e(str(s['why']))}</p>"
          for s in d["sides"] if s["status"] != "ran"]
    broke: dict[str, int] = {}
    for u in d["unsound"]:
        k = f"{u['release']} breaks {u['check']}" + (f" (known defect {u['known']})" if u.get("known") else "")
        broke[k] = broke.get(k, 0) + 1
    if broke:
        H.append("<p class='bad'>Lookups that broke a check: " + e("; ".join(f"{k}: {n}" for k, n in broke.items()))
                 + "</p>")
    groups = "; ".join("{" + " = ".join(c) + "}" for c in d["classes"]) or "none"
    H.append(f"<p>Releases with identical hits on every lookup: {e(groups)}</p>")
    return "\n".join(H)


def _difference_html(i: int, x: dict[str, Any], table: Any) -> str:
    """One difference: what, where it came from, the shrunk steps with each release's hit on every
    lookup (as the reproducer prints them), and the commands."""
    steps = x["trace"]["steps"]
    hits = x.get("shrunk_hits") or {}
    who = list(dict.fromkeys([x["less"], x["more"]]))
    by = {rel: {r["step"]: r for r in hits.get(rel) or []} for rel in who}
    rows = []
    for n, st in enumerate(steps):
        row = [n, st["op"], st["r"]]
        if st["op"] == "send":
            row += [_tokens(st["tokens"]), st.get("chunk") if st.get("chunk") is not None else "at once",
                    _tokens(st.get("output") or [])]
        else:
            row += ["", "", ""]
        for rel in who:
            r = by[rel].get(n)
            row.append("" if r is None else f"{r['hit']}" + (f" (usable {r['usable']})" if r.get("usable") is not None
                                                             else ""))
        rows.append(row)
    H = [f"<article class='finding' id='difference-{i}'><h3><span class='kind'>"
         f"{e('broken check' if x.get('check') else 'reuse available elsewhere')}</span>{e(str(x['layout']))}</h3>",
         f"<p>{e(_what(x))}.</p>",
         f"<p>Unshrunk: workload <code>{e(str(x['origin']))}</code> step {e(str(x['step']))}: hit "
         f"{e(str(x.get('hit_less')))} on {e(str(x['less']))}, {e(str(x.get('hit_more')))} on {e(str(x['more']))}. "
         f"Shrunk to {len(steps)} steps (<code>{e(str(x['trace']['name']))}</code>)"
         + (f"; the shrink stopped: {e(str(x['shrink_error']))}" if x.get("shrink_error") else "") + ".</p>",
         table(["#", "op", "request", "prompt tokens", "chunk", "output"] + [f"hit on {r}" for r in who], rows,
               "steps")]
    if not hits:
        H.append("<p class='note'>No per-lookup hits on the shrunk workload (its shrink did not finish): run the "
                 "reproducer.</p>")
    H += [f"<p>reproducer: <code class='replay'>{e(str(x['reproduce']))}</code></p>",
          f"<p>replay: <code class='replay'>{e(str(x['replay']))}</code></p></article>"]
    return "\n".join(H)


def _tokens(toks: list[int], most: int = 48) -> str:
    shown = " ".join(map(str, toks[:most])) + (" …" if len(toks) > most else "")
    return f"{len(toks)}: {shown}" if toks else "none"


def write_outputs(data: dict[str, Any], out: Path) -> list[Path]:
    """differential-ENGINE.json, .md and .html in `out` (atomically); their paths (also in
    data["outputs"], which the console line names)."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"differential-{file_stem(data['engine'])}"
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.html"]
    data["outputs"] = [str(p) for p in paths]
    write_atomic(paths[0], json.dumps(data, indent=1, default=str))
    write_atomic(paths[1], render_md(data))
    write_atomic(paths[2], render_html(data))
    return paths
