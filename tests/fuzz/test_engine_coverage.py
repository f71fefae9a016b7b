"""`kvcheck fuzz --cover` (kvcheck/fuzz/engine_coverage.py): line and branch coverage of the
engine's own cache code over a campaign, in the JSON, the console and an annotated listing. It
must see what a campaign did not do: a layout without a Mamba group never runs vLLM's
MambaManager, one with it does, and the measurement says so."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvcheck.fuzz import engine_coverage as ec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from badinput import assert_bad_input, run  # noqa: E402


def test_ranges_and_resolve() -> None:
    assert ec._ranges([9, 3, 4, 5, 11, 12]) == ["3-5", "9", "11-12"]
    found, absent = ec.resolve(["json.decoder", "no_such_pkg.cache", "json", "sys"])
    assert list(found) == ["json.decoder", "json"] and found["json.decoder"].endswith("json/decoder.py")
    assert absent == ["no_such_pkg.cache", "sys"]           # not installed; built in (no Python source)


def test_run_time_lines_are_function_bodies_and_the_floor_judges_them(tmp_path) -> None:
    """What runs at import (module and class bodies, def and decorator lines) is not a run-time
    line; a floor is judged per module on run-time lines, a module the release lacks is not."""
    src = tmp_path / "m.py"
    src.write_text('import os\n\nX = 1\n\n\nclass A:\n    y = 2\n\n    @staticmethod\n    def f(a):\n'
                   '        b = a + 1\n        return [c for c in\n                range(b)]\n\n\n'
                   'def g():\n    return lambda z: z * 2\n')
    assert ec.body_lines(str(src)) == {11, 12, 13, 17}
    assert ec.body_lines(str(tmp_path / "missing.py")) == set()
    res = {"engine": "e", "files": {"a": {"runtime_pct": 40.0, "runtime_lines": 4, "runtime_statements": 10},
                                    "b": {"runtime_pct": None, "runtime_lines": 0, "runtime_statements": 0}}}
    assert ec.below_floor(res, {"a": 40.0, "b": 50.0, "absent": 10.0}) is None
    why = ec.below_floor(res, {"a": 40.1})
    assert why == "below the engine-code coverage floor: a 40.0% < 40.1% (4/10 run-time lines)"


def test_cover_is_refused_where_no_cache_code_is_declared(capsys, tmp_path) -> None:
    assert_bad_input(*run(capsys, "fuzz", "--sut", "spec", "--cover", "--budget", "10",
                          "--out", str(tmp_path))[::2], "--cover applies to --sut")


def _cover(capsys, tmp_path: Path, layout: str) -> dict:
    code, out, err = run(capsys, "fuzz", "--sut", "vllm", "--layout", layout, "--budget", "150", "--seed", "0",
                         "--cover", "--json", "--out", str(tmp_path / layout))
    res = json.loads(out)
    assert code in (0, 3), out + err                  # clean (3: below the floor at this budget)
    return res["engine_coverage"]


def test_vllm_coverage_sees_the_mamba_manager_only_where_the_layout_has_one(capsys, tmp_path) -> None:
    pytest.importorskip("vllm")
    plain = _cover(capsys, tmp_path, "full+swa")
    mamba = _cover(capsys, tmp_path, "full+mamba")
    for cov in (plain, mamba):
        assert cov["engine"] == "vllm" and 0 < cov["lines_pct"] < 100 and cov["lines"] <= cov["statements"]
        assert set(cov["files"]) | set(cov["absent_modules"]) == set(ec_modules())
        assert Path(cov["annotated"]).is_file()           # coverage.py's HTML: the lines never reached, marked
        mgr = cov["files"]["vllm.v1.core.kv_cache_manager"]
        assert mgr["lines"] > 0 and mgr["missing_lines"], mgr
    stkm = "vllm.v1.core.single_type_kv_cache_manager"
    path = plain["files"][stkm]["path"]
    src = Path(path).read_text().splitlines()
    mamba_lines = _mamba_manager_lines(src)
    assert mamba_lines, "no MambaManager class in this release's single_type_kv_cache_manager.py"
    missed_plain = _expand(plain["files"][stkm]["missing_lines"])
    missed_mamba = _expand(mamba["files"][stkm]["missing_lines"])
    ran_plain = [n for n in mamba_lines if n not in missed_plain and src[n - 1].strip()
                 and not src[n - 1].lstrip().startswith(("def ", "class ", "@", "#", '"""'))]
    ran_mamba = [n for n in mamba_lines if n not in missed_mamba]
    assert len(ran_mamba) > len(ran_plain) + 5, (len(ran_mamba), len(ran_plain))


def ec_modules() -> tuple[str, ...]:
    from kvcheck.fuzz import registry
    return registry.get("vllm").cache_code


def _expand(ranges: list[str]) -> set[int]:
    out: set[int] = set()
    for r in ranges:
        a, _, b = r.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def _mamba_manager_lines(src: list[str]) -> list[int]:
    """Line numbers of `class MambaManager`'s body (to the next top-level statement)."""
    start = next((i for i, s in enumerate(src) if s.startswith("class MambaManager")), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(src)) if src[i] and not src[i][0].isspace()), len(src))
    return list(range(start + 2, end + 1))


SGLANG_PYTHONS = [p for p in __import__("os").environ.get("KVCHECK_SGLANG_PYTHONS", "").split(":") if p]


@pytest.mark.skipif(not SGLANG_PYTHONS, reason="no SGLang side venv (KVCHECK_SGLANG_PYTHONS; .ci/run builds two)")
@pytest.mark.parametrize("python", SGLANG_PYTHONS or ["-"])
def test_sglang_coverage_on_each_release(tmp_path, python) -> None:
    """SGLang's own driver in its side venv (the oldest and newest release in CI): the radix
    layout reaches RadixCache's lines; modules a release lacks are named, not counted."""
    import subprocess
    p = subprocess.run([python, "-m", "kvcheck", "fuzz", "--sut", "sglang", "--layout", "radix", "--budget", "300",
                        "--seed", "0", "--cover", "--json", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert p.returncode in (0, 3), p.stdout[-2000:] + p.stderr[-2000:]
    cov = json.loads(p.stdout)["engine_coverage"]
    radix = cov["files"]["sglang.srt.mem_cache.radix_cache"]
    assert radix["lines"] > 0 and radix["missing_lines"] and cov["lines"] < cov["statements"], radix
    assert "sglang.srt.mem_cache.radix_cache" not in cov["absent_modules"] and Path(cov["annotated"]).is_file()


def test_transformers_diff_coverage_and_refusals(capsys, tmp_path) -> None:
    """kvcheck diff --cover on transformers measures cache_utils; the reference engine (kvcheck's
    own code) and --ray are refused in one line."""
    pytest.importorskip("transformers")
    code, out, err = run(capsys, "diff", "--sut", "transformers", "--model-type", "mistral", "--scenarios", "2",
                         "--cover", "--json", "--out", str(tmp_path))
    assert code == 0, out + err
    cov = json.loads(out)["engine_coverage"]
    f = cov["files"]["transformers.cache_utils"]
    assert cov["engine"] == "transformers" and 0 < f["lines"] < f["statements"] and f["missing_lines"], f
    assert_bad_input(*run(capsys, "diff", "--sut", "reference", "--cover", "--scenarios", "2",
                          "--out", str(tmp_path))[::2], "--cover applies to --sut")
    assert_bad_input(*run(capsys, "fuzz", "--sut", "vllm", "--layout", "full", "--cover", "--ray",
                          "--out", str(tmp_path))[::2], "--cover measures the campaign in this process")


def test_a_project_system_with_cover_reports_it_in_md_json_and_html(capsys, tmp_path) -> None:
    """`cover` (on by default) in a project's vLLM system: each campaign's coverage in report.json
    (the engine block), report.md (a table) and report.html (per module), held to the engine's
    floor (an `engine_coverage` check); bad values are one line."""
    pytest.importorskip("vllm")
    proj = tmp_path / "kvcheck.toml"
    proj.write_text('[systems.vllm]\nlayouts = ["full+swa"]\nengines = ["fuzz"]\nbudget = 400\n')
    code, out, err = run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "rep"))
    assert code == 0, out + err
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    cov = rep["engines"]["vllm[full+swa] fuzz"]["engine_coverage"]["full+swa seed 0"]
    assert 0 < cov["lines_pct"] < 100 and Path(cov["annotated"]).is_file()
    assert 0 < cov["runtime_pct"] < cov["lines_pct"] or cov["runtime_statements"] < cov["statements"]
    (c,) = [c for c in rep["checks"] if c["check"] == "engine_coverage"]
    assert c["verdict"] == "passed" and c["counts"]["runtime_pct"] == cov["runtime_pct"], c
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Engine-code coverage" in md and "| vllm[full+swa] | full+swa seed 0 |" in md
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "Engine-code coverage" in html and "vllm.v1.core.block_pool" in html
    proj.write_text('[systems.vllm]\nlayouts = ["full+swa"]\ncover = "yes"\n')
    assert_bad_input(*run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "b"))[::2],
                     "[systems.vllm] cover: must be true or false")
    proj.write_text('[systems.spec]\ncover = true\n')
    assert_bad_input(*run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "c"))[::2],
                     "[systems.spec] cover: applies to vllm and transformers only")


def test_a_campaign_below_the_engine_floor_is_undecided_not_passed(capsys, tmp_path) -> None:
    """One step builds vLLM's scheduler and KV cache manager and little else: its block_pool
    run-time lines stay under the engine's floor, so the gate says undecided (exit 3) and names
    the module, where it passes the same layout at 400 steps (above). `cover = false` measures
    nothing and judges nothing."""
    pytest.importorskip("vllm")
    proj = tmp_path / "kvcheck.toml"
    proj.write_text('[systems.vllm]\nlayouts = ["full"]\nengines = ["fuzz"]\nbudget = 1\n')
    code, out, err = run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "rep"))
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    (c,) = [c for c in rep["checks"] if c["check"] == "engine_coverage"]
    assert code == 3 and c["verdict"] == "undecided", out + err
    assert "below the engine-code coverage floor: vllm.v1.core.block_pool" in c["note"], c
    proj.write_text('[systems.vllm]\nlayouts = ["full"]\nengines = ["fuzz"]\nbudget = 1\ncover = false\n')
    code, out, err = run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "off"))
    rep = json.loads((tmp_path / "off" / "report.json").read_text())
    assert not [c for c in rep["checks"] if c["check"] == "engine_coverage"]
    assert "engine_coverage" not in rep["engines"]["vllm[full] fuzz"]


def test_a_transformers_project_system_is_held_to_its_floor(capsys, tmp_path) -> None:
    """The transformers engine's runs are measured by default too (cache_utils), and judged."""
    pytest.importorskip("transformers")
    proj = tmp_path / "kvcheck.toml"
    proj.write_text('[systems.transformers]\nmodel_types = ["mistral"]\nbudget = 2\n')
    code, out, err = run(capsys, "gate", "--project", str(proj), "--out", str(tmp_path / "rep"))
    assert code == 0, out + err
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    cov = rep["engines"]["transformers[mistral] diff"]["engine_coverage"]["mistral seed 0"]
    (c,) = [c for c in rep["checks"] if c["check"] == "engine_coverage"]
    assert c["verdict"] == "passed" and cov["files"]["transformers.cache_utils"]["runtime_lines"] > 0, c
