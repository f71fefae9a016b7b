"""SGLang as a registered engine: its radix caches (full, SWA with tombstones, Mamba, HiCache,
ChunkCache, UnifiedRadixCache) on CPU through its own scheduler calls, on the lockstep core
(drivers.py, docs/adapters-sglang.md). SGLang itself is imported lazily."""
from __future__ import annotations

import argparse
from typing import Any

from kvcheck.fuzz.engine import Engine, EngineUnavailable

from .install import SglangUnavailable
from .layouts import LAYOUTS, SGLANG_FAULTS, LayoutError

MODULES = ("adapter", "checks", "chunk", "compat", "hicache", "incremental", "install", "layouts", "mamba",
           "mamba_state", "repro_chunk", "repro_classes", "repro_mamba", "repro_mamba_run", "repro_mamba_sched",
           "repro_sched", "repro_stubs", "repro_template", "repro_views", "reproducer", "sched", "sched_req",
           "steps", "swa", "unified", "unified_checks", "unified_diff", "unified_mamba", "unified_mamba_checks")


class SglangEngine(Engine):
    name = "sglang"
    summary = "SGLang's radix caches (full, SWA, Mamba, HiCache, chunk, unified) through its own scheduler calls"
    docs = "docs/adapters-sglang.md"
    legacy_modules = {"kvcheck.fuzz.adapters.sglang": "kvcheck.engines.sglang.drivers"} | {
        f"kvcheck.fuzz.adapters.sglang_{m}": f"kvcheck.engines.sglang.{m}" for m in MODULES}
    fuzz_options = frozenset({"layout", "list_layouts", "layout_file", "acknowledge", "strict_known", "steer"})
    packages = ("sglang",)
    # (the modules moved between releases: each release measures the ones it has)
    cache_code = tuple(f"sglang.srt.mem_cache.{m}" for m in (
        "radix_cache", "swa_radix_cache", "pure_swa_radix_cache", "mamba_radix_cache", "chunk_cache",
        "hiradix_cache", "unified_radix_cache", "unified_cache.unified_tree_core_interface", "base_prefix_cache",
        "evict_policy", "common", "memory_pool", "allocator", "allocator.paged", "allocator.token",
        "allocator.swa", "allocator.mamba", "swa_memory_pool"))
    distribution = "sglang"
    release_range = ("0.4.10", "0.5.23")           # install.OLDEST, NEWEST (tests check they agree)
    install_script = "scripts/install-sglang.sh"

    def release(self) -> str | None:
        from .install import sglang_version
        try:
            return sglang_version()
        except SglangUnavailable:
            return None

    def layouts(self) -> dict[str, str]:
        return {name: lay.cls for name, lay in LAYOUTS.items()}

    def unsupported(self) -> dict[str, str]:
        from .layouts import list_layouts
        return {x["name"]: x["reason"] for x in list_layouts() if x.get("name") and not x["supported"]}

    def faults(self) -> tuple:
        return SGLANG_FAULTS

    def known_defects(self) -> dict[str, Any]:
        from .drivers import known_defects
        return known_defects()

    def campaign(self, layout: str, *, budget_s: float | None, steps: int | None, seed: int,
                 fault: str | None, out_dir: str, **options: Any) -> dict[str, Any]:
        from .drivers import run_campaign
        try:
            return run_campaign(layout, budget_s=budget_s, steps=steps, seed=seed, fault=fault, out_dir=out_dir,
                                steer=options.get("steer"))
        except (SglangUnavailable, LayoutError) as e:
            raise EngineUnavailable(str(e)) from None

    def replay(self, trace: Any) -> tuple[int, dict[str, Any], str]:
        from .drivers import replay
        try:
            res = replay(trace)
        except (SglangUnavailable, LayoutError) as e:
            raise EngineUnavailable(str(e)) from None
        text = (f"on SGLang {res['sglang_version']}: "
                + ("reproduced " + str(res["expected"]) if res["reproduced"] else "not reproduced")
                + f" (exit {res['exit_code']})"
                + (f"; it left the trace at step {res['divergence']['step']} `{res['divergence']['action']}`: "
                   f"{res['divergence']['why']}" if res.get("divergence") else ""))
        return res["exit_code"], res, text

    def write_reproducer(self, trace: Any, trace_path: str) -> dict[str, Any]:
        from .reproducer import write_reproducer
        return write_reproducer(trace, trace_path)

    def reuse_sizes(self, layout: str) -> dict[str, int]:
        from .reuse_replay import sizes
        return sizes(layout)

    def replay_reuse(self, layout: str, workloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from .reuse_replay import replay_reuse
        try:
            return replay_reuse(layout, workloads)
        except (SglangUnavailable, LayoutError) as e:
            raise EngineUnavailable(str(e)) from None

    def trace_workload(self, trace: Any) -> dict[str, Any] | None:
        from .trace_workload import trace_workload
        return trace_workload(trace)

    def fuzz_command(self, args: argparse.Namespace) -> int:
        from .cli import fuzz_command
        return fuzz_command(args)


ENGINE = SglangEngine()
