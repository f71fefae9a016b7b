"""The toy engine as a kvcheck engine plugin: registered under the `kvcheck.engines` entry points
(pyproject.toml: `toyengine = "kvcheck_toyengine.engine:ENGINE"`), so `kvcheck engines` lists
it and `kvcheck fuzz --sut toyengine` drives its adapter (sut.py) with kvcheck's Hypothesis
machine, in lockstep with the spec. Listing it (release, layouts, faults) runs none of the
cache's code; kvcheck imports the adapter class only when it drives it (`sut_class`).
"""
from __future__ import annotations

from importlib import metadata

from kvcheck.fuzz.engine import Engine
from kvcheck.spec.config import Config
from kvcheck.spec.faults import Fault

from . import HASH_ONLY_HIT, LAYOUT_DIR

DIST = "kvcheck-toyengine"


class ToyEngine(Engine):
    name = "toyengine"
    summary = "a toy prefix cache (one full-attention layer) shipped as a third-party package; run it with --config LAYOUT"
    docs = "examples/kvcheck-toyengine/README.md"

    def release(self) -> str | None:
        try:
            return metadata.version(DIST)
        except metadata.PackageNotFoundError:       # imported from a source tree, not installed
            return None

    def layouts(self) -> dict[str, str]:
        """Its configs (kvcheck's config files shipped in the package) -> what each is."""
        out = {}
        for path in sorted(LAYOUT_DIR.glob("*.json")):
            c = Config.load(path)
            out[path.stem] = (f"--config {path} ({c.blocks} blocks, {c.requests} requests, "
                              f"{c.cap('swa_window')} pages, {c.max_active} active)")
        return out

    def faults(self) -> tuple[Fault, ...]:
        return (Fault(HASH_ONLY_HIT, "toyengine", "toyengine:PrefixCache.match", "stale reuse",
                      "hash_only_hit of kvcheck's examples/toy_allocator.py",
                      "decision_matches_spec",
                      "a prefix whose hashes are published is reused after its pages were evicted",
                      suts=("toyengine",)),)

    def sut_class(self) -> type:
        from .sut import ToyEngineSUT
        return ToyEngineSUT


ENGINE = ToyEngine()
