"""The reference engine as a registered engine: kvcheck's own hybrid model and cache manager
(kvcheck/reference/) behind the SUT adapter (sut.py), with `kvcheck diff --sut reference`
(diff.py, cli.py). It is the gate's default system under test and the mutants matrix's
engine-fault checker."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvcheck.fuzz.engine import Engine
from kvcheck.spec.config import Config


class ReferenceEngine(Engine):
    name = "reference"
    summary = ("kvcheck's reference engine: per-type paged pools, hashing, the funnel, host/disk tiers, "
               "a tiny batch-invariant hybrid LM (reuse == recompute bitwise)")
    docs = "docs/engine.md"
    legacy_modules = {"kvcheck.reference.adapter": "kvcheck.engines.reference.sut",
                      "kvcheck.fuzz.diff": "kvcheck.engines.reference.diff"}

    def release(self) -> str | None:
        from kvcheck import __version__
        return __version__

    def faults(self) -> tuple:
        from kvcheck.reference.faults import ENGINE_FAULTS
        return ENGINE_FAULTS

    def checks(self) -> dict[str, str]:
        return {"reuse_equals_recompute": "differential"}

    def sut_class(self) -> type:
        from .sut import ReferenceSUT
        return ReferenceSUT

    def diff_command(self, args: argparse.Namespace) -> int:
        from .cli import diff_command
        return diff_command(args)

    def differential(self, cfg: Config, scenarios: int, seed: int, fault: str | None, out: Path,
                     seconds: float | None = None) -> dict[str, Any]:
        """Reuse vs recompute over `scenarios` generated workloads (the gate's diff profile)."""
        from .diff import run_reference_diff
        return run_reference_diff(scenarios, seed, fault, out, cfg, seconds=seconds)

    def mutant_engines(self) -> dict[str, Any]:
        from .diff import mutant_engine
        return {"diff": mutant_engine}


ENGINE = ReferenceEngine()
