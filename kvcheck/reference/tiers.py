"""Host and disk tiers: write-back offload of a block's objects and verified loads.

Owns the on-disk format and the transfer machinery. A copy is one file per block:

    MAGIC (8 bytes) | header length (u32 LE) | header (JSON) | payload | SHA-256 (32 bytes)

The header records the model architecture id, the versions the objects were written with
(model, compressor, indexer, ABI), the pools' layout descriptors and each object's extent in
the payload; the checksum covers everything before it. Writes go to a temp file in the same
directory, are fsync'ed and atomically renamed (then the directory is fsync'ed): a crash
mid-write leaves the previous durable copy readable. Transfers run on a ThreadPoolExecutor;
"durable" is the completion of the write future, never its submission. A load only yields bytes;
`verify` checks magic, length, checksum and header before any object becomes ready. A copy that
fails is quarantined (renamed aside) and never served.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"KVCKBLK1"
FORMAT_VERSION = 1


class TierError(RuntimeError):
    """The cache directory cannot be used (clear one-line message)."""


class CopyInvalid(ValueError):
    """A copy failed verification (torn, truncated, bit-flipped, foreign or stale)."""


def pack(header: dict[str, Any], payload: bytes) -> bytes:
    h = json.dumps({**header, "format": FORMAT_VERSION, "payload_len": len(payload)},
                   sort_keys=True).encode()
    body = MAGIC + struct.pack("<I", len(h)) + h + payload
    return body + hashlib.sha256(body).digest()


def unpack(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """Parse and verify a copy; raises CopyInvalid with the reason."""
    if len(blob) < len(MAGIC) + 4 + 32:
        raise CopyInvalid("truncated (shorter than the fixed framing)")
    if blob[:len(MAGIC)] != MAGIC:
        raise CopyInvalid("bad magic (not a kvcheck block copy)")
    body, digest = blob[:-32], blob[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise CopyInvalid("checksum mismatch (torn write, truncation or bit flip)")
    (hlen,) = struct.unpack("<I", blob[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    try:
        header = json.loads(blob[start:start + hlen])
    except ValueError:
        raise CopyInvalid("unreadable header") from None
    payload = body[start + hlen:]
    if header.get("format") != FORMAT_VERSION or header.get("payload_len") != len(payload):
        raise CopyInvalid("header does not describe the payload")
    return header, payload


def check_header(header: dict[str, Any], model_id: str, versions: dict[str, int]) -> None:
    """The copy must come from this model architecture and the current model weights and ABI
    (compressor/indexer versions are recorded per object and checked by the funnel)."""
    if header.get("model_id") != model_id:
        raise CopyInvalid("foreign copy (another model architecture)")
    if header.get("ver") != versions["ver"]:
        raise CopyInvalid(f"stale copy (model version {header.get('ver')} != {versions['ver']})")
    if header.get("abi") != versions["abi"]:
        raise CopyInvalid(f"foreign layout (ABI {header.get('abi')} != {versions['abi']})")


def durable_write(path: Path, blob: bytes, crash_after: int | None = None) -> None:
    """temp file + fsync + atomic rename + directory fsync. `crash_after` (tests): write only
    that many bytes of the temp file and raise, as a process dying mid-write would."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".kvblk")
    try:
        with os.fdopen(fd, "wb") as f:
            if crash_after is not None:
                f.write(blob[:crash_after])
                raise OSError("simulated crash mid-write")
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        try:
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass
    except BaseException:
        if crash_after is None and os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclass
class Copy:
    key: str
    future: Future | None = None          # the write in flight
    load: Future | None = None            # the read in flight
    host: bytes | None = None             # host-tier copy (pinned host memory in a real engine)


class TierStore:
    """Host + disk tiers. `cache_dir=None`: a fresh temp dir (removed by close())."""

    def __init__(self, cache_dir: str | Path | None = None, tiers: tuple[str, ...] = ("device", "host", "disk"),
                 workers: int = 2) -> None:
        self.tiers = tiers
        self.disk = "disk" in tiers
        self._own = cache_dir is None
        if cache_dir is None:
            cache_dir = tempfile.mkdtemp(prefix="kvcheck-tier-")
        self.dir = Path(cache_dir)
        if self.disk:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                probe = self.dir / ".kvcheck-write-test"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as e:
                raise TierError(f"cache dir {self.dir} is not writable: {e.strerror or e}") from None
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvcheck-io")
        self.copies: dict[str, Copy] = {}
        self.quarantined: list[str] = []

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.kvblk"

    # ---- write-back ---------------------------------------------------------------------
    def offload(self, key: str, header: dict[str, Any], payload: bytes) -> Future:
        """Start the write-back; the returned future completes when the copy is durable."""
        blob = pack(header, payload)
        c = self.copies.setdefault(key, Copy(key))
        c.host = blob if "host" in self.tiers else None
        if self.disk:
            c.future = self.pool.submit(durable_write, self.path(key), blob)
        else:
            c.future = Future()
            c.future.set_result(None)
        return c.future

    def wait_durable(self, key: str) -> None:
        c = self.copies[key]
        if c.future is not None:
            c.future.result()

    # ---- load -----------------------------------------------------------------------------
    def _read(self, key: str) -> bytes:
        if self.disk:
            return self.path(key).read_bytes()
        c = self.copies[key]
        assert c.host is not None
        return c.host

    def load(self, key: str) -> Future:
        c = self.copies[key]
        c.load = self.pool.submit(self._read, key)
        return c.load

    def loaded(self, key: str) -> bytes:
        c = self.copies[key]
        assert c.load is not None, "load() first"
        return c.load.result()

    # ---- damage and quarantine ---------------------------------------------------------------
    def corrupt(self, key: str, how: str = "flip", in_flight_load: bool = False) -> None:
        """Damage the bytes a later load will read: flip a payload bit, truncate, or tear."""
        c = self.copies[key]
        if c.future is not None:
            c.future.result()
        if in_flight_load and c.load is not None:
            blob = bytearray(c.load.result())
            blob[len(blob) // 2] ^= 0x10
            f: Future = Future()
            f.set_result(bytes(blob))
            c.load = f
            return
        blob = bytearray(self._read(key))
        if how == "truncate":
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
            self.path(key).replace(self.dir / f"{key}.quarantined")
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
