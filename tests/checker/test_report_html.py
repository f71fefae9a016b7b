"""The HTML report: verdict and findings first, timelines replayed on the spec, engine sections
and plots, from real gate output (fixtures: see reportdirs.py)."""
from __future__ import annotations

import base64
import io
import json
import re
import shlex

import pytest

from kvcheck.checker import cli
from kvcheck.checker.timeline import build, parse_label
from kvcheck.spec.trace import Trace

from reportdirs import FIX, copy, with_reference_finding


def _render(capsys, d):
    code = cli.main(["report", "--in", str(d), "--html", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return (d / "report.html").read_text()


def _articles(page):
    return re.findall(r"<article class='finding'.*?</article>", page, re.S)


def test_page_opens_with_the_verdict_then_the_findings(capsys, tmp_path):
    page = _render(capsys, copy("fault", tmp_path / "r"))
    body = page[page.index("<body>"):]
    assert body.index("kvcheck: violated") < body.index("id='findings'") < body.index("id='engines'") \
        < body.index("id='plots'") < body.index("id='engine-walk'")
    arts = _articles(page)
    assert len(arts) == 2                       # the walk's and explore's shortest counterexample
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    walk = arts[0]
    assert "spec / walk" in walk and "five_state_routing" in walk
    # the directory moved: the trace is found next to the report, and the command shown replays it
    cmd = re.search(r"<code class='replay'>(.*?)</code>", walk).group(1)
    assert cmd == f"kvcheck replay {tmp_path / 'r' / 'counterexample-shared_free_list-seed0.json'}"
    assert "trace found next to the report" in walk and rep["violation"]["trace"] in walk
    assert cli.main(shlex.split(cmd)[1:]) == 10            # it reproduces the violation (exit 10)
    capsys.readouterr()
    rows = re.findall(r"<tr class='(\w*)' data-step='(\d+)'>(.*?)</tr>", walk, re.S)
    assert [int(n) for _, n, _ in rows] == list(range(len(rep["violation"]["trace_steps"])))
    assert [cls for cls, _, _ in rows] == [""] * (len(rows) - 1) + ["broken"]   # only the last step breaks it
    lookup = next(r for _, _, r in rows if "lookup(r=0)" in r)
    assert "RECOMPUTE" in lookup                                                 # the decision, from the spec
    assert "g1 tail b0 ready" in rows[-1][2] and "pool 0 \u2192 1" in rows[-1][2]  # states and what changed


def test_timeline_is_the_spec_replayed_not_stored(tmp_path):
    """The same steps on the clean spec break nothing: the broken invariant comes from replaying
    with the planted fault, and the decisions and states from the spec, not from the report."""
    tr = Trace.load(FIX / "fault" / "counterexample-shared_free_list-seed0.json")
    faulty = build(tr)
    assert faulty.rows[-1].violations == ["five_state_routing"]
    tr.fault = None
    clean = build(tr)
    assert [r.violations for r in clean.rows] == [[]] * len(tr.steps)
    # shared_free_list draws every group's page from one pool: the clean spec gives them their own
    pools = lambda t: {c for c in t.rows[-1].changes if "swa_window" in c}
    assert pools(faulty) != pools(clean)
    assert parse_label("append(r=0, j=1)") == ("append", {"r": 0, "j": 1}) and parse_label("bump_abi") == ("bump_abi", {})


def test_a_reference_finding_shows_the_spec_states_and_its_replay(capsys, tmp_path):
    d = with_reference_finding(tmp_path / "r")
    page = _render(capsys, d)
    arts = _articles(page)
    assert len(arts) == 1 and "reference / fuzz" in arts[0] and "refcount_equals_holders" in arts[0]
    assert "--sut reference" in arts[0]
    assert "fault engine_refcount_double_decrement is planted in reference, not in the spec" in arts[0]
    assert len(re.findall(r"data-step=", arts[0])) == 6
    assert "kvcheck: failed (fuzz --sut reference: exit 10)" in page


def test_the_gates_findings_list_is_rendered_when_present(capsys, tmp_path):
    d = copy("fault", tmp_path / "r")
    rep = json.loads((d / "report.json").read_text())
    rep["findings"] = [{"system": "toy", "engine": "walk", "kind": "invariant", "check": "five_state_routing",
                        "message": "from the gate's own list", "replay": rep["violation"]["replay"],
                        "trace_steps": rep["violation"]["trace_steps"]}]
    (d / "report.json").write_text(json.dumps(rep))
    arts = _articles(_render(capsys, d))
    assert len(arts) == 1 and "toy / walk" in arts[0] and "from the gate&#x27;s own list" in arts[0]
    assert "class='broken'" in arts[0]


def test_a_lost_trace_is_replayed_from_its_labels(capsys, tmp_path):
    d = copy("fault", tmp_path / "r")
    (d / "counterexample-shared_free_list-seed0.json").unlink()
    art = _articles(_render(capsys, d))[0]
    assert "not found: replayed from the recorded step labels" in art
    assert "class='broken'" in art and "five_state_routing" in art


def _pngs(page):
    return {m.group(1): base64.b64decode(m.group(2)) for m in
            re.finditer(r'data-plot="([^"]+)"[^>]*src="data:image/png;base64,([^"]+)"', page)}


def _not_blank(png: bytes) -> bool:
    import matplotlib.image as mpimg
    px = mpimg.imread(io.BytesIO(png), format="png")
    return px.shape[0] > 50 and px.shape[1] > 50 and float(px[..., :3].std()) > 0.01


def test_plots_are_embedded_pngs_of_the_report_numbers(capsys, tmp_path):
    d = with_reference_finding(tmp_path / "r")
    page = _render(capsys, d)
    pngs = _pngs(page)
    assert set(pngs) == {"hit_rates", "degradations", "detection_times"}
    assert all(p.startswith(b"\x89PNG") and _not_blank(p) for p in pngs.values())
    # the mutants matrix and the planted faults it scored
    for fault in json.loads((FIX / "mutants.json").read_text())["faults"]:
        assert fault["fault"] in page
    # without the metrics there is nothing to plot: the plots come from the data
    rep = json.loads((d / "report.json").read_text())
    for k in ("walk", "diff_reference"):
        rep["engines"].pop(k)
    (d / "report.json").write_text(json.dumps(rep))
    (d / "mutants.json").unlink()
    assert _pngs(_render(capsys, d)) == {}


def test_reuse_profile_is_plotted_per_layout_when_present(capsys, tmp_path):
    d = copy("clean", tmp_path / "r")
    rep = json.loads((d / "report.json").read_text())
    prof = {"full+swa": [[0, 0], [16, 16], [32, 16], [48, 48]], "hybrid-csa": [[0, 0], [16, 0], [64, 32]]}
    rep["engines"]["vllm"] = {"exit_code": 0, "reuse_profile": prof}
    (d / "report.json").write_text(json.dumps(rep))
    pngs = _pngs(_render(capsys, d))
    assert {"reuse_profile:full+swa", "reuse_profile:hybrid-csa"} <= set(pngs)
    rep["engines"]["vllm"]["reuse_profile"] = {"full+swa": [[0, 1, 2]]}
    (d / "report.json").write_text(json.dumps(rep))
    assert cli.main(["report", "--in", str(d), "--html"]) == 2
    err = capsys.readouterr().err.strip()
    assert "engines.vllm.reuse_profile.full+swa" in err and "\n" not in err


def test_page_is_self_contained(capsys, tmp_path):
    page = _render(capsys, with_reference_finding(tmp_path / "r"))
    assert not re.search(r'(src|href)\s*=\s*["\'](?!data:|#)', page)
    assert "<link" not in page and "<script" not in page and "@import" not in page
    assert page.count("<svg") == 4                          # explore's four state diagrams, inlined


@pytest.mark.parametrize("name,content", [
    ("counterexample-shared_free_list-seed0.json", b"{not json"),
    ("counterexample-shared_free_list-seed0.json", b'{"format": "kvcheck-trace/1", "steps": 3}'),
    ("mutants.json", b"[1, 2]"),
    ("mutants.json", b'{"faults": [], "exit_code": "zero"}'),
])
def test_a_bad_file_it_reads_is_one_line_exit_2(capsys, tmp_path, name, content):
    d = copy("fault", tmp_path / "r")
    (d / name).write_bytes(content)
    assert cli.main(["report", "--in", str(d), "--html"]) == 2
    err = capsys.readouterr().err.strip()
    assert name in err and "\n" not in err and "Traceback" not in err
    assert not (d / "report.html").exists()
