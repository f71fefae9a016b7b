"""pytest plugin: run kvcheck's machines against your own system under test inside your suite.

Registered as a pytest11 entry point, so installing kvcheck makes it available:

    def test_my_cache_manager_conforms(kvcheck_campaign):
        kvcheck_campaign("mypkg.kvadapter:MyAdapter", config="kvcheck.json", budget="5000")

    pytest --kvcheck-sut mypkg.kvadapter:MyAdapter --kvcheck-budget 30s

The campaign settings are the CLI profile's (`kvcheck fuzz`); a finding fails the test with
the shrunk trace and its replay command.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: Any) -> None:
    g = parser.getgroup("kvcheck", "kvcheck conformance campaigns")
    g.addoption("--kvcheck-sut", default=None, metavar="MODULE:CLASS",
                help="system under test for the kvcheck_campaign fixture (default: spec)")
    g.addoption("--kvcheck-budget", default="2000", help="time (30s) or steps (2000) per campaign")
    g.addoption("--kvcheck-config", default=None, metavar="FILE", help="kvcheck config JSON")
    g.addoption("--kvcheck-seed", default=0, type=int, help="campaign seed")


@pytest.fixture
def kvcheck_campaign(request: Any, tmp_path: Path):
    """Call it with (sut, config, budget, seed, fault); CLI options give the defaults."""
    from ..spec.config import Config
    from .campaign import Budget, run_campaign
    opt = request.config.getoption

    def run(sut: str | None = None, config: str | Config | None = None, budget: str | None = None,
            seed: int | None = None, fault: str | None = None, expect_exit: int = 0) -> dict[str, Any]:
        sut = sut or opt("--kvcheck-sut") or "spec"
        cfg = config if isinstance(config, Config) else Config.load(config or opt("--kvcheck-config"))
        res = run_campaign(cfg, sut, Budget.parse(budget or opt("--kvcheck-budget")),
                           opt("--kvcheck-seed") if seed is None else seed, fault, None, tmp_path)
        if res["exit_code"] != expect_exit:
            lines = [f"kvcheck campaign on {sut}: exit {res['exit_code']} (expected {expect_exit}), "
                     f"{res['steps']} steps, seed {res['seed']}"]
            for f in res["findings"]:
                lines += [f"[{f['kind']}] {', '.join(f['checks'])}: {f['message']}",
                          *[f"  {s}" for s in f["trace_steps"]], f"replay: {f['replay']}"]
            pytest.fail("\n".join(lines), pytrace=False)
        return res

    return run
