"""`kvcheck report`: Markdown and one self-contained HTML page from the report directory."""
from __future__ import annotations

import json
import re

from kvcheck.checker import cli
from kvcheck.checker.explore import run_explore
from kvcheck.spec.outputs import write_atomic
from kvcheck.spec.config import Config, LayerSpec

TINY = Config(layers=(LayerSpec("swa", window=1),), blocks=1, requests=1, max_version=0,
              reserve=0, capacity={"swa_window": 1}, max_inflight=1, max_active=1)


def _fill(d):
    code, rep = run_explore(TINY, d, None)
    write_atomic(d / "explore.json", json.dumps(rep))
    _, frep = run_explore(Config(layers=(LayerSpec("csa", window=6, m=12, topk=1),), blocks=3,
                                 requests=1, capacity={"compressed_kv": 1, "tail": 2, "swa_window": 3,
                                                       "indexer": 1}, max_inflight=1, max_active=1),
                          d, "no_revalidation_at_use")
    prove = {"verdict": "violated", "exit_code": 12, "seconds": 1.0,
             "bmc": {"checked": 4, "violation": {"invariants": ["toctou_bound_stable"],
                                                 "steps": frep["violation"]["steps"],
                                                 "replay": frep["violation"]["replay"]}},
             "invariants": [{"name": "admission_cap", "kind": "invariant", "status": "proved",
                             "method": "induction", "bound": 4, "seconds": 0.5, "trace": None},
                            {"name": "toctou_bound_stable", "kind": "invariant", "status": "violated",
                             "method": "bmc", "bound": 5, "seconds": 0.5, "trace": frep["violation"]["trace"]}]}
    write_atomic(d / "prove.json", json.dumps(prove))


def test_html_report_self_contained(tmp_path, capsys):
    _fill(tmp_path)
    assert cli.main(["report", "--in", str(tmp_path), "--html", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    page = (tmp_path / "report.html").read_text()
    assert out["html"].endswith("report.html")
    # self-contained: no external resources of any kind
    assert not re.search(r'(src|href)\s*=\s*["\'](?!data:|#)', page)
    assert "<link" not in page and "<script" not in page
    assert "<svg" in page or "data:image/png;base64," in page       # state diagrams inlined
    assert "toctou_bound_stable" in page and "kvcheck replay" in page
    assert "admission_cap" in page and "proved" in page
    md = (tmp_path / "summary.md").read_text()
    assert "## Invariants" in md and "## Counterexamples" in md and "## Coverage (explore)" in md


def test_report_bad_dir(tmp_path, capsys):
    assert cli.main(["report", "--in", str(tmp_path / "missing")]) == 2
    assert cli.main(["report", "--in", str(tmp_path)]) == 2       # empty: nothing to report
    err = capsys.readouterr().err
    assert "Traceback" not in err
