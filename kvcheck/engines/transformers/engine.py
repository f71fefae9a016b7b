"""transformers as a registered engine: every hybrid model type of the installed release, built
tiny with random weights, reuse vs full recompute through its own cache classes (oracle.py,
docs/adapters-transformers.md). transformers itself is imported lazily."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvcheck.fuzz.engine import Engine

from .cache import TRANSFORMERS_FAULTS

MAX_SCENARIOS = 1000


class TransformersEngine(Engine):
    name = "transformers"
    summary = "Hugging Face transformers: reuse vs full recompute on every hybrid model type's cache classes"
    docs = "docs/adapters-transformers.md"
    legacy_modules = {"kvcheck.fuzz.adapters.transformers": "kvcheck.engines.transformers.oracle"} | {
        f"kvcheck.fuzz.adapters.transformers_{m}": f"kvcheck.engines.transformers.{m}" for m in (
            "build", "cache", "models", "plan", "rules", "scenarios", "trace")}
    project_variant_key = "model_types"
    packages = ("transformers",)      # fuzz/boundary.py: its frames are the engine's (interface.PACKAGES)
    cache_code = ("transformers.cache_utils",)      # kvcheck diff --cover
    # one scenario reaches 10.0-16.3 % of cache_utils' run-time lines, ten 13.7-16.7 % (5.24.0;
    # mistral, gemma3_text, qwen3_next); a run that built no cache reaches none
    coverage_floor = {"transformers.cache_utils": 8.0}
    # kvcheck matrix --sut transformers: every 5.x release (docs/findings-transformers.md, "The
    # release matrix"); a column is a model type, a cell `kvcheck diff` with N scenarios
    distribution = "transformers"
    release_range = ("5.0.0", "5.25.0")
    install_script = "scripts/install-transformers.sh"
    matrix_column = "model type"
    matrix_budget = "10"                # 10 scenarios: one of each assisted-decoding kind among them

    def release(self) -> str | None:
        from importlib import metadata
        try:
            return metadata.version("transformers")
        except metadata.PackageNotFoundError:
            return None

    def layouts(self) -> dict[str, str]:
        """Every hybrid model type of the installed release -> the kinds of its layers."""
        from .oracle import list_models
        return {m["model_type"]: ", ".join(m["layer_kinds"]) for m in list_models(None)}

    def faults(self) -> tuple:
        return TRANSFORMERS_FAULTS

    def known_defects(self) -> dict:
        from .known import KNOWN
        return dict(KNOWN)

    def checks(self) -> dict[str, str]:
        return {"reuse_equals_recompute": "differential"}

    def diff_command(self, args: argparse.Namespace) -> int:
        from .cli import diff_command
        return diff_command(args)

    def matrix_cell(self, column: str, budget: str, seed: int) -> list[str]:
        """One model type's reuse-vs-recompute run: `kvcheck diff` with BUDGET scenarios."""
        return ["diff", "--sut", self.name, "--model-type", column, "--scenarios", budget, "--seed", str(seed)]

    def check_matrix_budget(self, budget: str) -> float | None:
        """A cell is a number of scenarios (kvcheck diff --scenarios), not a time."""
        text = budget.strip() if isinstance(budget, str) else ""
        if not text.isdigit() or not 1 <= int(text) <= MAX_SCENARIOS:
            raise ValueError(f"a transformers cell runs a number of kvcheck diff scenarios (1-{MAX_SCENARIOS}, "
                             f"e.g. 8), not {str(budget)[:40]!r}")
        return None

    def project_system(self, variants: list[str] | None, body: Any, base: Path) -> tuple[list[str], dict[str, Any]]:
        from .project import project_system
        return project_system(variants, body, base)

    def project_run(self, system: Any, variant: str, seed: int, out: Path, fault: str | None = None) -> Any:
        from .project import run_transformers
        return run_transformers(system, variant, seed, out, fault)


ENGINE = TransformersEngine()
