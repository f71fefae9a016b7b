"""Which side of the engine boundary an exception comes from: the engine's, or kvcheck's.

kvcheck drives an engine's own code with objects it builds (stand-in requests, server args,
CPU stand-ins for GPU modules) and calls it with the signatures of the releases it knows. A new
release can break that contract, and the exception then says nothing about the engine: a
stand-in lacks a method the release now calls, kvcheck passes a keyword the release dropped,
reads an attribute the release renamed. Reported as the engine's bug it would send a team
chasing a defect that does not exist, so it is a verdict of its own, "cannot drive" (exit 3),
naming the release, what kvcheck relied on and where.

The side is decided from where the exception was raised and on what, never from a list of
messages (`blame`):
- the innermost frame that belongs to kvcheck or to the engine (stdlib and torch frames are
  skipped) is kvcheck's: kvcheck's side (its call did not fit, its own code failed);
- it is the engine's, and the exception is an AttributeError read from an object kvcheck made
  (its type is defined in a kvcheck module, or a module kvcheck stood in): kvcheck's side;
- it is the engine's, and a TypeError names a method of a kvcheck type found among that frame's
  locals (the engine called a stand-in with arguments it does not take): kvcheck's side;
- anything else raised in the engine's own code is the engine's, and stays a finding.
Setting an engine up (before the first step) has no steps to report, so any failure there that
is not an "unavailable" error is kvcheck's side as well (`setting_up`).

`preflight` checks, before a campaign, what the adapter relies on against the installed release
(modules and attributes, the keywords it passes, what the engine reads off its stand-ins), so
most mismatches are reported before the first step.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import linecache
import re
import sys
import textwrap
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..spec.verdict import ExitCode

_ROOT = Path(__file__).resolve().parents[1]          # the kvcheck package


class CannotExpress(ValueError):
    """The release, driven this way, has no way to build what was asked (a layout whose block
    sizes its engine derives otherwise, a layout the drive does not run): not run, not a finding,
    and not kvcheck failing either. `kvcheck fuzz` exits 2 with the line (its JSON says
    ``cannot_express``); `kvcheck matrix` shows the cell as "cannot express"."""


class CannotDrive(Exception):
    """kvcheck cannot drive this release: an exception on kvcheck's side of the boundary."""

    def __init__(self, engine: str, release: str | None, what: str, where: str) -> None:
        self.engine, self.release, self.what, self.where = engine, release, what, where
        super().__init__(self.line)

    @property
    def line(self) -> str:
        return (f"kvcheck cannot drive {self.engine} {self.release or '(release unknown)'}: {self.what} "
                f"(kvcheck relies on it at {self.where}); not a finding about {self.engine}")

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "release": self.release, "what": self.what, "where": self.where,
                "line": self.line}

    def result(self, **base: Any) -> dict[str, Any]:
        """A campaign result for it: nothing decided (exit 3), no finding."""
        return {**base, "findings": [], "cannot_drive": self.to_dict(), "exit_code": int(ExitCode.UNDECIDED)}


class StandIn(types.SimpleNamespace):
    """A kvcheck stand-in for an engine object (a scheduler's `self`, server args): a
    SimpleNamespace whose type says it is kvcheck's, so that a release reading a field it
    lacks is "cannot drive" (`is_kvcheck_object`), not the engine's bug."""


# ---- whose frame, whose object ------------------------------------------------------------
def _module_of(frame: types.FrameType) -> str:
    return str(frame.f_globals.get("__name__") or "")


def _owner(module: str, packages: tuple[str, ...]) -> str | None:
    top = module.split(".", 1)[0]
    if top == "kvcheck":
        return "kvcheck"
    if top in packages:
        return "engine"
    return None


def _short(filename: str) -> str:
    try:
        return str(Path(filename).resolve().relative_to(_ROOT.parent))
    except ValueError:
        parts = Path(filename).parts
        return "/".join(parts[-3:])


def _at(frame: types.FrameType, lineno: int) -> str:
    return f"{_short(frame.f_code.co_filename)}:{lineno} ({frame.f_code.co_name})"


def is_kvcheck_object(obj: Any) -> bool:
    """An object kvcheck made: an instance of a type defined in kvcheck, a kvcheck module, or
    a module kvcheck stood in for the engine (install.py's KVCHECK_CPU_STUB modules)."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__.split(".", 1)[0] == "kvcheck" or bool(getattr(obj, "KVCHECK_CPU_STUB", False))
    t = obj if isinstance(obj, type) else type(obj)
    return str(getattr(t, "__module__", "")).split(".", 1)[0] == "kvcheck"


def _defined_at(obj: Any) -> str:
    t = obj if isinstance(obj, (type, types.ModuleType, types.FunctionType)) else type(obj)
    try:
        _, line = inspect.getsourcelines(t)      # type: ignore[arg-type]
        return f"{_short(inspect.getsourcefile(t) or '?')}:{line}"  # type: ignore[arg-type]
    except (OSError, TypeError):
        return getattr(t, "__module__", None) or getattr(t, "__name__", "?")


def _frames(exc: BaseException) -> list[tuple[types.FrameType, int]]:
    out, tb = [], exc.__traceback__
    while tb is not None:
        out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out


def frame_at(exc: BaseException, top: str | None = None, first: bool = False) -> tuple[str, str] | None:
    """(module, "file:line (function)") of the last (`first`: the first) frame of `exc`'s
    traceback whose module is in the top-level package `top` (any module when None)."""
    got = [(f, n) for f, n in _frames(exc) if top is None or _module_of(f).split(".", 1)[0] == top]
    if not got:
        return None
    f, n = got[0] if first else got[-1]
    return _module_of(f), _at(f, n)


def blame(exc: BaseException, packages: tuple[str, ...]) -> tuple[str, str] | None:
    """(what, where) when `exc` comes from kvcheck's side of the boundary with an engine whose
    top-level packages are `packages`; None when it is the engine's own."""
    owned = [(f, n, o) for f, n in _frames(exc) if (o := _owner(_module_of(f), packages))]
    what = f"{type(exc).__name__}: {exc}"
    if not owned:
        return None
    frame, lineno, owner = owned[-1]
    if owner == "kvcheck":
        return what, _at(frame, lineno)
    obj = getattr(exc, "obj", None) if isinstance(exc, AttributeError) else None
    if isinstance(exc, (ImportError, NameError)):     # the release cannot run in kvcheck's CPU setting
        return (f"{what}: the release's code cannot run in kvcheck's environment here "
                f"(at {_at(frame, lineno)})", _at(frame, lineno))
    if obj is not None and is_kvcheck_object(obj):
        name = getattr(obj, "__name__", None) if isinstance(obj, types.ModuleType) else type(obj).__qualname__
        return (f"the release reads {exc.name!r} from kvcheck's {name}, which has none "
                f"(at {_at(frame, lineno)})", _defined_at(obj))
    if isinstance(exc, TypeError):
        for v in list(frame.f_locals.values()):
            if is_kvcheck_object(v) and not isinstance(v, types.ModuleType):
                t = v if isinstance(v, type) else type(v)
                if str(exc).startswith(f"{t.__qualname__}."):
                    return (f"the release calls kvcheck's {t.__qualname__} in a way it does not take: {exc} "
                            f"(at {_at(frame, lineno)})", _defined_at(t))
        fn = _kvcheck_function_named(frame, str(exc))
        if fn is not None:          # a wrapper kvcheck put on an engine object (a planted fault, a probe)
            return (f"the release calls kvcheck's {fn.__qualname__} in a way it does not take: {exc} "
                    f"(at {_at(frame, lineno)})", _defined_at(fn))
        called = _kvcheck_call_refused(exc)
        if called is not None:      # kvcheck's call, refused by the release's signature (through its wrapper)
            return (f"kvcheck calls the release's {called[0]} in a way it does not take: {exc}", called[1])
    return None


_SIGNATURE = re.compile(r"^([\w.<>]+)\(\) (?:got an unexpected keyword argument|missing \d+ required|takes \d+|"
                        r"got multiple values for argument)")


def _kvcheck_call_refused(exc: BaseException) -> tuple[str, str] | None:
    """(callee, where) when `exc` is a call-signature TypeError for a function that kvcheck's
    innermost frame calls on its current line: the engine frames after it are a pass-through
    wrapper (a decorator) that handed kvcheck's arguments on. Engine code calling its own
    function wrongly raises with the engine's line calling it, not kvcheck's."""
    m = _SIGNATURE.match(str(exc))
    mine = [(f, n) for f, n in _frames(exc) if _module_of(f).split(".", 1)[0] == "kvcheck"]
    if not m or not mine:
        return None
    f, n = mine[-1]
    line = linecache.getline(f.f_code.co_filename, n)
    name = m.group(1).rsplit(".", 1)[-1]
    return (m.group(1), _at(f, n)) if re.search(rf"\.{re.escape(name)}\(", line) else None


def _kvcheck_function_named(frame: Any, message: str) -> Any:
    """A kvcheck-defined function the failing engine frame can reach (a local, or one set on a
    local object's instance dict: a wrapper kvcheck installed) that a TypeError message names as
    the callee ("Qual.name() got an unexpected keyword argument ...")."""
    seen: list[Any] = []
    for v in list(frame.f_locals.values()):
        seen.append(v)
        d = getattr(v, "__dict__", None)
        if isinstance(d, dict) and not isinstance(v, (type, types.ModuleType)):
            seen.extend(list(d.values()))
    for f in seen:
        if isinstance(f, types.FunctionType) and (f.__module__ or "").split(".")[0] == "kvcheck" \
                and message.startswith(f"{f.__qualname__}("):
            return f
    return None


def as_cannot_drive(exc: BaseException, engine: str, release: str | None,
                    packages: tuple[str, ...]) -> CannotDrive | None:
    """CannotDrive for `exc` when it is kvcheck's side, else None (the engine's own)."""
    if isinstance(exc, CannotDrive):
        return exc
    got = blame(exc, packages)
    return None if got is None else CannotDrive(engine, release, *got)


def check_exception(exc: BaseException, engine: str, release: str | None, packages: tuple[str, ...]) -> None:
    """Raise CannotDrive (from `exc`) when it is kvcheck's side; return when it is the engine's."""
    cd = as_cannot_drive(exc, engine, release, packages)
    if cd is exc:
        raise cd
    if cd is not None:
        raise cd from exc


@contextmanager
def setting_up(engine: str, release: Callable[[], str | None], packages: tuple[str, ...],
               passthrough: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Building the engine's objects for a run: any exception but `passthrough` (the engine's
    "unavailable here" errors, usage errors) is kvcheck's side (nothing was stepped yet)."""
    try:
        yield
    except passthrough:
        raise
    except CannotDrive:
        raise
    except Exception as e:  # noqa: BLE001 - classified: kvcheck's side while setting up
        got = blame(e, packages)
        frames = _frames(e)
        where = got[1] if got else (_at(*frames[-1]) if frames else "?")
        what = got[0] if got else f"{type(e).__name__}: {e} (while kvcheck set the engine up)"
        raise CannotDrive(engine, _safe(release), what, where) from e


def _safe(release: Callable[[], str | None]) -> str | None:
    try:
        return release()
    except Exception:  # noqa: BLE001 - the release is only named in the message
        return None


def assign(obj: Any, **fields: Any) -> None:
    """Set fields kvcheck keeps on an engine's own object (a real request, say). A field the
    object does not have means the release renamed or dropped it: setting it anyway would be
    silently ignored by the engine (and the run judge a state kvcheck never built), so it is
    an AttributeError raised here, on kvcheck's side (`blame`: "cannot drive")."""
    missing = [k for k in fields if not hasattr(obj, k)]
    if missing:
        raise AttributeError(f"{type(obj).__qualname__} of this release has no {', '.join(missing)} "
                             f"(kvcheck sets {'them' if len(missing) > 1 else 'it'})")
    for k, v in fields.items():
        setattr(obj, k, v)


# ---- the pre-flight interface check --------------------------------------------------------
@dataclass(frozen=True)
class Needs:
    """What an adapter relies on in the engine: `target` "module" or "module:Qual.name"
    exists; with `keywords`, the callable takes them; with `reads` = (param, stand-in factory),
    every attribute the callable (and the methods of its class it hands that parameter to)
    reads off `param` exists on the stand-in the factory builds."""
    target: str
    keywords: tuple[str, ...] = ()
    reads: tuple[str, Callable[[], Any]] | None = None
    where: str = ""                  # the kvcheck code that relies on it (file:line or name)
    optional_attrs: frozenset[str] = field(default_factory=frozenset)


def resolve(target: str) -> Any:
    mod, _, qual = target.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in [p for p in qual.split(".") if p]:
        obj = getattr(obj, part)
    return obj


def attributes_read(fn: Any, param: str, depth: int = 3) -> set[str]:
    """Attributes `fn` reads off its parameter `param` (`param.x`, `param.f()`), following it
    into methods of the same class it is passed to (`self.m(param)`), `depth` calls deep."""
    fn = inspect.unwrap(fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return set()
    owner = _owner_class(fn)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == param:
            out.add(node.attr)
        if depth and owner is not None and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
            callee = getattr(owner, node.func.attr, None)
            if callee is None or not callable(callee):
                continue
            pos = [i for i, a in enumerate(node.args) if isinstance(a, ast.Name) and a.id == param]
            kws = [k.arg for k in node.keywords if isinstance(k.value, ast.Name) and k.value.id == param]
            try:
                names = [p for p in inspect.signature(callee).parameters if p != "self"]
            except (TypeError, ValueError):
                continue
            for name in [names[i] for i in pos if i < len(names)] + [k for k in kws if k]:
                out |= attributes_read(callee, name, depth - 1)
    return out


def _owner_class(fn: Any) -> type | None:
    qual = getattr(fn, "__qualname__", "")
    mod = sys.modules.get(getattr(fn, "__module__", "") or "")
    if "." not in qual or mod is None:
        return None
    obj: Any = mod
    for part in qual.split(".")[:-1]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, type) else None


def preflight(needs: list[Needs]) -> list[tuple[str, str]]:
    """The gaps: (what, where) for each thing relied on that the installed release lacks."""
    gaps: list[tuple[str, str]] = []
    for n in needs:
        try:
            obj = resolve(n.target)
        except (ImportError, AttributeError) as e:
            gaps.append((f"{n.target} is missing ({type(e).__name__}: {e})", n.where))
            continue
        if n.keywords:
            try:
                params = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                params = {}
            if params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                missing = [k for k in n.keywords if k not in params]
                if missing:
                    gaps.append((f"{n.target} takes no keyword {', '.join(map(repr, missing))} "
                                 f"(its signature: {inspect.signature(obj)})", n.where))
        if n.reads is not None:
            param, factory = n.reads
            standin = factory()
            lacking = sorted(a for a in attributes_read(obj, param) - n.optional_attrs
                             if not hasattr(standin, a))
            if lacking:
                gaps.append((f"{n.target} reads {', '.join(lacking)} off {param!r}, which kvcheck's "
                             f"{type(standin).__qualname__} ({_defined_at(standin)}) lacks", n.where))
    return gaps


def require(needs: list[Needs], engine: str, release: str | None) -> None:
    """Raise CannotDrive for the first gap `preflight` finds (all of them in the message)."""
    gaps = preflight(needs)
    if gaps:
        what = "; ".join(g[0] for g in gaps[:3]) + (f"; and {len(gaps) - 3} more" if len(gaps) > 3 else "")
        raise CannotDrive(engine, release, what, gaps[0][1] or "the adapter")
