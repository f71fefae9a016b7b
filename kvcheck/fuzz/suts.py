"""Systems under test by name: `spec`, a registered engine with a SUT class (`reference`, a
third party's), and `MODULE:CLASS` for a user's own adapter.

Owns turning the `--sut` argument into a factory of fresh SUT instances (one per run), with a
clear one-line error when it cannot. A `MODULE:CLASS` whose module an earlier kvcheck had
(kvcheck.fuzz.adapters..., kvcheck.reference.adapter) resolves to where it lives now, through the
engines' `legacy_modules`, so old traces still replay.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

from ..fuzz import faults as faultlib
from ..spec.sut import SpecSUT, SystemUnderTest

from . import registry


class SutError(ValueError):
    """`--sut` names nothing usable (exit code 2)."""


def resolve_sut(name: str, fault: str | None = None) -> Callable[[], SystemUnderTest]:
    if name == "spec":
        if fault is not None and faultlib.get(fault).layer != "spec":
            raise SutError(f"fault {fault!r} is a {faultlib.get(fault).layer} fault; "
                           "--sut spec plants spec faults only")
        return lambda: SpecSUT(fault)
    if ":" not in name:
        try:
            eng = registry.get(name)
        except registry.UnknownEngine as e:
            raise SutError(f"unknown system under test {name!r}: {e}; or spec, or MODULE:CLASS") from None
        try:
            cls = eng.sut_class()
        except Exception as e:  # noqa: BLE001 - an engine that cannot load here: one line
            raise SutError(f"the {name} system under test is not available: {type(e).__name__}: {e}") from None
        if cls is None:
            raise SutError(f"--sut {name}: the engine runs its own driver (kvcheck fuzz --sut {name}), "
                           "not a SUT class for the Hypothesis machine")
        return _factory(cls, name, fault)
    mod_name, _, cls_name = name.partition(":")
    mod_name = registry.legacy_module(mod_name) or mod_name
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module
        raise SutError(f"cannot import {mod_name!r} for --sut {name}: {type(e).__name__}: {e}") from None
    cls = getattr(mod, cls_name, None)
    if cls is None:
        raise SutError(f"module {mod_name!r} has no {cls_name!r} (--sut {name})")
    if not isinstance(cls, type):
        raise SutError(f"--sut {name}: {cls_name!r} is a {type(cls).__name__}, not a class")
    return _factory(cls, name, fault)


def sut_class(name: str) -> type:
    """The class behind `--sut MODULE:CLASS` (to read what it declares, e.g. its faults)."""
    return resolve_sut(name).cls          # type: ignore[attr-defined]


def _factory(cls: type, name: str, fault: str | None) -> Callable[[], SystemUnderTest]:
    """Fresh instances; a constructor that raises is a broken `--sut` (exit 2), not a finding."""
    def make() -> SystemUnderTest:
        try:
            return cls(fault=fault) if fault is not None else cls()
        except Exception as e:  # noqa: BLE001 - any failure is the user's constructor
            raise SutError(f"--sut {name}: constructing {cls.__name__} raised "
                           f"{type(e).__name__}: {e}") from None
    make.cls = cls                        # type: ignore[attr-defined]
    return make
