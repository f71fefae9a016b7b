"""`kvcheck adapter-check`: a clean adapter is clean; declared actions the spec never enables,
unknown ones and malformed observations are named; a broken constructor is one line, exit 2;
and a clean campaign of an adapter declaring a never-enabled action says which (exit 3)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOY_CFG = "examples/toy.json"


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcheck", *argv], capture_output=True, text=True, cwd=ROOT)


def test_example_adapters_are_clean() -> None:
    proc = _run("adapter-check", "examples.hashchain_adapter:Adapter", "--config", "examples/hashchain.json",
                "--steps", "600", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(proc.stdout)
    assert res["problems"] == [] and res["reports"] == "the whole state" and res["never_enabled"] == []
    assert set(res["faults"]) == {"stale_hash_after_reuse", "hash_ignores_parent", "hash_missing_salt",
                                  "evicts_referenced_block"} and set(res["faults"].values()) == {"ok"}
    proc = _run("adapter-check", "examples.toy_allocator:ToyAllocator", "--config", TOY_CFG, "--steps", "600")
    assert proc.returncode == 0 and "clean (exit 0)" in proc.stdout
    assert "never reports object fields ver, abi" in proc.stdout     # a partial abstraction


def test_never_enabled_and_unknown_actions_are_named() -> None:
    proc = _run("adapter-check", "tests.cli.lint_suts:DeclaresTooMuch", "--config", TOY_CFG, "--steps", "600")
    assert proc.returncode == 3
    assert "PROBLEM: declares use_stale, which the spec never enabled in 600 steps" in proc.stdout
    proc = _run("adapter-check", "tests.cli.lint_suts:UnknownAction", "--config", TOY_CFG, "--steps", "300")
    assert proc.returncode == 3 and "declares actions the spec does not have: frobnicate" in proc.stdout
    proc = _run("adapter-check", "tests.cli.lint_suts:BadObservation", "--config", TOY_CFG, "--steps", "300")
    assert "observe() returned list" in proc.stdout and "Traceback" not in proc.stderr


def test_broken_constructor_is_one_line_exit_2() -> None:
    for argv in (("tests.cli.lint_suts:BrokenConstructor",), ("tests.cli.lint_suts:Nope",), ("no_such_module:X",)):
        proc = _run("adapter-check", *argv, "--config", TOY_CFG)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
    proc = _run("adapter-check", "tests.cli.lint_suts:BrokenConstructor", "--config", TOY_CFG)
    assert "constructing BrokenConstructor raised RuntimeError: cannot open the device second line" in proc.stderr


def test_clean_fuzz_run_exit_3_names_the_never_enabled_action(tmp_path) -> None:
    proc = _run("fuzz", "--sut", "tests.cli.lint_suts:DeclaresTooMuch", "--config", TOY_CFG, "--budget", "1500",
                "--out", str(tmp_path))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    first = proc.stdout.splitlines()[0]
    assert "undecided: the SUT declares use_stale, which the spec never enabled" in first
    assert "kvcheck adapter-check" in first


def test_bad_config_and_a_config_the_base_class_cannot_map(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"blocks": "three"}')
    proc = _run("adapter-check", "examples.hashchain_adapter:Adapter", "--config", str(bad))
    assert proc.returncode == 2 and "blocks must be an integer" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run("adapter-check", "examples.hashchain_adapter:Adapter")       # the default hybrid config
    assert proc.returncode == 2 and "maps one full-attention group" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_finding_in_the_short_run_is_reported_with_its_code() -> None:
    proc = _run("adapter-check", "tests.cli.lint_suts:EvictsPinned", "--config", TOY_CFG, "--json")
    res = json.loads(proc.stdout)
    assert proc.returncode == res["exit_code"] == 13, res       # a pinned page evicted: a probe taken
    assert res["finding"]["checks"] == ["sut_accepted_disabled_action"]
    assert res["finding"]["steps"][-1].startswith("evict")
