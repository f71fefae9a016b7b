"""`kvcheck matrix --sut transformers`: a column is a model type, a cell is `kvcheck diff` with N
scenarios; each of diff's outcomes becomes the matrix's verdict (fabricated driver lines), a
time budget is refused in one line, and one real row on the transformers installed here."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvcheck.checker import matrix as mx
from kvcheck.checker.matrix_report import matrix_data, render_md, render_text
from kvcheck.fuzz import registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from badinput import assert_bad_input, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENGINE = registry.get("transformers")


def cell(code, result=None, layout="mistral") -> dict:
    return {"type": "cell", "layout": layout, "code": code, "result": result, "traceback": None,
            "stderr": "", "elapsed_s": 1.0}


DIVERGENT = {"kind": "differential", "check": "reuse_equals_recompute", "layout": "qwen3_next",
             "message": "reuse differs from the full recompute by 0.103 (tolerance 1.12e-06), first at layer 0",
             "replay": "kvcheck diff --sut transformers --model-type qwen3_next --scenarios 4 --seed 0"}


@pytest.mark.parametrize("c, verdict, needle", [
    (cell(0, {"exit_code": 0, "scenarios_run": 8, "max_abs_diff": 2.4e-7}), "clean", "8 scenarios"),
    (cell(11, {"exit_code": 11, "findings": [DIVERGENT]}, "qwen3_next"), "finding", "reuse_equals_recompute"),
    (cell(2, {"exit_code": 2, "cannot_express": "transformers 5.0.0: cannot build a tiny jamba causal LM"}, "jamba"),
     "cannot express", "cannot build a tiny jamba"),
    (cell(3, {"exit_code": 3, "cannot_drive": {"line": "kvcheck cannot drive transformers 5.16.0: forward "
                                                        "declares no cache parameter", "where": "x.py:1"}}),
     "cannot drive", "declares no cache parameter"),
])
def test_each_diff_outcome_is_a_matrix_verdict(c, verdict, needle) -> None:
    got = mx.classify(c, rerun="RERUN")
    assert got["verdict"] == verdict and needle in got["line"], got


def test_a_cell_is_kvcheck_diff_with_the_budget_as_scenarios(tmp_path) -> None:
    plan = mx.Plan(engine="transformers", budget="6", seed=3, out=tmp_path, columns=["mistral"], layouts=None,
                   cell_args=ENGINE.matrix_cell(mx.COLUMN, "6", 3))
    assert mx.cell_argv(plan, "gemma3_text") == ["diff", "--sut", "transformers", "--model-type", "gemma3_text",
                                                 "--scenarios", "6", "--seed", "3"]
    assert "-m kvcheck diff --sut transformers --model-type gemma3_text --scenarios 6" in \
        mx.rerun_command("/py", plan, "gemma3_text", "/o")
    assert ENGINE.check_matrix_budget("8") is None
    for bad in ("30s", "0", "abc", "1001", ""):
        with pytest.raises(ValueError, match="number of kvcheck diff scenarios"):
            ENGINE.check_matrix_budget(bad)


def test_a_time_budget_or_an_unknown_model_type_is_one_line_exit_2(capsys, tmp_path) -> None:
    code, _, err = run(capsys, "matrix", "--sut", "transformers", "--python", sys.executable, "--budget-per-cell",
                       "30s", "--out", str(tmp_path / "o"))
    assert_bad_input(code, err, "number of kvcheck diff scenarios")
    if importlib.util.find_spec("transformers") is not None:
        code, _, err = run(capsys, "matrix", "--sut", "transformers", "--python", sys.executable, "--layouts",
                           "mistral,nosuch", "--out", str(tmp_path / "o"))
        assert_bad_input(code, err, "unknown transformers model type 'nosuch'")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_a_real_row_on_the_installed_transformers(capsys, tmp_path) -> None:
    out = tmp_path / "m"
    py = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
    code, stdout, err = run(capsys, "matrix", "--sut", "transformers", "--python", py, "--layouts",
                            "mistral,gemma3_text", "--budget-per-cell", "2", "--out", str(out), "--json")
    data = json.loads(stdout)
    (row,) = data["rows"]
    assert data["column"] == "model type" and data["budget_per_cell"] == "2"
    for c in row["cells"].values():
        assert c["verdict"] == "clean", (c, err)
        assert "scenarios" in c["line"] and f"diff --sut transformers --model-type {c['layout']}" in c["rerun"]
    assert code == 0
    text = render_text(matrix_data("transformers", data["rows"], data["layouts"], command=data["command"],
                                   seed=0, budget="2", code=code, meta={"column": "model type",
                                                                        "cell_args": data["cell_args"]}))
    assert "model type(s)" in text and "--model-type MODEL_TYPE" in text
    assert "| release | `mistral` | `gemma3_text` |" in render_md(data)
