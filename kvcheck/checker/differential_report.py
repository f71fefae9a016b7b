"""The cross-release differential's outputs: differential-ENGINE.json and .md in --out, and text.

Per layout a release x release table: each release's reuse ratio (tokens hit / prompt tokens over
every lookup) and lookups, and in the cell of row A, column B the number of lookups where A hit
less than B on the same step of the same workload; then the shrunk differences, each with the
command that replays it and its two-release reproducer, and every lookup that broke a check.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .differential import Side


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
    lines.append(f"exit {data['exit_code']}; outputs in {data['out']}")
    return "\n".join(lines)


def write_outputs(data: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"differential-{data['engine']}"
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1, default=str))
    (out / f"{stem}.md").write_text(render_md(data))
