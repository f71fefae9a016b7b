"""The HTML report: one self-contained page that opens with the verdict and the findings.

Owns the page's order and look: the verdict and every engine's one-line result, then each
finding with its trace as a timeline (action, decision, degraded reasons, broken invariants,
what changed and the object states after each step) and the command that replays it, then the
plots, then each engine's section. No script, no external resource: styles inline, pictures as
data URIs or inline SVG.
"""
from __future__ import annotations

from html import escape as e
from pathlib import Path
from typing import Any

from . import report_engines as eng
from . import report_project as proj
from .report_findings import Finding, collect
from .timeline import Row, Timeline

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
main{max-width:1180px;margin:0 auto;padding:0 24px 48px}
header.verdict{padding:22px 24px;color:#fff}
header.verdict h1{margin:0 0 6px;font-size:26px}
header.verdict p{margin:2px 0;opacity:.92;font-size:14px}
header.ok{background:#0a7a2f}header.bad{background:#b00020}header.warn{background:#a66b00}
nav{font-size:13px;margin:10px 0 0}nav a{margin-right:14px;color:#0b57d0}
h2{margin:30px 0 8px;border-bottom:2px solid #ddd;padding-bottom:4px}
h3{margin:18px 0 6px}
table{border-collapse:collapse;margin:.5em 0;background:#fff}
td,th{border:1px solid #d6d6d6;padding:3px 8px;font-size:13px;vertical-align:top;text-align:left}
th{background:#f0f0f0}
code,pre{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
pre{background:#f6f8fa;padding:8px;overflow-x:auto}
.ok,.proved,.holds,.killed{color:#0a7a2f;font-weight:600}
.bad,.violated,.survived{color:#b00020;font-weight:600}
.warn,.unknown,.mis-attributed{color:#a66b00;font-weight:600}
.engines td:first-child{font-weight:600}
article.finding{background:#fff;border:1px solid #e3b3b3;border-left:6px solid #b00020;padding:6px 16px 12px;margin:14px 0}
article.finding h3 .kind{background:#b00020;color:#fff;border-radius:3px;padding:1px 6px;font-size:12px;margin-right:6px}
.replay{background:#1d1d1f;color:#e8e8e8;padding:6px 10px;border-radius:4px;display:inline-block}
table.timeline td{font-size:12px}
table.timeline tr.broken td{background:#fde8ea}
table.timeline tr.refused td{color:#888;font-style:italic}
.chip{display:inline-block;border-radius:3px;padding:0 5px;margin:1px 2px;font-size:11px;white-space:nowrap;border:1px solid #ccc}
.chip.ready{background:#dff3e4;border-color:#8fcf9f}.chip.writing{background:#fff4cc;border-color:#e5c96b}
.chip.evicted{background:#f6d5d8;border-color:#e08a93}.chip.req{background:#e3ecfb;border-color:#9db7e6}
.chip.disk{background:#efe3f7;border-color:#bb9ad6}
.decision{font-weight:600}.reason{color:#a66b00}
td.changes{min-width:250px}.changes{color:#444}.note{color:#666;font-size:13px;font-style:italic}
.plots{display:flex;flex-wrap:wrap;gap:14px;align-items:flex-start}.plots figure{margin:0;background:#fff;border:1px solid #ddd;padding:6px}
.plots figcaption{font-size:12px;color:#555;max-width:560px}
.system-plots{margin:6px 0 14px}
img.plot{display:block;max-width:100%}
.pics{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}
section.engine{background:#fff;border:1px solid #ddd;padding:4px 16px 12px;margin:12px 0}
"""


def _tone(verdict: str, code: Any) -> str:
    """ok / bad / warn: a planted fault that survived is as bad as a violation."""
    v = verdict.lower()
    if code in (10, 11, 12, 13) or v.startswith(("violated", "failed", "fault survived")):
        return "bad"
    if code == 0 and not v.startswith(("undecided", "interrupted", "unknown")):
        return "ok"
    return "warn"


def _verdict(x: dict[str, Any]) -> str:
    if "verdict" in x:
        return str(x["verdict"])
    if "mutation_score" in x:          # mutants.json alone
        return f"mutation score {eng.num(x['mutation_score'], 'mutants.json: mutation_score'):.0%}"
    return ""


def _header(data: dict[str, Any], findings: list[Finding]) -> tuple[str, str]:
    main = data.get("report") or data.get("prove") or data.get("explore") or data.get("mutants") or {}
    verdict, code = _verdict(main), main.get("exit_code")
    tone = _tone(verdict, code)
    if "report" not in data:          # no gate: the worst of what is there
        tones = [_tone(_verdict(x), x.get("exit_code")) for x in data.values()]
        tone = "bad" if "bad" in tones else "warn" if "warn" in tones else "ok"
    rep = data.get("report", {})
    lines = [f"<header class='verdict {tone}' id='verdict'><h1>kvcheck: {e(verdict)}</h1>",
             f"<p>exit code {e(str(code))}"
             + (f" &middot; <code>{e(str(rep['command']))}</code>" if rep.get("command") else "")
             + (f" &middot; seed {e(str(rep.get('seed')))}" if rep.get("seed") is not None else "")
             + (f" &middot; planted fault <b>{e(str(rep['fault']))}</b>" if rep.get("fault") else "") + "</p>"]
    fr = rep.get("fault_result")
    if isinstance(fr, dict) and "expected" in fr:
        lines.append(f"<p>planted fault expected <b>{e(str(fr['expected']))}</b>: "
                     + ("caught" if fr.get("caught") else "NOT caught by it") + "</p>")
    n = len(findings)
    lines.append(f"<p>{n} finding{'s' if n != 1 else ''}"
                 + (f" &middot; kvcheck {e(str(rep['kvcheck']))}" if rep.get("kvcheck") else "") + "</p></header>")
    return "\n".join(lines), tone


def _chips(row: Row) -> str:
    out = [f"<span class='chip {e(st)}' title='{e(name)}: {e(st)}, ref {ref}'>{e(name)} {e(st)}"
           + (f" ref {ref}" if ref else "") + "</span>" for name, st, ref in row.objects]
    out += [f"<span class='chip req' title='request {e(r)}'>{e(r)} {e(st)}</span>" for r, st in row.requests]
    out += [f"<span class='chip disk' title='on-disk copy of {e(b)}'>{e(b)} on_disk {e(st)}</span>"
            for b, st in row.disk]
    return "".join(out) or "<span class='note'>all free, requests idle</span>"


def _decision(row: Row) -> tuple[str, str]:
    d = row.decision
    if d is None:
        return "", ""
    dec = (f"<span class='decision'>{e(str(d['kind']))}</span> k={e(str(d['k']))} "
           f"(logical {e(str(d['logical']))})")
    return dec, " ".join(f"<span class='reason'>{e(r)}</span>" for r in d["reasons"]) or "none"


def render_timeline(t: Timeline) -> str:
    H = []
    if t.note:
        H.append(f"<p class='note'>{e(t.note)}</p>")
    if not t.replayed:
        H.append("<ol class='steps'>" + "".join(f"<li><code>{e(r.action)}</code></li>" for r in t.rows) + "</ol>")
        return "\n".join(H)
    H.append("<table class='timeline'><tr><th>#</th><th>action</th><th>decision</th><th>degraded by</th>"
             "<th>invariants broken</th><th>what changed</th><th>object states after the step</th></tr>")
    for r in t.rows:
        dec, why = _decision(r)
        cls = "broken" if r.violations else "refused" if not r.enabled else ""
        broken = ("<span class='bad'>" + e(", ".join(r.violations)) + "</span>"
                  + "".join(f"<br><small>{e(w)}</small>" for w in r.where[:4])) if r.violations else ""
        act = f"<code>{e(r.action)}</code>" + ("" if r.enabled else "<br><small>not enabled in the spec: "
                                                "refused</small>")
        H.append(f"<tr class='{cls}' data-step='{r.n}'><td>{r.n}</td><td>{act}</td><td>{dec}</td><td>{why}</td>"
                 f"<td>{broken}</td><td class='changes'>{'<br>'.join(e(c) for c in r.changes)}</td>"
                 f"<td>{_chips(r)}</td></tr>")
    H.append("</table>")
    return "\n".join(H)


def _finding(i: int, f: Finding) -> str:
    H = [f"<article class='finding' id='finding-{i}' data-finding='{i}'>"
         f"<h3><span class='kind'>{e(f.kind or 'finding')}</span>{e(f.check)} "
         f"<small>&mdash; {e(f.system)} / {e(f.engine)}</small></h3>"]
    if f.message:
        H.append(f"<p>{e(f.message)}</p>")
    if f.replay:
        H.append(f"<p>replay it: <code class='replay'>{e(f.replay)}</code></p>")
    if f.timeline is not None:
        H.append(render_timeline(f.timeline))
    H.append("</article>")
    return "\n".join(H)


def _figures(plots: list[tuple[str, str]]) -> str:
    return ("<div class='plots'>" + "".join(f"<figure>{img}<figcaption>{e(cap)}</figcaption></figure>"
                                            for img, cap in plots) + "</div>")


def _plots(data: dict[str, Any]) -> str:
    """The plots section: one group per system for a project gate (with a line for what a
    system has no numbers for), else every plot the engines' data supports."""
    if not proj.is_project(data):
        plots = eng.plots(data)
        return f"<section id='plots'><h2>Plots</h2>{_figures(plots)}</section>" if plots else ""
    groups = proj.system_plots(data)
    if not groups:
        return ""
    H = ["<section id='plots'><h2>Plots per system</h2>"]
    for system, figs, note in groups:
        H.append(f"<div class='system-plots' data-system='{e(system)}'><h3>{e(system)}</h3>"
                 + (_figures(figs) if figs else "")
                 + (f"<p class='note no-plot'>{e(note)}</p>" if note else "") + "</div>")
    H.append("</section>")
    return "\n".join(H)


def page(title: str, header: str, body: list[str], links: list[tuple[str, str]] | None = None, css: str = "") -> str:
    """The one page shell every kvcheck HTML page is written in (the gate's report, the
    differential's page): doctype, the inline styles (`css` added to the report's), the verdict
    `header` (already HTML), a nav of (id, title) links, then `body` inside <main>. `title` is
    escaped here; the header and body are the caller's HTML, their data escaped by the caller."""
    nav = "<nav>" + "".join(f"<a href='#{e(sid)}'>{e(t)}</a>" for sid, t in links) + "</nav>" if links else ""
    H = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
         f"<title>{e(title)}</title>", f"<style>{CSS}{css}</style></head><body>", header, "<main>" + nav,
         *body, "</main></body></html>"]
    return "\n".join(H) + "\n"


def render_html(data: dict[str, Any], d: Path) -> str:
    findings = collect(data, d)
    sections = eng.sections(data, d)
    plots = _plots(data)
    links = [("findings", "findings"), ("engines", "engines")] + ([("plots", "plots")] if plots else []) \
        + [(sid, title) for sid, title, _ in sections]
    head, tone = _header(data, findings)
    H = [f"<section id='findings'><h2>Findings ({len(findings)})</h2>"]
    if findings:
        H += [_finding(i, f) for i, f in enumerate(findings)]
    else:
        H.append("<p class='ok'>No findings: every engine that ran held.</p>" if tone == "ok" else
                 "<p class='warn'>No findings, but the verdict above is not a pass.</p>")
    H.append("</section>")
    H.append(eng.summary_table(data))
    if plots:
        H.append(plots)
    for sid, title, body in sections:
        H.append(f"<section class='engine' id='{e(sid)}'><h2>{e(title)}</h2>{body}</section>")
    return page("kvcheck report", head, H, links)
