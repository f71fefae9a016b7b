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

_BUILT: tuple[int, Registry] | None = None      # (registry epoch, faults)
ERRORS: dict[str, str] = {}            # engines whose faults could not be read -> why


def _registry() -> Registry:
    """The spec's faults and every engine's whose declarations are sound; an engine whose
    `faults()` raises, or names a fault another provider has, is left out and recorded in
    ERRORS (shown by `kvcheck faults`), so one broken plugin cannot break `--fault` for all."""
    global _BUILT
    if _BUILT is None or _BUILT[0] != engine_registry.epoch():
        ERRORS.clear()
        providers: dict[str, Any] = {}
        seen = {f.name: "spec" for f in spec_faults()}
        for name, eng in engine_registry.engines().items():
            try:
                got = tuple(eng.faults())
                for f in got:
                    if not isinstance(f, Fault):
                        raise TypeError(f"{f!r} is not a kvcheck.spec.faults.Fault")
                    if f.provider != name:
                        raise ValueError(f"fault {f.name!r} is declared by {f.provider!r}")
                    if f.name in seen:
                        raise ValueError(f"fault {f.name!r} is already declared by {seen[f.name]!r}")
            except Exception as e:  # noqa: BLE001 - a plugin's broken declarations: recorded
                ERRORS[name] = f"{type(e).__name__}: {e}"
                continue
            seen.update({f.name: name for f in got})
            providers[name] = (lambda got=got: got)
        _BUILT = (engine_registry.epoch(), Registry(providers))
    return _BUILT[1]


def get(name: str) -> Fault:
    """A fault by name, from whichever provider declares it."""
    return _registry().get(name)


def __getattr__(name: str) -> Any:
    if name == "FAULTS":              # every fault by name, loaded on first use
        return _registry().all()
    if name == "REGISTRY":            # built from the engine registry on first use
        return _registry()
    raise AttributeError(name)
