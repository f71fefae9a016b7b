"""Systems under test by name: `spec`, and `MODULE:CLASS` for a user's own adapter.

Owns turning the `--sut` argument into a factory of fresh SUT instances (one per run), with a
clear one-line error when it cannot.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

from ..fuzz import faults as faultlib
from ..spec.sut import SpecSUT, SystemUnderTest

BUILTIN = ("spec", "reference")
ALIASES = {"reference": "kvcheck.engines.reference.sut:ReferenceSUT"}


class SutError(ValueError):
    """`--sut` names nothing usable (exit code 2)."""


def resolve_sut(name: str, fault: str | None = None) -> Callable[[], SystemUnderTest]:
    if name == "spec":
        if fault is not None and faultlib.get(fault).layer != "spec":
            raise SutError(f"fault {fault!r} is a {faultlib.get(fault).layer} fault; "
                           "--sut spec plants spec faults only")
        return lambda: SpecSUT(fault)
    if name in ALIASES:
        target = ALIASES[name]
        mod_name, _, cls_name = target.partition(":")
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError) as e:
            raise SutError(f"the {name} system under test is not available: {e}") from None
        return _factory(cls, name, fault)
    if ":" not in name:
        raise SutError(f"unknown system under test {name!r}; use one of {', '.join(BUILTIN)} "
                       "or MODULE:CLASS")
    mod_name, _, cls_name = name.partition(":")
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
