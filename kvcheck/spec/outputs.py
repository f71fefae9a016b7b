"""Writing results: atomic files that honour the umask, and the commands that rerun a result.

Every file kvcheck writes (reports, traces, reproducers, graphs) goes through `write_atomic`:
a temp file in the same directory renamed over the target, so an interrupted run never leaves
half a file and a reader never sees one. `mkstemp` creates files 0600; CI artifact uploaders and
web servers running as another user must be able to read reports, so the final mode is
0666 & ~umask, like any file `open()` creates. Lives in spec/ so every layer may use it.
"""
from __future__ import annotations

import os
import re
import shlex
import sys
import tempfile
from pathlib import Path


def umask_mode(base: int = 0o666) -> int:
    """`base` filtered by the process umask (read without changing it for good)."""
    mask = os.umask(0)
    os.umask(mask)
    return base & ~mask


def file_stem(name: str, limit: int = 80) -> str:
    """A name that goes into an output file's name (a fault or SUT name, perhaps a user's):
    only letters, digits and _.+- kept, no leading dot, bounded, so it never leaves the
    output directory or hides there."""
    return (re.sub(r"[^A-Za-z0-9_.+-]", "_", str(name)).lstrip(".") or "_")[:limit]


def probe_writable(directory: Path) -> None:
    """Create `directory` if needed and prove a file can be created in it (OSError if not).
    The probe has a name of its own, so processes sharing the directory never race."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvcheck-write-test-"):
        pass


def write_atomic(path: str | Path, data: str | bytes, fsync: bool = False) -> Path:
    """Write `data` to `path` atomically with the mode a plain `open()` would give it. On any
    failure the temp file is removed and the target is left as it was."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, umask_mode())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return p


def kvcheck_command(*args: str | int) -> str:
    """The `kvcheck ...` command line that reruns a result, quoted for a POSIX shell."""
    return shlex.join(["kvcheck", *map(str, args)])


def python_command(script: str | Path) -> str:
    """How to run a generated reproducer: with this interpreter (the one that has kvcheck),
    not whatever `python` is first on PATH."""
    return shlex.join([sys.executable, str(script)])
