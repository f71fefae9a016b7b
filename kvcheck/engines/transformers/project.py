"""The transformers engine in a project file: `model_types` of a `[tool.kvcheck.systems.transformers]`
table, and one model type's reuse-vs-recompute run as the gate's checks."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping

from kvcheck.checker.project import System
from kvcheck.checker.project_engines import EngineRun, covered, finding, per_check, skipped
from kvcheck.spec.outputs import file_stem, kvcheck_command
from kvcheck.fuzz.boundary import CannotDrive
from kvcheck.fuzz.engine import ProjectKeyError
from kvcheck.spec.verdict import ExitCode

from . import models as tm
from . import oracle as hf


def project_system(names: list[str] | None, body: Mapping[str, Any],
                   base: Path) -> tuple[list[str], dict[str, Any]]:
    """The model types to check (each a hybrid model type of the installed transformers)."""
    if names is None:
        raise ProjectKeyError("model_types", "missing: name the transformers model types to check")
    try:
        _, causal = tm.config_mapping()
    except tm.AdapterError as e:
        raise ProjectKeyError("model_types", str(e)) from None
    for i, n in enumerate(names):
        mt = tm.ALIASES.get(n, n)
        if mt not in causal or tm.describe(mt) is None:
            raise ProjectKeyError(f"model_types[{i}]", f"unknown or non-hybrid model type {n!r} "
                             "(see `kvcheck diff --sut transformers --list-models`)")
    return list(names), {}


def run_transformers(sys: System, model_type: str, seed: int, out: Path, fault: str | None = None) -> EngineRun:
    return covered(sys, "transformers", f"transformers[{model_type}]", "diff", f"{model_type} seed {seed}",
                   out / f"engine-coverage-transformers-{file_stem(model_type)}-seed{seed}", fault,
                   lambda: _diff(sys, model_type, seed, out, fault))


def _diff(sys: System, model_type: str, seed: int, out: Path, fault: str | None) -> EngineRun:
    label = f"transformers[{model_type}]"
    n = sys.budgets["diff"].steps or 10
    t0 = time.perf_counter()
    try:
        res = hf.run_diff(model_type, scenarios=n, seed=seed, fault=fault, out_dir=str(out), cover=True)
    except hf.AdapterError as e:
        return skipped(label, "diff", str(e))
    except CannotDrive as e:     # kvcheck cannot drive this release: undecided (exit 3), never a finding
        secs = time.perf_counter() - t0
        return EngineRun(ExitCode.UNDECIDED, secs, {}, per_check(label, "diff", ["reuse_equals_recompute"], {},
                                                                 secs, {}, {"reuse_equals_recompute": e.line}))
    secs = time.perf_counter() - t0
    counts = {"scenarios": len(res.get("scenarios", [])), **(res.get("counts") or {})}
    verdict = res["verdict"]
    if verdict == "unsupported":
        return skipped(label, "diff", f"unsupported: {res.get('reason')}")
    cmd = kvcheck_command("diff", "--sut", "transformers", "--model-type", model_type, "--scenarios", n,
                          "--seed", seed, *(["--fault", fault] if fault else []))
    failed = {}
    code = ExitCode.OK
    if verdict in ("divergent", "error"):
        msg = f"{verdict}: " + (res.get("error") or str((res.get("explanation") or {}).get("summary", ""))
                                or "reuse differs from a full recompute")
        failed["reuse_equals_recompute"] = finding("differential", msg, cmd, [])
        code = ExitCode.DIFF
    return EngineRun(code, secs, counts, per_check(label, "diff", ["reuse_equals_recompute"], failed, secs, counts))
