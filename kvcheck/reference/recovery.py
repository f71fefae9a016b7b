"""Start-up scan of a disk tier: what a restarted engine may reuse, and the debris of crashes.

A store opened on an existing directory reads every `<key>.kvblk`, verifies its framing,
checksum and header (`unpack`) and that the copy is bound to the key its name says; copies that
pass are indexed as durable (a restarted engine can load them), the others are renamed to
`<key>.quarantined`. Temp files left by writers that died (`.tmp-<pid>-...`, the pid no longer
running, or older unnamed ones) are removed. The scan is idempotent: killed half-way, the next
one finishes the job. A copy of another model is *not* damaged and is kept (a directory may be
shared); the identity check at load makes sure it is never served to this one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import disk_format as fmt
from .disk_format import CopyInvalid, unpack

SUFFIX, QUARANTINE = ".kvblk", ".quarantined"


@dataclass
class Durable:
    """A durable copy on disk: its binding and header (no payload), size and age."""

    header: dict[str, Any]
    size: int
    mtime_ns: int


@dataclass
class Recovery:
    index: dict[str, Durable] = field(default_factory=dict)
    quarantine: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (size, mtime)
    counts: dict[str, int] = field(default_factory=lambda: {
        "scanned": 0, "recovered": 0, "quarantined": 0, "tmp_removed": 0})
    reasons: dict[str, str] = field(default_factory=dict)                 # quarantined name -> why


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False                 # ours, and not in LIVE_TMP: left by a failed write
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True                  # exists, another user's
    return True


def _stale_tmp(name: str) -> bool:
    if name in fmt.LIVE_TMP:
        return False
    rest = name[len(fmt.TMP_PREFIX):]
    pid = rest.split("-", 1)[0]
    return not (pid.isdigit() and _pid_alive(int(pid)))


def scan(d: Path) -> Recovery:
    rec = Recovery()
    done = 0
    for entry in sorted(os.scandir(d), key=lambda e: e.name):
        name = entry.name
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            if name.startswith(fmt.TMP_PREFIX):
                if _stale_tmp(name):
                    os.unlink(entry.path)
                    rec.counts["tmp_removed"] += 1
            elif name.endswith(QUARANTINE):
                st = entry.stat()
                rec.quarantine[name] = (st.st_size, st.st_mtime_ns)
            elif name.endswith(SUFFIX) and not name.startswith("."):
                rec.counts["scanned"] += 1
                key = name[:-len(SUFFIX)]
                st = entry.stat()
                try:
                    blob = Path(entry.path).read_bytes()
                    header, _ = unpack(blob)
                    b = header.get("bind")
                    if not isinstance(b, dict):
                        raise CopyInvalid("unbound copy (no binding to a key and a model)")
                    if b.get("key") != key:
                        raise CopyInvalid("misplaced copy (bound to another key than its name)")
                except CopyInvalid as e:
                    q = key + QUARANTINE
                    os.replace(entry.path, d / q)
                    rec.quarantine[q] = (st.st_size, st.st_mtime_ns)
                    rec.reasons[q] = str(e)
                    rec.counts["quarantined"] += 1
                else:
                    header = {k: v for k, v in header.items() if k != "layouts"}
                    rec.index[key] = Durable(header, st.st_size, st.st_mtime_ns)
                    rec.counts["recovered"] += 1
        except FileNotFoundError:
            continue                 # removed under us (another process's scan or write)
        done += 1
        fmt._at("recovery", done)
    if rec.counts["tmp_removed"] or rec.counts["quarantined"]:
        fmt.fsync_dir(d)
    return rec
