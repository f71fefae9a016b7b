"""`--ray`/`--redis` without their optional dependencies or with bad input: one line, exit 2;
shards by SUT, layout and seed."""
from __future__ import annotations

import sys

import pytest

from kvcheck.checker.cli import main
from kvcheck.fuzz.ray_campaign import plan
from kvcheck.spec.config import Config


def test_without_ray_the_install_line_and_exit_2(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)          # import ray -> ImportError
    assert main(["fuzz", "--ray", "--budget", "10", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'kvcheck[scale]'" in err


def test_without_redis_the_install_line_and_exit_2(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)
    assert main(["fuzz", "--redis", "redis://127.0.0.1:6379/0", "--budget", "10", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'kvcheck[scale]'" in err


@pytest.mark.parametrize("argv, msg", [
    (["--redis", "localhost:6379"], "--redis wants a URL"),
    (["--redis", "redis://127.0.0.1:1/0"], "cannot reach Redis at redis://127.0.0.1:1/0"),
    (["--redis", "redis://127.0.0.1:1/0", "--db", "DB"], "--db and --redis"),
    (["--ray", "--observability", "obs.jsonl"], "--observability is not available with --ray"),
    (["--ray", "127.0.0.1:1"], "cannot connect to the Ray cluster at 127.0.0.1:1"),
    (["--ray", "--sut", "sglang", "--layout", "radix"], "--ray applies to the Hypothesis machines"),
    (["--sut", "vllm", "--layout", "full", "--redis", "redis://127.0.0.1:1/0"], "--sut vllm has its own driver"),
    (["--ray", "--sut", "vllm", "--layout", "full,nosuch"], "unknown vLLM layout 'nosuch'"),
])
def test_bad_scale_input_is_one_line_exit_2(argv, msg, capsys, tmp_path, monkeypatch) -> None:
    pytest.importorskip("redis", reason="the redis package is not installed")
    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", "--budget", "10", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err, err


def test_redis_from_the_environment(monkeypatch, capsys, tmp_path) -> None:
    pytest.importorskip("redis", reason="the redis package is not installed")
    monkeypatch.setenv("KVCHECK_REDIS", "redis://127.0.0.1:1/0")
    assert main(["fuzz", "--budget", "10", "--out", str(tmp_path)]) == 2
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in capsys.readouterr().err


def test_shards_by_sut_layout_and_seed() -> None:
    small = Config.from_dict({**Config().to_dict(), "blocks": 3})
    shards = plan([("spec", "shared_free_list"), ("reference", None)], seed=5, seeds=2,
                  layouts={"default": Config(), "small": small})
    assert len(shards) == 8 and len({s.key for s in shards}) == 8
    assert {s.seed for s in shards} == {5, 6}
    assert {(s.sut, s.fault) for s in shards} == {("spec", "shared_free_list"), ("reference", None)}
    assert "spec/small/shared_free_list/seed6" in {s.key for s in shards}
    assert [s.key for s in plan([("spec", None)], 0, 2)] == ["spec/clean/seed0", "spec/clean/seed1"]
