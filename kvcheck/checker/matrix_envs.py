"""`kvcheck matrix`: which releases of an engine, and a side environment for each.

`select_releases` turns `--releases` (all, minors, patches, rotate:KEY, A,B,..., A..B) into release numbers, reading
the package index through pip (`index_versions`) only when the selector needs it, and refuses a
release outside the range the engine claims (`Engine.release_range`) unless allowed. `ensure_env`
reuses `DIR/<engine>-<version>` when its python has that release installed, else runs the
engine's `install_script` (`PYTHON=<kvcheck's python> bash SCRIPT VERSION DIR`); a failed build
is the script's one line, never an exception. Every bad selector is a `ReleaseError` (one line).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from packaging.version import InvalidVersion, Version

from ..spec.outputs import file_stem

ROOT = Path(__file__).resolve().parents[2]          # kvcheck's repository (install scripts, PYTHONPATH)
SELECTORS = ("all", "minors", "patches")
BUILD_TIMEOUT_S = 1800.0


class ReleaseError(ValueError):
    """A bad release selector, or releases that cannot be listed: one line."""


def version(text: str, what: str = "--releases") -> Version:
    try:
        return Version(text.strip())
    except InvalidVersion:
        raise ReleaseError(f"{what}: {text.strip()[:40]!r} is not a release number (like 0.33.0)") from None


def same_release(a: str | None, b: str | None) -> bool:
    """Whether two release strings name one release (0.33 == 0.33.0)."""
    if a is None or b is None:
        return False
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a.strip() == b.strip()


def in_range(v: Version, lo: Version, hi: Version) -> bool:
    """Inclusive; a post release counts as the release it follows (0.33.0.post1 is 0.33.0's)."""
    return lo <= Version(v.base_version) <= hi


def index_versions(distribution: str, python: str = sys.executable, timeout: float = 120.0) -> list[str]:
    """Every release of `distribution` on the package index pip is configured for (newest first,
    as pip prints them); ReleaseError when the index cannot be read."""
    cmd = [python, "-m", "pip", "index", "versions", distribution, "--disable-pip-version-check"]
    head = f"cannot list the releases of {distribution} on the package index"
    tail = "; name them with --releases A,B or use existing environments with --python"
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, PIP_NO_INPUT="1"))
    except subprocess.TimeoutExpired:
        raise ReleaseError(f"{head} (pip did not answer in {timeout:g}s){tail}") from None
    except OSError as e:
        raise ReleaseError(f"{head} ({e.strerror or e}){tail}") from None
    m = re.search(r"^Available versions:\s*(.*)$", p.stdout, re.M)
    if p.returncode != 0 or not m:
        errs = [x.strip() for x in (p.stderr or "").splitlines() if x.strip().startswith("ERROR")]
        why = errs[-1] if errs else f"pip exited {p.returncode}"
        raise ReleaseError(f"{head} ({why[:200]}){tail}")
    return [x.strip() for x in m.group(1).split(",") if x.strip()]


def select_releases(selector: str, distribution: str, claimed: tuple[str, str],
                    listing: Callable[[], list[str]], allow_outside: bool = False) -> list[str]:
    """The releases `selector` names, oldest first. `listing()` gives the index's releases (only
    called for all, minors and A..B); pre-releases are left out of those."""
    lo, hi = version(claimed[0], "release_range"), version(claimed[1], "release_range")
    text = (selector or "").strip()
    if not text:
        raise ReleaseError("--releases is empty: give all, minors, A,B,... or A..B")

    def check_claimed(v: Version) -> None:
        if not allow_outside and not in_range(v, lo, hi):
            raise ReleaseError(f"--releases: {distribution} {v} is outside the releases kvcheck claims to "
                               f"drive ({lo}..{hi}); --allow-outside-range runs it anyway")

    def listed(a: Version, b: Version) -> list[Version]:
        out: dict[Version, Version] = {}
        for raw in listing():
            try:
                v = Version(raw)
            except InvalidVersion:
                continue                           # the index's odd entries are not releases
            # (a range from a post release, 0.5.15.post1..B, starts there: in_range compares base versions)
            if not v.is_prerelease and a <= v and in_range(v, Version(a.base_version), b):
                out.setdefault(v, v)
        return sorted(out)

    if text in SELECTORS or text.startswith("rotate:"):
        found = listed(lo, hi)
        if text != "all":     # minors: the newest of each X.Y; patches (and rotate): of each X.Y.Z
            width = 2 if text == "minors" else 3
            newest: dict[tuple[int, ...], Version] = {}
            for v in found:
                newest[v.release[:width]] = max(v, newest.get(v.release[:width], v))
            found = sorted(newest.values())
        if text.startswith("rotate:"):     # one release strictly inside the range, picked by a hex key
            key = text.split(":", 1)[1].strip()
            try:
                k = int(key[:12], 16)
            except ValueError:
                raise ReleaseError(f"--releases rotate:KEY needs a hex key (a commit hash), not {key[:20]!r}") from None
            inner = [v for v in found if v.release[:3] not in (lo.release[:3], hi.release[:3])] or found
            found = [inner[k % len(inner)]] if inner else []
        if not found:
            raise ReleaseError(f"--releases {text}: the package index has no release of {distribution} "
                               f"in {lo}..{hi}")
        return [str(v) for v in found]
    if ".." in text:
        parts = text.split("..")
        if len(parts) != 2 or not all(p.strip() for p in parts):
            raise ReleaseError(f"--releases: {text[:40]!r} is not a range A..B (like 0.20.0..0.33.0)")
        a, b = version(parts[0]), version(parts[1])
        if a > b:
            raise ReleaseError(f"--releases {text}: {a} is newer than {b} (write the oldest first)")
        check_claimed(a)
        check_claimed(b)
        found = listed(a, b)
        if not found:
            raise ReleaseError(f"--releases {text}: the package index has no release of {distribution} in that range")
        return [str(v) for v in found]
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise ReleaseError(f"--releases: {text[:40]!r} has an empty entry (give all, minors, A,B,... or A..B)")
    chosen: dict[Version, Version] = {}
    for x in items:
        v = version(x)
        check_claimed(v)
        chosen.setdefault(v, v)
    return [str(v) for v in sorted(chosen)]


# ---- environments ---------------------------------------------------------------------------
def default_envs() -> Path:
    return Path(os.environ.get("KVCHECK_ENVS") or Path.home() / ".cache" / "kvcheck" / "envs")


def env_dir(envs: Path, engine: str, release: str) -> Path:
    return envs / file_stem(f"{engine}-{release}")


def installed_release(python: Path, distribution: str, timeout: float = 120.0) -> str | None:
    """The release of `distribution` that `python`'s environment has (package metadata, no
    import); None when it has none or the interpreter does not run. The driver then checks what
    the engine itself reports."""
    code = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
    try:
        p = subprocess.run([str(python), "-c", code, distribution], capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    return p.stdout.strip() or None


@dataclass
class Env:
    release: str
    dir: str
    python: str | None                # None: the build failed (error says why)
    built: bool = False
    error: str | None = None
    summary: str = ""
    seconds: float = 0.0


def last_line(text: str) -> str:
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    return lines[-1] if lines else ""


def script_error(text: str) -> str:
    """An install script's failure in one line: its own message (the first `install-X: ...` line),
    then pip's last word when the script quoted its log (indented lines under the message)."""
    lines = [x.rstrip() for x in (text or "").splitlines() if x.strip()]
    head = next((x for x in lines if x.startswith("install-") and ":   " not in x), "")
    quoted = [x.split(":   ", 1)[1].strip() for x in lines if x.startswith("install-") and ":   " in x]
    if not head:
        return last_line(text)
    return f"{head}; pip: {quoted[-1]}" if quoted else head


def ensure_env(engine: str, distribution: str, script: str, release: str, envs: Path,
               kvcheck_python: str = sys.executable, timeout: float = BUILD_TIMEOUT_S) -> Env:
    """The environment of `release` under `envs`: reused when its python has that release,
    else built with the engine's install script. Never raises: a failure is `Env.error`."""
    d = env_dir(envs, engine, release)
    py = d / "bin" / "python"
    t0 = time.monotonic()
    if py.exists() and same_release(installed_release(py, distribution), release):
        return Env(release, str(d), str(py), summary=f"reused {d}")
    path = ROOT / script
    if not path.is_file():
        return Env(release, str(d), None, error=f"install script {script} is not in {ROOT}")
    try:
        p = subprocess.run(["bash", str(path), release, str(d)], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout, env=dict(os.environ, PYTHON=kvcheck_python))
    except subprocess.TimeoutExpired:
        return Env(release, str(d), None, error=f"building the environment took over {timeout:g}s ({script} "
                   f"{release} {d}); gave up", seconds=time.monotonic() - t0)
    except OSError as e:
        return Env(release, str(d), None, error=f"cannot run {script}: {e.strerror or e}")
    secs = time.monotonic() - t0
    if p.returncode != 0:
        why = script_error(p.stderr) or last_line(p.stdout) or f"{script} exited {p.returncode}"
        return Env(release, str(d), None, error=f"environment build failed: {why}", seconds=secs)
    if not py.exists():
        return Env(release, str(d), None, error=f"{script} succeeded but left no {py}", seconds=secs)
    return Env(release, str(d), str(py), built=True, summary=last_line(p.stdout), seconds=secs)
