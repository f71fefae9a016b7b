"""vLLM as a registered engine: its real KV cache manager driven as its scheduler drives it, on
its own driver (drivers.py), with presets of real models' KV cache groups, generated and file
layouts, known defects, reproducers (docs/adapters-vllm.md). vLLM itself is imported lazily."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvcheck.fuzz.engine import Engine, EngineUnavailable

from .layouts import BOOKKEEPING_CHECKS, LAYOUTS, SAFETY_CHECKS, VLLM_FAULTS, VllmUnavailable


class VllmEngine(Engine):
    name = "vllm"
    summary = "vLLM's v1 hybrid KV cache manager, driven as its scheduler drives it (releases 0.14.1-0.34.0)"
    docs = "docs/adapters-vllm.md"
    legacy_modules = {"kvcheck.fuzz.adapters.vllm": "kvcheck.engines.vllm.drivers"} | {
        f"kvcheck.fuzz.adapters.vllm_{m}": f"kvcheck.engines.vllm.{m}" for m in (
            "adapter", "bookkeeping", "checks", "fixes", "generator", "known", "layout_file", "layouts",
            "machine", "mamba", "mamba_faults", "presets", "release", "reproducer", "reproducer_body",
            "sched", "timeline", "twin", "workloads")}
    fuzz_options = frozenset({"drive", "layout", "list_layouts", "layout_file", "workload", "sched_policy",
                              "strict_reuse", "ray", "acknowledge", "strict_known", "steer"})
    project_variant_key = "layouts"
    packages = ("vllm",)
    cache_code = ("vllm.v1.core.kv_cache_manager", "vllm.v1.core.kv_cache_coordinator",
                  "vllm.v1.core.single_type_kv_cache_manager", "vllm.v1.core.block_pool",
                  "vllm.v1.core.kv_cache_utils", "vllm.v1.core.sched.scheduler")
    # block_pool is the one cache module every drive works through: building the engine and one
    # step reach 28.7-32.3 % of its run-time lines, 400 steps 42.6-47.5 % (vLLM 0.34.0; full,
    # full+swa, gemma3, deepseek-v3, qwen3-next; scheduler and manager drives)
    coverage_floor = {"vllm.v1.core.block_pool": 38.0}
    distribution = "vllm"
    release_range = ("0.14.1", "0.34.0")           # runtime.OLDEST, NEWEST (tests check they agree)
    install_script = "scripts/install-vllm.sh"

    def release(self) -> str | None:
        """The installed vLLM's version (package metadata: no import; whether its manager can
        be used here is `unsupported()`)."""
        from importlib import metadata
        try:
            return metadata.version("vllm")
        except metadata.PackageNotFoundError:
            return None

    def layouts(self) -> dict[str, str]:
        return dict(LAYOUTS)

    def unsupported(self) -> dict[str, str]:
        from .layouts import supported_layouts
        try:
            return {k: why for k, why in supported_layouts().items() if why}
        except VllmUnavailable as e:
            return {k: str(e) for k in LAYOUTS}

    def faults(self) -> tuple:
        return VLLM_FAULTS

    def checks(self) -> dict[str, str]:
        return {**{c: "safety" for c in SAFETY_CHECKS}, **{c: "bookkeeping" for c in BOOKKEEPING_CHECKS},
                "lost_reuse": "lost_reuse"}

    def known_defects(self) -> dict[str, Any]:
        from .known import defects
        return defects()

    def campaign(self, layout: str, *, budget_s: float | None, steps: int | None, seed: int,
                 fault: str | None, out_dir: str, **options: Any) -> dict[str, Any]:
        from .drivers import run_campaign
        options.setdefault("drive", "mixed")      # (the Ray shards' campaign: the manager drive)
        try:
            return run_campaign(layout, budget_s=budget_s, steps=steps, seed=seed, fault=fault,
                                out_dir=out_dir, **options)
        except VllmUnavailable as e:
            raise EngineUnavailable(str(e)) from None

    def replay(self, trace: Any) -> tuple[int, dict[str, Any], str]:
        from .drivers import replay
        try:
            res = replay(trace)
        except VllmUnavailable as e:
            raise EngineUnavailable(str(e)) from None
        text = ("on vLLM: " + ("reproduced: " + str(res.get("violation")) if res.get("reproduced")
                               else "not reproduced") + f" (exit {res['exit_code']})")
        return res["exit_code"], res, text

    def write_reproducer(self, trace: Any, trace_path: str) -> dict[str, Any]:
        if trace.meta.get("drive") == "engine":
            from .engine_repro import write_engine_reproducer
            return write_engine_reproducer(trace, trace_path)
        from .reproducer import write_reproducer
        return write_reproducer(trace, trace_path)

    def reuse_sizes(self, layout: str) -> dict[str, int]:
        from .reuse_replay import sizes
        return sizes(layout)

    def replay_reuse(self, layout: str, workloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from .reuse_replay import replay_reuse
        try:
            return replay_reuse(layout, workloads)
        except VllmUnavailable as e:
            raise EngineUnavailable(str(e)) from None

    def trace_workload(self, trace: Any) -> dict[str, Any] | None:
        from .trace_workload import trace_workload
        return trace_workload(trace)

    def fuzz_command(self, args: argparse.Namespace) -> int:
        from .cli import fuzz_command
        return fuzz_command(args)

    def project_system(self, variants: list[str] | None, body: Any, base: Path) -> tuple[list[str], dict[str, Any]]:
        from .project import project_system
        return project_system(variants, body, base)

    def project_run(self, system: Any, variant: str, seed: int, out: Path, fault: str | None = None) -> Any:
        from .project import run_vllm
        return run_vllm(system, variant, seed, out, fault)


ENGINE = VllmEngine()
