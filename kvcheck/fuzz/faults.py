"""The one fault registry: every planted fault, from explicit providers.

Owns which systems under test plant faults and where their declarations live: the spec's
own (spec/faults.py), the reference engine's (reference/faults.py), the vLLM, transformers and SGLang
adapters', and a
user's `MODULE:CLASS` SUT declares its own in a class attribute `faults` ({name: expected
check}), checked where the SUT is resolved (checker/common.check_sut_fault). Providers are
loaded on first use, nothing registers itself on import. `kvcheck faults`, `--fault` and
`kvcheck mutants` read faults from here, so a misspelled name is an error everywhere.
"""
from __future__ import annotations

from typing import Any

from ..spec.faults import Fault, FaultError, Planted, Registry, UnknownFault, spec_faults

__all__ = ["Fault", "FaultError", "Planted", "REGISTRY", "UnknownFault", "get", "spec_faults",
           ]                       # and FAULTS (every fault by name, loaded on first use)


def _reference() -> tuple[Fault, ...]:
    from ..reference.faults import ENGINE_FAULTS
    return ENGINE_FAULTS


def _vllm() -> tuple[Fault, ...]:
    from kvcheck.engines.vllm.layouts import VLLM_FAULTS      # imports without vLLM installed
    return VLLM_FAULTS


def _transformers() -> tuple[Fault, ...]:
    from kvcheck.engines.transformers.cache import TRANSFORMERS_FAULTS     # imports without transformers
    return TRANSFORMERS_FAULTS


def _sglang() -> tuple[Fault, ...]:
    from kvcheck.engines.sglang.layouts import SGLANG_FAULTS         # imports without SGLang installed
    return SGLANG_FAULTS


REGISTRY = Registry({"reference": _reference, "vllm": _vllm, "transformers": _transformers,
                     "sglang": _sglang})


def get(name: str) -> Fault:
    """A fault by name, from whichever provider declares it."""
    return REGISTRY.get(name)


def __getattr__(name: str) -> Any:
    if name == "FAULTS":              # every fault by name, loaded on first use
        return REGISTRY.all()
    raise AttributeError(name)
