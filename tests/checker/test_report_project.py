"""The project gate's plots, per system, from a report.json of the shape gate_project writes:
hit rates merged over seeds by weight; each planted fault's detection time (killed or
mis-attributed, a survivor named in the line instead); a system with no numbers gets one line
and no empty plot; the corpus replay is no system."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcheck.checker.gate_project import merge_metrics, render_project_md
from kvcheck.checker.report_html import render_html
from kvcheck.checker.report_project import system_plots

pytest.importorskip("matplotlib")


def test_hit_rates_merge_over_seeds_by_weight() -> None:
    m: dict = {}
    merge_metrics(m, {"logical_hit_rate": 0.5, "usable_hit_rate": 0.25, "degradations": {"tail_missing": 2},
                      "weight": 100})
    merge_metrics(m, {"logical_hit_rate": 1.0, "usable_hit_rate": 0.75,
                      "degradations": {"tail_missing": 1, "abi_mismatch": 4}, "weight": 300})
    assert m == {"logical_hit_rate": 0.875, "usable_hit_rate": 0.625, "weight": 400,
                 "degradations": {"tail_missing": 3, "abi_mismatch": 4}}


def _check(system: str, engine: str, name: str, verdict: str, counts: dict) -> dict:
    return {"system": system, "engine": engine, "check": name, "verdict": verdict, "seconds": 9.0,
            "counts": counts, "finding": None, "note": None}


def report() -> dict:
    metrics = {"logical_hit_rate": 0.6, "usable_hit_rate": 0.2, "degradations": {"tail_missing": 3}, "weight": 50}
    engines = {
        "corpus replay-corpus": {"system": "corpus", "engine": "replay-corpus", "runs": 1, "seconds": 0.1, "counts": {},
                                 "exit_code": 0, "checks": {"fixed": 1}, "verdict": "holds"},
        "spec walk": {"system": "spec", "engine": "walk", "runs": 1, "seconds": 1.0, "counts": {"steps": 10},
                      "exit_code": 0, "checks": {"passed": 3}, "verdict": "holds", "metrics": metrics},
        "toy:Toy fuzz": {"system": "toy:Toy", "engine": "fuzz", "runs": 1, "seconds": 1.0, "counts": {"steps": 5},
                         "exit_code": 0, "checks": {"passed": 2}, "verdict": "holds"}}
    checks = [_check("spec", "walk", "expected_fault:eviction_ignores_pins", "passed",
                     {"expected": "toctou_bound_stable", "caught_by": ["toctou_bound_stable"],
                      "seconds_to_detection": 0.4}),
              _check("spec", "walk", "expected_fault:window_off_by_one", "failed",
                     {"expected": "window_bounds", "caught_by": ["refcount_equals_holders"]}),
              _check("toy:Toy", "fuzz", "expected_fault:noop", "failed", {"expected": "x", "caught_by": []})]
    return {"kvcheck": "0", "command": "kvcheck gate --project p", "project": "p", "corpus": "c", "seed": None,
            "fault": None, "systems": ["spec", "toy:Toy"], "engines": engines, "checks": checks, "findings": [],
            "corpus_saved": [], "corpus_replayed": 1, "verdict": "holds", "exit_code": 0}


def test_plots_per_system_and_one_line_where_there_are_none(tmp_path: Path) -> None:
    groups = {s: (figs, note) for s, figs, note in system_plots({"report": report()})}
    assert list(groups) == ["spec", "toy:Toy"]                         # the corpus is no system
    figs, note = groups["spec"]
    names = [img.split('data-plot="')[1].split('"')[0] for img, _ in figs]
    assert names == ["hit_rates", "degradations", "detection_times"]
    assert note == "Not plotted for spec: reuse profile (none recorded: vLLM layouts record one)."
    figs, note = groups["toy:Toy"]
    assert figs == []
    assert note.startswith("No plots for toy:Toy: hit rates and degradations (its engines, fuzz, do not measure")
    assert "detection time (no planted fault was caught: noop)" in note
    page = render_html({"report": report()}, tmp_path)
    assert page.count("class='system-plots'") == 2 and page.count("class='note no-plot'") == 2
    assert page.count('data-plot="') == 3 and "seed None" not in page
    md = render_project_md(report())
    assert "| spec | walk | 0.6 | 0.2 | tail_missing 3 |" in md


def test_detection_rows_say_killed_or_mis_attributed(monkeypatch) -> None:
    from kvcheck.checker import report_engines
    seen = []
    monkeypatch.setattr(report_engines.pl, "detection_times", lambda rows: seen.extend(rows) or "<img>")
    system_plots({"report": report()})
    assert seen == [("eviction_ignores_pins", "walk", 0.4, "killed"),
                    ("window_off_by_one", "walk", 9.0, "mis-attributed")]      # no detection time: the check's
