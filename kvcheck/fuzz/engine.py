"""The engine protocol, written once: what an engine package gives kvcheck's core.

An engine (the reference engine, vLLM, SGLang, transformers, the hash-chain base for user
adapters, a third party's `kvcheck-myengine`) is a package with one `Engine` subclass, registered
under the `kvcheck.engines` entry-point group (fuzz/registry.py finds them). The core (lockstep,
campaign, gate, project file, replay, corpus, mutants, Ray shards, `kvcheck engines`) reaches an
engine only through these methods, never by importing it: an engine imports the core, never the
other way round. Every method has a default meaning "this engine has no such part", so a small
engine overrides a few (a Hypothesis-machine engine: `sut_class`, `faults`).

Methods that drive the engine's own code import it lazily: listing, describing and resolving
an engine must work where its package (vllm, sglang, transformers) is not installed.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

if TYPE_CHECKING:
    from ..spec.faults import Fault
    from ..spec.trace import Trace


class EngineUnavailable(RuntimeError):
    """The engine (or the release installed) cannot run here: one line saying what is missing."""


class ProjectKeyError(ValueError):
    """A bad entry in an engine's table of a project file: the key (path) and why, one line."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key, self.why = key, why


class Engine:
    """One engine. Subclass, set `name` (and `summary`, `docs`), override what applies."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    docs: ClassVar[str] = ""                         # its docs page (path in kvcheck's repo, or URL)
    # Modules an earlier kvcheck had this engine's classes in -> where they are now, so that
    # `MODULE:CLASS` names in old traces and project files still resolve.
    legacy_modules: ClassVar[Mapping[str, str]] = {}
    # `kvcheck fuzz` options this engine's driver takes beyond the common ones (--budget,
    # --seed, --fault, --out, --json): the core refuses the others by name.
    fuzz_options: ClassVar[frozenset[str]] = frozenset()
    # The engine's own top-level packages ("vllm", "sglang"): an exception whose innermost frame
    # is there is the engine's; one raised in kvcheck's frames, or on a kvcheck object the
    # engine was handed, is kvcheck's side of the boundary (fuzz/boundary.py: "cannot drive").
    packages: ClassVar[tuple[str, ...]] = ()
    # The engine's cache code: the modules `kvcheck fuzz --cover` measures line and branch
    # coverage of (fuzz/engine_coverage.py); those a release lacks are reported as absent.
    cache_code: ClassVar[tuple[str, ...]] = ()
    # The gate's coverage floor: module of `cache_code` -> the percent of its run-time lines
    # (function bodies) a gate campaign must reach; below it the campaign's `engine_coverage`
    # check is undecided (exit 3). Set between what building the engine alone reaches and what
    # a working campaign at the gate's default budget reaches (docs/search.md, "The gate").
    coverage_floor: ClassVar[Mapping[str, float]] = {}
    # The package-index distribution of the engine and the releases kvcheck claims to drive,
    # (oldest, newest) inclusive; None: no release matrix (`kvcheck matrix`).
    distribution: ClassVar[str | None] = None
    release_range: ClassVar[tuple[str, str] | None] = None
    # The script (path relative to kvcheck's repository) that builds a side environment for a
    # release, called as `PYTHON=<kvcheck's python> bash SCRIPT VERSION DIR`; None: no matrix.
    install_script: ClassVar[str | None] = None
    # What one column of its release matrix is ("layout"; transformers: "model type"), and the
    # budget of a cell when `kvcheck matrix` is given none.
    matrix_column: ClassVar[str] = "layout"
    matrix_budget: ClassVar[str] = "30s"

    # ---- what it is -------------------------------------------------------------------------
    def release(self) -> str | None:
        """The installed release of the engine's own package (None: not importable here)."""
        return None

    def layouts(self) -> dict[str, str]:
        """Layouts (configurations of its caches) by name -> one line each."""
        return {}

    def unsupported(self) -> dict[str, str]:
        """Layouts the installed release cannot express -> why (empty: all run)."""
        return {}

    def faults(self) -> tuple[Fault, ...]:
        """Its planted faults (each with its expected check); must import without the engine."""
        return ()

    def checks(self) -> dict[str, str]:
        """Its own checks (beyond the spec's invariants) -> the finding kind each reports."""
        return {}

    def known_defects(self) -> dict[str, Any]:
        """Real defects of its releases its campaigns recognise (name -> fuzz.known.KnownDefect);
        what one means for a verdict is the core's rule (fuzz/known.py)."""
        return {}

    def describe(self, unsupported: bool = True) -> dict[str, Any]:
        """The `kvcheck engines` row: never raises (an engine whose parts cannot load says why).
        `unsupported=False` skips asking the release what it cannot express (it imports the
        engine's package, seconds for vLLM)."""
        row: dict[str, Any] = {"name": self.name, "summary": self.summary, "docs": self.docs,
                               "module": type(self).__module__}
        parts = {"release": lambda: self.release(),
                 "layouts": lambda: {str(k): str(v) for k, v in dict(self.layouts()).items()},
                 "unsupported": lambda: ({str(k): str(v) for k, v in dict(self.unsupported()).items()}
                                        if unsupported else None),
                 "faults": lambda: sorted(f.name for f in self.faults()),
                 "checks": lambda: {str(k): str(v) for k, v in dict(self.checks()).items()},
                 "known_defects": lambda: {str(k): {"check": d.check, "releases": f"{d.first}..{d.last}",
                                                    "upstream": d.upstream}
                                           for k, d in dict(self.known_defects()).items()}}
        for key, fn in parts.items():
            try:
                row[key] = fn()
            except Exception as e:  # noqa: BLE001 - one engine's failure must not hide the rest
                row[key] = None
                row.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"
        row["layout_count"] = len(row["layouts"] or {})
        row["unsupported_count"] = None if row["unsupported"] is None else len(row["unsupported"])
        return row

    # ---- systems under test -----------------------------------------------------------------
    def sut_class(self) -> type | None:
        """A class the core's Hypothesis machine drives (the `SystemUnderTest` protocol of
        spec/sut.py), or None when the engine runs its own driver (`campaign`)."""
        return None

    def own_driver(self) -> bool:
        """Whether `kvcheck fuzz` runs the engine's own driver (no SUT class for the core's
        Hypothesis machine). A `sut_class` that raises counts as a SUT class: resolving it
        then reports the error in one line."""
        try:
            return self.sut_class() is None
        except Exception:  # noqa: BLE001 - the error is reported where the SUT is resolved
            return False

    def campaign(self, layout: str, *, budget_s: float | None, steps: int | None, seed: int,
                 fault: str | None, out_dir: str, **options: Any) -> dict[str, Any]:
        """The engine's own driver for one layout (engines without `sut_class`): the campaign
        result dict (`exit_code`, `steps`, `findings`, ...). Raises EngineUnavailable."""
        raise EngineUnavailable(f"{self.name}: no campaign driver")

    def replay(self, trace: Trace) -> tuple[int, dict[str, Any], str]:
        """Replay a saved trace on the engine: (exit code, result, one-paragraph text)."""
        raise EngineUnavailable(f"{self.name}: traces replay on the core (no engine-side replay)")

    def has_replay(self) -> bool:
        return type(self).replay is not Engine.replay

    def write_reproducer(self, trace: Trace, trace_path: str) -> dict[str, Any]:
        """Write the standalone reproducer of a saved trace next to it (`<trace>.repro.py`, the
        script a campaign writes with a finding): {"reproducer": path, "reproducer_run": ...}, or
        {"reproducer": None, "reproducer_note": why not}."""
        return {"reproducer": None, "reproducer_note": f"{self.name}: no standalone reproducers"}

    # ---- the cross-release differential (checker/differential*.py) -----------------------------
    def reuse_sizes(self, layout: str) -> dict[str, int]:
        """The sizes the core generates a layout's release-independent workloads at (fuzz/
        reuse_workloads.py): {"block": tokens of a cache block, "max_tokens": the longest request
        (prompt and output), "vocab": token ids drawn below it}. kvcheck's own data, no release."""
        raise EngineUnavailable(f"{self.name}: no cross-release differential (no replay_reuse)")

    def replay_reuse(self, layout: str, workloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Replay workloads (fuzz/reuse_workloads.py's steps) on the installed release, each on a
        fresh cache: one record per lookup, {"trace", "step", "request", "prompt_tokens", "hit",
        "decision", and where the driver has them "usable", "served", "violation"} (the
        differential compares them across releases). Raises EngineUnavailable."""
        raise EngineUnavailable(f"{self.name}: no cross-release differential (no replay_reuse)")

    def has_replay_reuse(self) -> bool:
        return type(self).replay_reuse is not Engine.replay_reuse

    def trace_workload(self, trace: Trace) -> dict[str, Any] | None:
        """One of its campaign traces (`trace.sut` is this engine) as a workload for replay_reuse
        (`kvcheck matrix --differential --traces`): its requests' prompts as sends in the order the
        trace first schedules them, their finishes and aborts as finishes (fuzz/reuse_workloads.py
        FromTrace says what is dropped). None: this engine's traces cannot be replayed as a
        workload, or this one schedules no request. ValueError (one line) for malformed steps.
        Must not import the engine's package (it reads the trace only)."""
        return None

    def has_trace_workload(self) -> bool:
        return type(self).trace_workload is not Engine.trace_workload

    # ---- command-line hooks (the engine's own driver behind `kvcheck fuzz/diff --sut NAME`) -
    def fuzz_command(self, args: argparse.Namespace) -> int | None:
        """`kvcheck fuzz --sut NAME` when the engine has its own driver; None: the core's
        Hypothesis campaign on `sut_class()`."""
        return None

    def diff_command(self, args: argparse.Namespace) -> int | None:
        """`kvcheck diff --sut NAME` (reuse vs recompute); None: the engine has no model."""
        return None

    # ---- the release matrix (checker/matrix*.py) ----------------------------------------------
    def matrix_cell(self, column: str, budget: str, seed: int) -> list[str]:
        """The `kvcheck` arguments that check one matrix cell (the matrix adds --json, --out and
        the --fuzz-option arguments): a fuzz campaign on the layout by default."""
        return ["fuzz", "--sut", self.name, "--layout", column, "--budget", budget, "--seed", str(seed)]

    def check_matrix_budget(self, budget: str) -> float | None:
        """A cell budget's seconds (None: a count, no time bound); ValueError, one line, if bad."""
        from .budget import Budget
        return Budget.parse(budget).seconds

    # ---- the project gate (checker/project.py) ----------------------------------------------
    # The key of its `[tool.kvcheck.systems.NAME]` table that lists what to check (layouts,
    # model types): each entry is a variant the gate runs; None: one run, no variants.
    project_variant_key: ClassVar[str | None] = None

    def project_system(self, variants: list[str] | None, body: Mapping[str, Any],
                       base: Path) -> tuple[list[str], dict[str, Any]]:
        """Check the table's variants (None: the key is missing) and options, resolving files
        against the project file's folder `base`: (variants, options); ProjectKeyError if bad."""
        return list(variants or []), {}

    def project_run(self, system: Any, variant: str, seed: int, out: Path, fault: str | None = None) -> Any:
        """One variant of a project system: a checker.project_engines.EngineRun."""
        raise EngineUnavailable(f"{self.name}: not available in a project file")

    def differential(self, cfg: Any, scenarios: int, seed: int, fault: str | None, out: Path,
                     seconds: float | None = None) -> dict[str, Any]:
        """Reuse vs recompute over generated workloads of a spec config (the gate's diff profile)."""
        raise EngineUnavailable(f"{self.name}: no differential on a spec config")

    def mutant_engines(self) -> dict[str, Any]:
        """Checkers the mutants matrix runs this engine's faults with -> (cfg, fault, secs, seed)
        -> result (checker/mutants.py); empty: its faults are checked by its own tests."""
        return {}
