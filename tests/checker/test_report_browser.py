"""The HTML report in a real browser: headless Chromium loads the page and a probe reports what
is on screen (findings, timeline rows, plots decoded with a non-zero size); a screenshot of the
page is not blank and opens with the verdict. Skipped, with the install line, where Chromium
is absent. KVCHECK_UPDATE_SCREENSHOT=1 also rewrites docs/report-screenshot.png.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvcheck.checker import cli

from reportdirs import with_reference_finding

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not found: `apt-get install chromium` (.ci/run does) "
                             "to check the HTML report in a real browser")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "report-screenshot.png"

# Added to a copy of the page only (the report itself has no script): once everything loaded,
# write what is visible into the DOM for --dump-dom to carry out.
PROBE = """<script>
window.addEventListener('load', () => {
  const vis = el => { const r = el.getBoundingClientRect(), s = getComputedStyle(el);
                      return r.width > 0 && r.height > 0 && s.display !== 'none' && s.visibility !== 'hidden'; };
  const all = q => [...document.querySelectorAll(q)];
  const top = q => document.querySelector(q).getBoundingClientRect().top;
  const out = {
    verdict: document.querySelector('header.verdict h1').textContent,
    order: [top('header.verdict'), top('#findings'), top('#plots')],
    findings: all('article.finding').filter(vis).map(a => a.querySelector('h3').textContent),
    timeline_rows: all('table.timeline tr[data-step]').filter(vis).length,
    broken_rows: all('table.timeline tr.broken').filter(vis).length,
    replay: all('code.replay').filter(vis).map(c => c.textContent),
    plots: all('img.plot').map(i => ({name: i.dataset.plot, w: i.naturalWidth, h: i.naturalHeight,
                                      shown: vis(i), complete: i.complete})),
    diagrams: all('svg').filter(vis).length,
  };
  const pre = document.createElement('pre');
  pre.id = 'kvcheck-probe';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def _chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'profile'}",
                           *args], capture_output=True, text=True, timeout=60)


def test_report_renders_in_headless_chromium(capsys, tmp_path):
    d = with_reference_finding(tmp_path / "r")
    assert cli.main(["report", "--in", str(d), "--html"]) == 0
    capsys.readouterr()
    page = (d / "report.html").read_text()
    probe = tmp_path / "probe.html"
    # the control: a plot whose PNG is broken must read as not loaded, or the probe proves nothing
    control = '<img class="plot" data-plot="control:broken" alt="" src="data:image/png;base64,iVBORw0KGgoAAAA">'
    probe.write_text(page.replace("</body>", control + PROBE + "</body>"))
    r = _chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri())
    m = re.search(r'<pre id="kvcheck-probe">(.*?)</pre>', r.stdout, re.S)
    assert m, f"the probe did not run (chromium exit {r.returncode}): {r.stderr[-500:]}"
    seen = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    assert seen["verdict"].startswith("kvcheck: failed")
    assert seen["order"] == sorted(seen["order"])                  # verdict, then findings, then plots
    assert len(seen["findings"]) == 1 and "refcount_equals_holders" in seen["findings"][0]
    assert seen["timeline_rows"] == 6 and seen["broken_rows"] == 0   # a reference bug: the spec's steps hold
    assert seen["replay"] and "--sut reference" in seen["replay"][0]
    plots = {p["name"]: p for p in seen["plots"]}
    assert plots.pop("control:broken")["w"] == 0
    assert set(plots) == {"hit_rates", "degradations", "detection_times"}
    assert all(p["complete"] and p["shown"] and p["w"] > 100 and p["h"] > 100 for p in plots.values()), plots
    assert seen["diagrams"] == 4

    shot = tmp_path / "shot.png"
    r = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,2000", (d / "report.html").as_uri())
    assert shot.is_file(), r.stderr[-500:]
    import matplotlib.image as mpimg
    px = mpimg.imread(io.BytesIO(shot.read_bytes()), format="png")
    assert px.shape[:2] == (2000, 1280)
    assert float(px[..., :3].std()) > 0.05                          # not blank
    head = px[20, 20, :3]
    assert head[0] > 0.5 and head[1] < 0.2 and head[2] < 0.25      # the red verdict bar at the top


@pytest.mark.skipif(os.environ.get("KVCHECK_UPDATE_SCREENSHOT") != "1",
                    reason="writes docs/report-screenshot.png: run with KVCHECK_UPDATE_SCREENSHOT=1")
def test_update_the_docs_screenshot(capsys, tmp_path, monkeypatch):
    """The page of a report directory where the engines wrote it (`kvcheck-report/`)."""
    monkeypatch.chdir(tmp_path)
    d = with_reference_finding(Path("kvcheck-report"), home=True)
    assert cli.main(["report", "--in", str(d), "--html"]) == 0
    _chromium(tmp_path, f"--screenshot={DOCS}", "--window-size=1280,2000", (tmp_path / d / "report.html").as_uri())
