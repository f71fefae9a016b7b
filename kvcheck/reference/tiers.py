"""Host and disk tiers: write-back offload of a block's objects and verified, key-bound loads.

Owns the transfer machinery and the tier's space; the file format is disk_format.py, the
start-up scan recovery.py. Writes are durable_write's temp file + fsync + atomic rename +
directory fsync on a ThreadPoolExecutor; "durable" is the completion of the write future, never
its submission. Every copy is stamped with a binding (its key, block and objects, and the
writer's identity: model architecture, exact weights, kernels, layout, ABI) and every read
checks it against what the caller asked for: a copy of another block, tenant or model raises
`CopyRejected` (a `CopyInvalid` that also reads as a missing file) and is never served.

A store opened on an existing directory recovers it (recovery.scan): durable copies are indexed
(an engine adopts them with `durable_copies`), bad ones quarantined, dead writers' temp files
removed; `self.recovery` has the counts. `max_bytes` bounds the space the tier uses, temp
files and quarantined copies included: an offload that would pass it first evicts quarantined
copies, then the oldest durable copies; one that still does not fit is refused before a byte
is written (its future fails with `TierFull`).
"""
from __future__ import annotations

import errno
import hashlib
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..spec.outputs import probe_writable
from . import recovery
from .disk_format import (FORMAT_VERSION, MAGIC, CopyInvalid, CopyRejected, check_binding,
                          check_header, durable_write, pack, unpack)

__all__ = ["FORMAT_VERSION", "MAGIC", "CopyInvalid", "CopyRejected", "Copy", "TierError", "TierFull",
           "TierStore", "check_binding", "check_header", "durable_write", "misplaced", "pack", "unpack"]


class TierError(RuntimeError):
    """The cache directory cannot be used (clear one-line message)."""


class TierFull(OSError):
    """The copy does not fit in the tier's byte budget (nothing was written)."""


@dataclass
class Copy:
    key: str
    future: Future | None = None          # the write in flight
    load: Future | None = None            # the read in flight
    host: bytes | None = None             # host-tier copy (pinned host memory in a real engine)
    expect: dict | None = None            # what a read of this key must find in the binding


def _expectation(key: str, header: dict[str, Any]) -> dict[str, Any]:
    exp: dict[str, Any] = {"key": key}
    if "block" in header:
        exp["block"] = header["block"]
    if isinstance(header.get("objects"), list):
        exp["objects"] = [[m.get("g"), m.get("kind")] for m in header["objects"] if isinstance(m, dict)]
    if "salt" in header:
        exp["salt"] = header["salt"]
    return exp


class TierStore:
    """Host + disk tiers. `cache_dir=None`: a fresh temp dir (removed by close())."""

    def __init__(self, cache_dir: str | Path | None = None, tiers: tuple[str, ...] = ("device", "host", "disk"),
                 workers: int = 2, max_bytes: int | None = None) -> None:
        self.tiers = tiers
        self.disk = "disk" in tiers
        self._own = cache_dir is None
        if cache_dir is None:
            cache_dir = tempfile.mkdtemp(prefix="kvcheck-tier-")
        self.dir = Path(cache_dir)
        self.max_bytes = max_bytes
        self.identity: Callable[[], dict[str, Any]] = dict
        self.unchecked: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._reserved = 0                              # bytes of writes in flight
        self.evicted: list[str] = []
        rec = recovery.Recovery()
        if self.disk:
            try:
                probe_writable(self.dir)
                rec = recovery.scan(self.dir)
            except OSError as e:
                raise TierError(f"cache dir {self.dir} is not writable: {e.strerror or e}") from None
        self.index: dict[str, recovery.Durable] = rec.index
        self._quarantine_files = rec.quarantine
        self.recovery = dict(rec.counts)
        self.recovery_reasons = rec.reasons
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvcheck-io")
        self.copies: dict[str, Copy] = {}
        self.quarantined: list[str] = []
        if self.disk and max_bytes is not None:
            with self._lock:
                self._make_room(0, keep=None)

    def bind_identity(self, identity: Callable[[], dict[str, Any]], unchecked: frozenset[str] = frozenset()) -> None:
        """Who is writing and reading: `identity()` is stamped into every copy and every read
        must match it. `unchecked` (planted faults only): "key" skips the key check of loads,
        "all" every check of loads."""
        self.identity, self.unchecked = identity, frozenset(unchecked)

    def path(self, key: str) -> Path:
        return self.dir / f"{key}{recovery.SUFFIX}"

    def used_bytes(self) -> int:
        return (sum(d.size for d in self.index.values()) + self._reserved
                + sum(s for s, _ in self._quarantine_files.values()))

    # ---- write-back ---------------------------------------------------------------------
    def offload(self, key: str, header: dict[str, Any], payload: bytes) -> Future:
        """Start the write-back; the returned future completes when the copy is durable."""
        exp = _expectation(key, header)
        bind = {**exp, **self.identity()}
        blob = pack(header, payload, bind=bind)
        c = self.copies.setdefault(key, Copy(key))
        c.expect = exp
        c.host = blob if "host" in self.tiers else None
        if not self.disk:
            c.future = Future()
            c.future.set_result(None)
            return c.future
        with self._lock:
            fits = self._make_room(len(blob), keep=key)
            if fits:
                self._reserved += len(blob)
        if not fits:
            c.future = Future()
            c.future.set_exception(TierFull(errno.ENOSPC, f"copy of {len(blob)} bytes does not fit in the "
                                            f"tier's {self.max_bytes}-byte budget", str(self.path(key))))
            return c.future
        indexed = {**{k: v for k, v in header.items() if k != "layouts"}, "bind": bind}
        c.future = self.pool.submit(self._write, key, indexed, blob)
        return c.future

    def _write(self, key: str, header: dict[str, Any], blob: bytes) -> None:
        try:
            durable_write(self.path(key), blob)
        finally:
            with self._lock:
                self._reserved -= len(blob)
        st = self.path(key).stat()
        with self._lock:
            self.index[key] = recovery.Durable(header, len(blob), st.st_mtime_ns)

    def _make_room(self, need: int, keep: str | None) -> bool:
        """Evict (quarantined first, then oldest durable copies, never `keep` nor a copy being
        read) until `need` more bytes fit. Called with the lock held."""
        if self.max_bytes is None:
            return True
        if need > self.max_bytes:
            return False
        for name in sorted(self._quarantine_files, key=lambda n: self._quarantine_files[n][1]):
            if self.used_bytes() + need <= self.max_bytes:
                return True
            (self.dir / name).unlink(missing_ok=True)
            del self._quarantine_files[name]
        busy = {k for k, c in self.copies.items() if c.load is not None and not c.load.done()}
        for k in sorted(self.index, key=lambda k: self.index[k].mtime_ns):
            if self.used_bytes() + need <= self.max_bytes:
                return True
            if k == keep or k in busy:
                continue
            self.path(k).unlink(missing_ok=True)
            del self.index[k]
            self.evicted.append(k)
        return self.used_bytes() + need <= self.max_bytes

    def wait_durable(self, key: str) -> None:
        c = self.copies[key]
        if c.future is not None:
            c.future.result()

    # ---- adoption after a restart ------------------------------------------------------------
    def durable_copies(self) -> dict[str, dict[str, Any]]:
        """Recovered (and written) durable copies of *this* identity: key -> header."""
        me = self.identity()
        with self._lock:
            items = list(self.index.items())
        return {k: d.header for k, d in items
                if all(d.header.get("bind", {}).get(f) == v for f, v in me.items())}

    def expect(self, key: str, header: dict[str, Any]) -> None:
        """Adopt a recovered copy: later reads of `key` must find this block and objects."""
        self.copies.setdefault(key, Copy(key)).expect = _expectation(key, header)

    # ---- load -----------------------------------------------------------------------------
    def _raw(self, key: str) -> bytes:
        if self.disk:
            return self.path(key).read_bytes()
        c = self.copies[key]
        assert c.host is not None
        return c.host

    def _read(self, key: str, for_load: bool = False, identity: dict[str, Any] | None = None) -> bytes:
        """The bytes of key's copy, verified and bound to key and to this identity, or
        CopyRejected (the funnel's scrub and, with for_load, the load path)."""
        blob = self._raw(key)
        if for_load and "all" in self.unchecked:
            return blob
        c = self.copies.get(key)
        exp = dict(c.expect) if c is not None and c.expect else {"key": key}
        exp.update(self.identity() if identity is None else identity)
        try:
            header, _ = unpack(blob)
            check_binding(header, exp, check_key=not (for_load and "key" in self.unchecked))
        except CopyInvalid as e:
            raise CopyRejected(f"copy of {key[:12]}: {e}") from None
        return blob

    def load(self, key: str) -> Future:
        c = self.copies.get(key)
        if c is None and key in self.index:                 # recovered: bound as indexed
            self.expect(key, self.index[key].header)
        c = self.copies[key]
        # the identity asked for is taken now, on the caller's thread (no model work on I/O threads)
        c.load = self.pool.submit(self._read, key, True, self.identity())
        return c.load

    def loaded(self, key: str) -> bytes:
        c = self.copies[key]
        assert c.load is not None, "load() first"
        return c.load.result()

    # ---- damage and quarantine ---------------------------------------------------------------
    def corrupt(self, key: str, how: str | None = None, in_flight_load: bool = False) -> None:
        """Damage the bytes a later load will read: flip a payload bit, truncate, tear, or
        `misplace` (a valid copy of another block put at this key's path). Unspecified: a
        misplacement for half the keys (by the key), a bit flip for the others."""
        c = self.copies[key]
        if c.future is not None:
            try:
                c.future.result()
            except OSError:
                pass
        if in_flight_load and c.load is not None:
            try:
                blob = bytearray(c.load.result())
            except OSError:
                blob = bytearray(self._raw(key))
            blob[len(blob) // 2] ^= 0x10
            f: Future = Future()
            f.set_result(bytes(blob))
            c.load = f
            return
        if how is None:
            how = "misplace" if hashlib.sha256(key.encode()).digest()[0] & 1 else "flip"
        blob = bytearray(self._raw(key))
        if how == "misplace":
            blob = bytearray(misplaced(bytes(blob)))
        elif how == "truncate":
            blob = blob[:len(blob) // 2]
        elif how == "tear":
            blob[len(blob) // 2:] = b"\x00" * (len(blob) - len(blob) // 2)
        else:
            blob[len(blob) // 2] ^= 0x10
        if self.disk:
            self.path(key).write_bytes(bytes(blob))
        if c.host is not None:
            c.host = bytes(blob)

    def quarantine(self, key: str) -> None:
        if self.disk and self.path(key).exists():
            q = f"{key}{recovery.QUARANTINE}"
            self.path(key).replace(self.dir / q)
            with self._lock:
                d = self.index.pop(key, None)
                self._quarantine_files[q] = (d.size if d else (self.dir / q).stat().st_size, 0)
        c = self.copies.get(key)
        if c is not None:
            c.host = None
        self.quarantined.append(key)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.discard()

    def discard(self) -> None:
        """The cleanup that is safe from a finalizer: remove our own directory, join nothing.
        (Joining the pool's threads from garbage collection deadlocked once in 145 campaigns:
        the collector ran inside threading's own lock. The idle threads end by themselves when
        the pool is collected.)"""
        if self._own:
            shutil.rmtree(self.dir, ignore_errors=True)


def misplaced(blob: bytes) -> bytes:
    """A valid copy of another block with the same layout: the header bound to another key,
    the payload's floats shifted by one (another block's data), framing and checksum valid."""
    header, payload = unpack(blob)
    b = dict(header.get("bind") or {})
    other = "f" * 8 + str(b.get("key", ""))[8:]
    b["key"] = other if other != b.get("key") else "0" * 8 + str(b.get("key", ""))[8:]
    h = {k: v for k, v in header.items() if k not in ("format", "payload_len", "bind")}
    h["key"] = b["key"]
    shifted = payload[4:] + payload[:4] if len(payload) >= 8 else bytes(x ^ 0x10 for x in payload)
    return pack(h, shifted, bind=b)
