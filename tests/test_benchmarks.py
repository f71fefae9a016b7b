"""Every benchmark script (benchmarks/*.py) runs, with a tiny budget, so that none rots silently.

Each runs as its own process (`python benchmarks/NAME.py ARGS`, from the repository root, with the
root on PYTHONPATH as the README runs them), must exit 0 and print one JSON object on stdout
(some print it indented: the object is the last top-level one), and the object must hold the
figures that show the script did its work (a rate > 0, a fault caught, ...). Speed is never
asserted. The budgets are the scripts' own flags; where a script had none small enough it has a
`--smoke` (its figures are then meaningless; only that the script runs is checked).

A benchmark whose dependency is absent skips, saying which: scale.py needs Ray (the `scale`
extra), sglang.py an SGLang side venv (the first interpreter of KVCHECK_SGLANG_PYTHONS, as in
tests/adapters/test_sglang_releases.py), vllm.py and transformers.py their library in this venv.
`test_every_benchmark_has_a_smoke_run` fails when a new benchmark has no entry in CASES.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TIMEOUT_S = 300          # one script; the tiny budgets take seconds (imports included)
SGLANG_PYTHONS = [p for p in os.environ.get("KVCHECK_SGLANG_PYTHONS", "").split(os.pathsep) if p]


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _spec_walk(o: dict) -> None:
    assert o["steps_per_run"] == 200 and o["runs"] == 1
    assert _positive(o["steps_per_s"]) and _positive(o["full_check_steps_per_s"])


def _checker(o: dict) -> None:
    assert o["smoke"] is True and o["explore_states"] > 0
    assert _positive(o["explore_states_per_s"]) and _positive(o["prove_seconds"])
    assert _positive(o["induction_seconds_by_blocks"]["2"]), o["induction_seconds_by_blocks"]


def _compare(o: dict) -> None:
    assert o["smoke"] is True
    assert _positive(o["walk"]["base"]) and _positive(o["walk"]["new"]) and _positive(o["walk"]["ratio"])


def _fuzz(o: dict) -> None:
    assert _positive(o["spec_steps_per_s"]) and _positive(o["lockstep_steps_per_s"]), o
    assert o["caught_by_expected"] == {"decode_publishes_partial": True}, o["missed_or_misattributed_by_seed"]
    assert o["trace_len_by_fault"]["decode_publishes_partial"] >= 1


def _search(o: dict) -> None:
    row = o["faults"]["swa_hit_unchecked@full+swa"]
    assert set(row) == {"random", "coverage", "swarm_off"} and row["random"]["found"] == "1/1", row
    assert _positive(o["tracer"]["ctracer_cpu_s"]) and set(o["coverage_after"]) >= {"random@auto", "coverage@mixed"}
    assert all(_positive(v["lines"]) for k, v in o["coverage_after"].items() if "@" in k), o["coverage_after"]
    assert o["reference_exhaustive"]["engine_tail_check_skipped"]["exhaustive"]["programs"] > 0


def _coverage_reach(o: dict) -> None:
    mods = o["per_module"]
    assert o["layouts_drives"] == 2 and 0 < o["union_runtime_lines"] <= o["runtime_statements"], o
    assert all(0 <= m["union"] <= m["statements"] for m in mods.values()), mods
    (g,) = o["generated"]
    assert g["lines"] > 0 and 0 < g["of_union_pct"] <= 100, g


def _kernels_gpu(o: dict) -> None:
    # without CUDA it times nothing and says so; with CUDA --tiny runs every kernel on small shapes
    if o["cuda"] is False:
        assert "no CUDA device" in o["reason"]
        return
    assert o["tiny"] is True and o["kernels"], o
    # (a twin that cannot run on the GPU is timed on the CPU and says so: twin_error_cuda is no failure)
    errors = {f"{k}.{k2}": v for k, row in o["kernels"].items() for k2, v in row.items()
              if k2 in ("triton_error", "compare_error")}
    assert not errors, errors
    assert all(_positive(row["triton_ms"]) for row in o["kernels"].values())
    assert o["model"].get("reuse_equals_recompute_bitwise") is True, o["model"]


def _model(o: dict) -> None:
    assert o["smoke"] is True
    assert _positive(o["decode_step_ms"]) and _positive(o["prefill_16_ms"])
    assert _positive(o["default_threads"]["decode_step_ms"]) and _positive(o["gemm_rule"]["rows_1"]["ratio"])


def _reuse(o: dict) -> None:
    assert o["repeats"] == 1 and o["bitwise_equal"] is True
    assert _positive(o["ttft_reuse_ms"]) and _positive(o["ttft_recompute_ms"]) and _positive(o["speedup"])


def _scale(o: dict) -> None:
    assert o["workers"]["1"]["steps"] > 0 and _positive(o["workers"]["1"]["steps_per_s"]), o["workers"]
    assert _positive(o["pool_wall_steps_per_s"]["1"])


def _sglang(o: dict) -> None:
    assert _positive(o["throughput"]["radix"]["ops_per_s_cpu"]), o["throughput"]
    assert o["faults"]["evict_locked@radix"]["caught"] == "1/1", o["faults"]


def _transformers(o: dict) -> None:
    assert o["discovery"] is False and o["model_types_listed"] == 1 and o["model_types_run"] == 1, o
    (row,) = o["models"]
    assert row["model_type"] == "gemma2" and row["verdict"] in ("exact", "within-tolerance", "divergent"), row


def _vllm(o: dict) -> None:
    assert o["drive"] == "mixed"          # pinned: the manager drive (the default drive is auto)
    assert _positive(o["throughput"]["full+swa"]["ops_per_s_median"]), o["throughput"]
    assert o["faults"]["swa_hit_unchecked@full+swa"]["caught"] == "1/1", o["faults"]


def _vllm_engine(o: dict) -> None:
    assert o["drive"] == "engine"
    assert _positive(o["layouts"]["full"]["ops_per_s_median"]), o["layouts"]
    assert 0 < o["layouts"]["full"]["vllm_share_median"] < 1
    r = o["rediscover"]["priority_preempt_unwritten"]
    assert r["found"] in ("0/1", "1/1") and len(r["per_seed"]) == 1, r


def _no_requirement() -> None:
    return None


def _module(name: str, why: str) -> Callable[[], None]:
    """Skip unless `name` is importable here (found without importing it: vLLM's import alone
    takes seconds; the script's own run is the import check)."""
    def need() -> None:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{why}: `{name}` is not importable in this venv")
    return need


def _ray() -> None:
    pytest.importorskip("ray", reason="scale.py needs Ray (pip install -e '.[scale]')")


def _sglang_python() -> None:
    if not SGLANG_PYTHONS:
        pytest.skip("sglang.py runs in an SGLang side venv: set KVCHECK_SGLANG_PYTHONS "
                    "(scripts/install-sglang.sh VERSION DIR)")


@dataclass(frozen=True)
class Case:
    args: tuple[str, ...]
    check: Callable[[dict], None]
    need: Callable[[], None] = _no_requirement
    python: Callable[[], str] = lambda: sys.executable


CASES: dict[str, Case] = {
    "search": Case(("--cap-s", "3", "--faults", "swa_hit_unchecked@full+swa", "--cover-s", "1", "--depth", "2",
                    "--tracer-steps", "100"), _search, _module("vllm", "search.py needs vLLM")),
    "coverage_reach": Case(("--layouts", "full", "--per-layout-s", "1", "--after", "1"), _coverage_reach,
                           _module("vllm", "coverage_reach.py needs vLLM")),
    "spec_walk": Case(("--steps", "200", "--runs", "1"), _spec_walk),
    "checker": Case(("--smoke", "--reps", "1", "--blocks", "2"), _checker),
    "compare": Case(("--base-tree", ".", "--runs", "1", "--metrics", "walk", "--smoke"), _compare),
    "fuzz": Case(("--steps", "50", "--runs", "1", "--seeds", "1", "--budget", "2000",
                  "--faults", "decode_publishes_partial"), _fuzz),
    "kernels_gpu": Case(("--tiny",), _kernels_gpu),
    "model": Case(("--smoke",), _model),
    "reuse": Case(("--repeats", "1"), _reuse),
    "scale": Case(("--reps", "1", "--budget", "1", "--workers", "1"), _scale, _ray),
    "sglang": Case(("--steps", "50", "--seeds", "1", "--layouts", "radix", "--faults", "evict_locked"),
                   _sglang, _sglang_python, lambda: SGLANG_PYTHONS[0]),
    "transformers": Case(("--only", "gemma2", "--scenarios", "1", "--no-discovery"), _transformers,
                         _module("transformers", "transformers.py needs transformers")),
    "vllm": Case(("--steps", "50", "--seeds", "1", "--layouts", "full+swa", "--faults", "swa_hit_unchecked"),
                 _vllm, _module("vllm", "vllm.py needs vLLM")),
    "vllm_engine": Case(("--steps", "300", "--seeds", "1", "--layouts", "full", "--defects", "priority_preempt_unwritten",
                         "--slice-s", "2", "--cap-s", "2", "--rediscover-seeds", "1"),
                        _vllm_engine, _module("vllm", "vllm_engine.py needs vLLM")),
}


def last_json_object(stdout: str) -> dict:
    """The last JSON object on stdout: its last line when printed on one line, else the text from
    the last line that opens a top-level object (`json.dumps(..., indent=1)`) to the end."""
    lines = stdout.rstrip().splitlines()
    assert lines, "nothing on stdout"
    starts = [len(lines) - 1] + [i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("{")]
    for i in starts:
        try:
            obj = json.loads("\n".join(lines[i:]))
        except ValueError:
            continue
        assert isinstance(obj, dict), f"the last JSON value on stdout is not an object: {obj!r:.200}"
        return obj
    raise AssertionError(f"no JSON object at the end of stdout:\n{stdout[-2000:]}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs(name: str) -> None:
    case = CASES[name]
    case.need()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [case.python(), str(BENCH / f"{name}.py"), *case.args]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} ran over {TIMEOUT_S} s; stderr:\n{(e.stderr or b'')[-3000:]!r}")
    where = f"{' '.join(cmd)} (exit {p.returncode})\nstderr:\n{p.stderr[-3000:]}\nstdout:\n{p.stdout[-2000:]}"
    assert p.returncode == 0, where
    out = last_json_object(p.stdout)
    try:
        case.check(out)
    except (AssertionError, KeyError, TypeError) as e:
        raise AssertionError(f"{name}: {e!r}\n{json.dumps(out)[:3000]}") from e


def test_every_benchmark_has_a_smoke_run() -> None:
    """A benchmark added to benchmarks/ needs its entry in CASES (helpers start with `_`)."""
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    assert scripts - set(CASES) == set(), f"benchmarks without a smoke run in CASES: {sorted(scripts - set(CASES))}"
    assert set(CASES) - scripts == set(), f"CASES names benchmarks that are gone: {sorted(set(CASES) - scripts)}"
