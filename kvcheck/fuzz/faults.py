"""The one fault registry: every planted fault, from the spec and the registered engines.

Owns where fault declarations come from: the spec's own (spec/faults.py) and each engine's
`Engine.faults()` (fuzz/engine.py; the reference engine, vLLM, transformers, SGLang and any
third-party engine registered under the `kvcheck.engines` entry points). A user's
`MODULE:CLASS` SUT declares its own in a class attribute `faults` ({name: expected check}),
checked where the SUT is resolved (checker/common.check_sut_fault). Providers are loaded on
first use, nothing registers itself on import. `kvcheck faults`, `--fault` and `kvcheck
mutants` read faults from here, so a misspelled name is an error everywhere.
"""
from __future__ import annotations

from typing import Any

from ..spec.faults import Fault, FaultError, Planted, Registry, UnknownFault, spec_faults
from . import registry as engine_registry

__all__ = ["Fault", "FaultError", "Planted", "REGISTRY", "UnknownFault", "get", "spec_faults",
           ]                       # and FAULTS (every fault by name, loaded on first use)

_BUILT: Registry | None = None


def _registry() -> Registry:
    global _BUILT
    if _BUILT is None:
        _BUILT = Registry({name: eng.faults for name, eng in engine_registry.engines().items()})
    return _BUILT


def get(name: str) -> Fault:
    """A fault by name, from whichever provider declares it."""
    return _registry().get(name)


def __getattr__(name: str) -> Any:
    if name == "FAULTS":              # every fault by name, loaded on first use
        return _registry().all()
    if name == "REGISTRY":            # built from the engine registry on first use
        return _registry()
    raise AttributeError(name)
