"""What every command shares: bad input as one line, output, progress, and checks on paths.

Owns `UsageError` (one line on stderr, exit 2), `emit` (text or `--json`), the transient
progress bar, loading `--config`, and the up-front checks that an output path can be written
and a planted fault applies to the engine asked for, so that a run never fails after the work.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from ..fuzz import faults as faultlib
from ..spec.config import Config
from ..spec.outputs import probe_writable

# Which system under test plants the faults of a layer (for messages that say where to go).


class UsageError(Exception):
    """Bad input: one line on stderr, exit 2."""


def emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    from ..fuzz.engine_coverage import attach
    cover = attach(data)               # `kvcheck fuzz --cover`: the engine code the run reached
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print("\n".join([text(), *cover]))


def load_config(args: argparse.Namespace) -> Config:
    return Config.load(getattr(args, "config", None))


def progress_enabled(args: argparse.Namespace) -> bool:
    return not args.json and sys.stderr.isatty() and not os.environ.get("CI")


@contextmanager
def progress(args: argparse.Namespace, label: str) -> Iterator[Callable[..., None] | None]:
    """A transient progress bar on a terminal; None (quiet) in CI, in pipes and with --json.
    The callback takes (completed, total=None) or a description string."""
    if not progress_enabled(args):
        yield None
        return
    from rich.progress import Progress
    bar = Progress(transient=True)
    bar.start()
    task = bar.add_task(label, total=None)

    def update(done: int | str, total: int | None = None) -> None:
        if isinstance(done, str):
            bar.update(task, description=done)
        else:
            bar.update(task, completed=done, total=total)
    try:
        yield update
    finally:
        bar.stop()


def check_writable(out: Path, what: str = "output directory") -> None:
    """`out` is (or can be made) a directory this process can create files in (two runs
    sharing it never race: spec.outputs.probe_writable)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{what} {out} is a file, not a directory")
    try:
        probe_writable(out)
    except OSError as e:
        why = e.strerror or str(e)
        if e.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS):
            why = f"cannot create files there ({why})"
        raise UsageError(f"cannot write to {what} {out}: {why}") from None


def check_out_file(path: Path, what: str, suffixes: tuple[str, ...] = ()) -> None:
    """An output file: not a directory, with a known suffix, in an existing writable directory
    (an output *directory* such as --out is created; a file's directory is the user's: a typo in
    it must not silently create a tree somewhere else)."""
    if path.is_dir():
        raise UsageError(f"{what} {path} is a directory; give a file name")
    if suffixes and path.suffix not in suffixes:
        raise UsageError(f"{what} {path}: unknown format {path.suffix or '(no suffix)'!r}; "
                         f"use {' or '.join(suffixes)}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{what} {path}: directory {parent} does not exist")
    check_writable(parent, f"{what}'s directory")


def check_fault(name: str, layers: tuple[str, ...], where: str) -> faultlib.Fault:
    """A known fault (the one registry) of one of `layers`; otherwise one line saying which SUT
    plants it."""
    f = faultlib.get(name)
    if f.layer not in layers:
        raise UsageError(f"fault {name!r} is a{'n' if f.layer[0] in 'aeiou' else ''} {f.layer} fault"
                         f" (planted by --sut {' or '.join(f.suts)})"
                         f"; {where} plants {' or '.join(layers)} faults")
    return f


def check_sut_fault(sut: str, fault: str) -> None:
    """Spec faults for --sut spec, engine faults for --sut reference; a user SUT declares its
    own in a `faults` dict."""
    if sut in ("spec", "reference"):
        check_fault(fault, ("spec",) if sut == "spec" else ("engine",), f"--sut {sut}")
        return
    from ..fuzz.suts import SutError, sut_class
    try:
        cls = sut_class(sut)
    except SutError:
        return                      # resolve_sut says what is wrong with the name
    known = getattr(cls, "faults", {}) or {}
    if ":" not in sut and not isinstance(known, dict):     # a registered engine's own Fault records
        known = {}
    if ":" not in sut:              # a registered engine: its declared faults count too
        from ..fuzz import registry
        known = dict(known, **{f.name: f.expected for f in registry.get(sut).faults()})
    if not isinstance(known, dict) or fault not in known:
        raise UsageError(f"unknown fault {fault!r} for --sut {sut}; it declares: "
                         + (", ".join(sorted(known)) if isinstance(known, dict) and known else "none"))


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (and exit 2), like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def nonneg_int(text: str) -> int:
    return _int_at_least(text, 0, "a non-negative integer")


def _int_at_least(text: str, lo: int, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
    return v


def steering(args: argparse.Namespace, engine: str) -> Any:
    """`--steer NAME` (fuzz/steer.py) for the engine's own driver: its Steer over the engine's
    cache code, or None (not given: the driver's default). Unknown names and --ray (the shards
    keep no shared corpus) are refused in one line."""
    name = getattr(args, "steer", None)
    if name is None:
        return None
    from ..fuzz import registry
    from ..fuzz.steer import STEERS, Steer
    if name not in STEERS:
        raise UsageError(f"--steer: unknown strategy {name!r}; known: {', '.join(STEERS)}")
    if getattr(args, "ray", None) is not None:
        raise UsageError("--steer: the Ray shards run fresh random episodes only (drop --ray or --steer)")
    try:
        return Steer(name, args.seed, registry.get(engine).cache_code)
    except (ValueError, ImportError) as e:
        raise UsageError(str(e)) from None


@contextmanager
def covering(args: argparse.Namespace, eng: Any, command: str) -> Iterator[None]:
    """`--cover`: measure the engine's cache code (fuzz/engine_coverage.py) while the body runs
    the engine's own driver; `emit` attaches the result. Refused (exit 2) where the engine
    declares no cache code. Without --cover, nothing."""
    if not getattr(args, "cover", False):
        yield
        return
    from ..fuzz import registry
    from ..fuzz.engine_coverage import CoverageUnavailable, abandon, begin
    if eng is None or not eng.cache_code:
        takers = sorted(n for n, e in registry.engines().items() if e.cache_code)
        raise UsageError(f"--cover applies to --sut {' and --sut '.join(takers)} (engines that declare their "
                         f"cache code): --sut {args.sut} has none for kvcheck {command}")
    if getattr(args, "ray", None) is not None:
        raise UsageError("--cover measures the campaign in this process: not with --ray")
    out = Path(getattr(args, "out", None) or "kvcheck-report")
    check_writable(out)
    try:
        begin(eng.name, eng.cache_code, out / f"engine-coverage-{eng.name}")
    except CoverageUnavailable as e:
        raise UsageError(str(e)) from None
    try:
        yield
    finally:
        abandon()

