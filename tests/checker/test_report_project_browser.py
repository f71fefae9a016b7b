"""The project gate's report.html in a real browser: a small project gate (the spec's walk with a
planted fault, the reference engine's diff, one vLLM layout) writes the page, and headless
Chromium loads it with a probe that reports, per system, the plots decoded with a non-zero size
and ink on them (drawn into a canvas), their captions, the one line of what a system has no
numbers for, and every error event on the page. Skipped, with the install line, where Chromium
is absent (test_report_browser.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvcheck.checker import cli

from test_report_browser import CHROMIUM, _chromium

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not found: `apt-get install chromium` (.ci/run does) "
                             "to check the HTML report in a real browser")
pytest.importorskip("matplotlib")

PROJECT = """corpus = "corpus"
seeds = [0]

[systems.spec]
engines = ["walk"]
budgets = { walk = 2000 }
expected_faults = ["eviction_ignores_pins"]
fault_budget = "5s"

[systems.reference]
engines = ["diff"]
budgets = { diff = 4 }

[systems.vllm]
layouts = ["full+swa"]
engines = ["fuzz"]
budget = 400                                  # meets the coverage floor (every action)
"""

# In <head>, before any image: every error event (a script error, an image that fails to load).
ERRORS = """<script>window.kvErrors = [];
window.addEventListener('error', ev => window.kvErrors.push(ev.message ||
  'not loaded: ' + ((ev.target && ev.target.dataset && ev.target.dataset.plot) || (ev.target && ev.target.tagName))), true);
</script>"""
# Before </body>: once everything loaded, what is on screen, per system, into the DOM.
PROBE = """<script>
window.addEventListener('load', () => {
  const vis = el => { const r = el.getBoundingClientRect(), s = getComputedStyle(el);
                      return r.width > 0 && r.height > 0 && s.display !== 'none' && s.visibility !== 'hidden'; };
  const ink = i => { try { const c = document.createElement('canvas'); c.width = i.naturalWidth; c.height = i.naturalHeight;
                           const x = c.getContext('2d'); x.drawImage(i, 0, 0);
                           const d = x.getImageData(0, 0, c.width, c.height).data; let n = 0;
                           for (let k = 0; k < d.length; k += 4) if (d[k] + d[k + 1] + d[k + 2] < 600) n++;
                           return n / (c.width * c.height); } catch (e) { return 'canvas: ' + e; } };
  const all = (q, el) => [...(el || document).querySelectorAll(q)];
  const top = q => document.querySelector(q).getBoundingClientRect().top;
  const out = {
    verdict: document.querySelector('header.verdict h1').textContent,
    order: [top('header.verdict'), top('#findings'), top('#plots')],
    plots_title: document.querySelector('#plots h2').textContent,
    figures: all('#plots figure').length,
    groups: all('#plots .system-plots').map(g => ({
      system: g.dataset.system, title: g.querySelector('h3').textContent, shown: vis(g),
      plots: all('img.plot', g).map(i => ({name: i.dataset.plot, alt: i.alt, w: i.naturalWidth, h: i.naturalHeight,
                                           shown: vis(i), complete: i.complete, ink: i.naturalWidth ? ink(i) : 0})),
      captions: all('figcaption', g).map(c => c.textContent),
      note: g.querySelector('p.no-plot') ? g.querySelector('p.no-plot').textContent : null})),
    control: all('img[data-plot="control:broken"]').map(i => i.naturalWidth),
    errors: window.kvErrors,
  };
  const pre = document.createElement('pre');
  pre.id = 'kvcheck-probe';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def probe(page: Path, tmp: Path) -> dict:
    html = page.read_text()
    assert "<script" not in html                                   # the report itself has no script
    control = '<img class="plot" data-plot="control:broken" alt="" src="data:image/png;base64,iVBORw0KGgoAAAA">'
    copy = tmp / "probe.html"
    copy.write_text(html.replace("<head>", "<head>" + ERRORS, 1).replace("</body>", control + PROBE + "</body>"))
    r = _chromium(tmp, "--virtual-time-budget=5000", "--dump-dom", copy.as_uri())
    m = re.search(r'<pre id="kvcheck-probe">(.*?)</pre>', r.stdout, re.S)
    assert m, f"the probe did not run (chromium exit {r.returncode}): {r.stderr[-500:]}"
    return json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))


def test_project_report_has_the_plots_per_system_in_headless_chromium(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kvcheck.toml").write_text(PROJECT)
    code = cli.main(["gate", "--project", "kvcheck.toml", "--out", "rep"])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    vllm_ran = rep["engines"]["vllm[full+swa] fuzz"]["verdict"] != "skipped"     # vLLM not installed: skipped

    seen = probe(tmp_path / "rep" / "report.html", tmp_path)
    assert seen["verdict"].startswith("kvcheck: holds")
    assert seen["order"] == sorted(seen["order"])                  # verdict, then findings, then plots
    assert seen["plots_title"] == "Plots per system"
    assert seen["control"] == [0]                                   # a broken PNG reads as not loaded ...
    assert seen["errors"] == ["not loaded: control:broken"]         # ... and is the page's only error
    groups = {g["system"]: g for g in seen["groups"]}
    assert list(groups) == ["spec", "reference", "vllm[full+swa]"]
    assert all(g["shown"] and g["title"] == s for s, g in groups.items())
    drawn = [p for g in groups.values() for p in g["plots"]]
    assert len(drawn) == seen["figures"]                            # no figure without its plot
    for p in drawn:                                                 # decoded, on screen, and not blank
        assert p["complete"] and p["shown"] and p["w"] > 200 and p["h"] > 150, p
        assert isinstance(p["ink"], float) and 0.02 < p["ink"] < 0.9, p

    spec, ref, vllm = groups["spec"], groups["reference"], groups["vllm[full+swa]"]
    assert [p["name"] for p in spec["plots"]] == ["hit_rates", "degradations", "detection_times"]
    assert [p["alt"] for p in spec["plots"]] == ["logical vs usable hit rate per engine", "degradations per reason",
                                                 "detection time per fault and engine"]
    assert spec["captions"][0].startswith("Logical hit rate") and "planted fault" in spec["captions"][2]
    assert spec["note"] == "Not plotted for spec: reuse profile (none recorded: vLLM layouts record one)."
    assert [p["name"] for p in ref["plots"]] == ["hit_rates", "degradations"]
    assert "detection time (no expected faults planted)" in ref["note"]
    if vllm_ran:
        assert [p["name"] for p in vllm["plots"]] == ["reuse_profile:full+swa"]
        assert vllm["captions"] == ["Reuse profile of layout full+swa (fuzz): usable hit tokens by "
                                    "divergence position."]
        assert vllm["note"].startswith("Not plotted for vllm[full+swa]: hit rates and degradations (its engines, "
                                       "fuzz, do not measure them")
    else:
        assert vllm["plots"] == [] and vllm["note"].startswith("No plots for vllm[full+swa]: ")

    # the numbers plotted are report.json's
    walk = rep["engines"]["spec walk"]["metrics"]
    assert 0 < walk["usable_hit_rate"] <= walk["logical_hit_rate"] <= 1 and walk["weight"] > 0
    caught = next(c for c in rep["checks"] if c["check"] == "expected_fault:eviction_ignores_pins")
    assert caught["verdict"] == "passed" and 0 < caught["counts"]["seconds_to_detection"] <= caught["seconds"]
