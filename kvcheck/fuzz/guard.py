"""What a driver wraps around the lockstep core so that a SUT can neither crash kvcheck nor leave
a finding unexplained.

Owns: `GuardedSUT` (any exception a SUT raises, from any call — reset, apply, observe, its
hooks, close — is a finding `sut_raised` naming the call, never a traceback; ActionRejected,
the SUT's own findings and CannotDrive — an exception on kvcheck's side of the boundary, never
the engine's — pass through), `GuardedLockstep` (a finding raised while a negative probe
runs keeps the probe in its program, so that it replays and shrinks like any other) and
`ValuedSpecModel` (a state mismatch names each differing slot with both values:
`field: spec=… engine=…`).
"""
from __future__ import annotations

from typing import Any

from ..spec.state import VALUE_NAMES
from ..spec.sut import ActionRejected, SpecSUT, observed_mismatch
from .boundary import CannotDrive
from .lockstep import Finding, Lockstep, SpecModel

HOOKS = ("reset", "apply", "observe", "differential_check", "isolation_check", "extra_checks", "close")


def raised(call: str, e: BaseException) -> Finding:
    """The finding for a SUT that raised `e` in `call`."""
    msg = " ".join(str(e).split())[:300]
    return Finding("conformance", ["sut_raised"], f"{call}: the SUT raised {type(e).__name__}"
                   + (f": {msg}" if msg else ""))


class GuardedSUT:
    """A SUT whose every exception is a finding. Attributes and optional hooks are the wrapped
    SUT's (a hook it lacks is absent here too)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    @property
    def inner(self) -> Any:
        return self._inner

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name not in HOOKS or not callable(value):
            return value

        def call(*args: Any) -> Any:
            try:
                return value(*args)
            except (ActionRejected, Finding, CannotDrive):
                raise
            except Exception as e:  # noqa: BLE001 - whatever the SUT raises is a finding
                raise raised(_label(name, args), e) from None
        return call


def guard(sut: Any) -> Any:
    """`sut` behind GuardedSUT (the spec itself as SUT is kvcheck's own code: left as it is)."""
    return sut if isinstance(sut, (SpecSUT, GuardedSUT)) else GuardedSUT(sut)


def _label(name: str, args: tuple) -> str:
    if name in ("apply", "extra_checks", "differential_check") and len(args) == 2 and isinstance(args[1], dict):
        inner = ", ".join(f"{k}={v}" for k, v in args[1].items())
        return f"{args[0]}({inner})" + ("" if name == "apply" else f" in {name}")
    return f"{name}()"


class GuardedLockstep(Lockstep):
    """The core, with a probe's own finding stamped with the probe in the program and the trail
    (the core records a probe only after the SUT took it)."""

    def probe(self, x: Any) -> bool:
        n = len(self.program)
        try:
            return super().probe(x)
        except Finding as f:
            if len(self.program) == n:          # raised by the SUT while it applied the probe
                self.program.append(x)
                self.trail.append((x.action, dict(x.params)))
                raise self.fail(f) from None
            raise

    def close(self) -> None:
        try:
            super().close()
        except Finding as f:
            if not self.failed:
                raise self.fail(f) from None


class ValuedSpecModel(SpecModel):
    """The spec as the model, naming both values of every slot where the SUT's state differs."""

    def mismatch(self, seen: Any, s: tuple) -> list[str]:
        out = []
        for i in observed_mismatch(seen, s):
            key = self.names[i]
            out.append(f"{'.'.join(map(str, key))}: spec={_value(key[-1], s[i])} engine={_value(key[-1], seen[i])}")
        return out


def _value(field: str, v: Any) -> str:
    names = VALUE_NAMES.get(field, ())
    return names[v] if isinstance(v, int) and 0 <= v < len(names) else repr(v)
