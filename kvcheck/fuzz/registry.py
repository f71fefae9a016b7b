"""The engine registry: every engine registered under the `kvcheck.engines` entry points.

kvcheck's own engines register exactly as a third party's package does (pyproject.toml's
`[project.entry-points."kvcheck.engines"]`), so `--sut NAME`, the fault registry, the gate and
`kvcheck engines` see both alike. An entry point that fails to load is recorded with its
error (shown by `kvcheck engines`), never a traceback, and does not hide the others.
"""
from __future__ import annotations

from importlib import metadata
from typing import Any

from .engine import Engine

GROUP = "kvcheck.engines"

_ENGINES: dict[str, Engine] | None = None
_ERRORS: dict[str, str] = {}
_EPOCH = [0]                           # bumped by reset(): what was derived from the engines is stale


class UnknownEngine(LookupError):
    """No registered engine has this name."""


def engines() -> dict[str, Engine]:
    """Registered engines by name, loaded once (entry-point order, kvcheck's own first)."""
    global _ENGINES
    if _ENGINES is None:
        found: dict[str, Engine] = {}
        eps = sorted(metadata.entry_points(group=GROUP),
                     key=lambda ep: (not ep.value.startswith("kvcheck."), ep.name))
        for ep in eps:
            try:
                obj: Any = ep.load()
                eng = obj() if isinstance(obj, type) else obj
                if not isinstance(eng, Engine):
                    raise TypeError(f"{ep.value} is a {type(eng).__name__}, not a kvcheck.fuzz.engine.Engine")
                if eng.name != ep.name:
                    raise ValueError(f"{ep.value} calls itself {eng.name!r}, registered as {ep.name!r}")
            except Exception as e:  # noqa: BLE001 - a broken plugin is reported, not fatal
                _ERRORS[ep.name] = f"{ep.value}: {type(e).__name__}: {e}"
                continue
            if ep.name in found:
                _ERRORS[ep.name] = f"{ep.value}: the name is taken by {type(found[ep.name]).__module__}"
                continue
            found[ep.name] = eng
        _ENGINES = found
    return _ENGINES


def load_errors() -> dict[str, str]:
    """Entry points that did not load -> why."""
    engines()
    return dict(_ERRORS)


def get(name: str) -> Engine:
    """The engine called `name`; UnknownEngine (with the known names) otherwise."""
    found = engines()
    if name not in found:
        why = f" ({_ERRORS[name]})" if name in _ERRORS else ""
        raise UnknownEngine(f"unknown engine {name!r}{why}; registered: {', '.join(found) or 'none'}")
    return found[name]


def legacy_module(module: str) -> str | None:
    """Where a module an old trace names (an earlier kvcheck's layout) lives now."""
    for eng in engines().values():
        for old, new in eng.legacy_modules.items():
            if module == old or module.startswith(old + "."):
                return new + module[len(old):]
    return None


def epoch() -> int:
    """How many times the registry was reset (caches built from it compare this)."""
    return _EPOCH[0]


def reset() -> None:
    """Forget what was loaded (tests that install or fake an engine)."""
    global _ENGINES
    _ENGINES = None
    _ERRORS.clear()
    _EPOCH[0] += 1
