"""The on-disk format of a block copy, its verification and the durable write.

One file per block:

    MAGIC (8 bytes) | header length (u32 LE) | header (JSON object) | payload | SHA-256 (32 bytes)

The checksum covers everything before it. Besides the caller's fields (versions, layouts, the
objects' extents) the header carries a `bind` object: the key the copy was written for (the
chained block hash, which commits to the token prefix, the model architecture and the cache
salt), the block index, the (group, kind) of every object, and the writer's identity (model
architecture id, a fingerprint of the exact weights, kernels, ABI and layout). A load checks
all of it against what the caller asked for, so a valid copy of another block, tenant or model
is `CopyInvalid`, never served. Every way a blob can be malformed is `CopyInvalid` too.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
from pathlib import Path
from typing import Any, Callable

MAGIC = b"KVCKBLK1"
FORMAT_VERSION = 2               # 2: the header carries `bind` (1: unbound copies, not served)
FIXED = len(MAGIC) + 4 + 32      # framing bytes around the header and payload
MAX_HEADER = 1 << 20             # a header longer than this is not one of ours
TMP_PREFIX = ".tmp-"

# Tests only: called at named points of a durable write ("write" after each chunk with the bytes
# written so far, "before_rename", "before_dirsync") and of the start-up scan ("recovery", with
# the files handled so far); the crash-consistency test kills the process from it.
CRASH_HOOK: Callable[[str, int], None] | None = None
WRITE_CHUNK = 1 << 16
LIVE_TMP: set[str] = set()       # temp files this process is writing (recovery keeps them)


class CopyInvalid(ValueError):
    """A copy failed verification (torn, truncated, bit-flipped, malformed, foreign, misplaced or stale)."""


class CopyRejected(CopyInvalid, OSError):
    """The tier refused to hand these bytes out as the requested copy. Also an OSError: to its
    reader a copy that is not the requested one is as good as a missing file."""


def _at(point: str, n: int) -> None:
    if CRASH_HOOK is not None:
        CRASH_HOOK(point, n)


def pack(header: dict[str, Any], payload: bytes, bind: dict[str, Any] | None = None) -> bytes:
    h = {**header, "format": FORMAT_VERSION, "payload_len": len(payload)}
    if bind is not None:
        h["bind"] = bind
    hb = json.dumps(h, sort_keys=True).encode()
    body = MAGIC + struct.pack("<I", len(hb)) + hb + payload
    return body + hashlib.sha256(body).digest()


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def unpack(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """Parse and verify the framing, checksum and header structure; raises CopyInvalid only."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise CopyInvalid("not bytes")
    blob = bytes(blob)
    if len(blob) < FIXED:
        raise CopyInvalid("truncated (shorter than the fixed framing)")
    if blob[:len(MAGIC)] != MAGIC:
        raise CopyInvalid("bad magic (not a kvcheck block copy)")
    body, digest = blob[:-32], blob[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise CopyInvalid("checksum mismatch (torn write, truncation or bit flip)")
    (hlen,) = struct.unpack("<I", blob[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    if hlen > MAX_HEADER or start + hlen > len(body):
        raise CopyInvalid(f"header length {hlen} beyond the copy")
    try:
        header = json.loads(body[start:start + hlen].decode("utf-8"))
    except (ValueError, RecursionError):      # bad JSON, non-UTF-8, too deep, too many digits
        raise CopyInvalid("unreadable header") from None
    if not isinstance(header, dict):
        raise CopyInvalid(f"header is a JSON {type(header).__name__}, not an object")
    payload = body[start + hlen:]
    if header.get("format") != FORMAT_VERSION or not _is_int(header.get("format")):
        raise CopyInvalid(f"format {header.get('format')!r} is not {FORMAT_VERSION}")
    if not _is_int(header.get("payload_len")) or header["payload_len"] != len(payload):
        raise CopyInvalid("header does not describe the payload")
    _check_objects(header.get("objects", []), len(payload))
    b = header.get("bind")
    if b is not None and not (isinstance(b, dict) and isinstance(b.get("key"), str)):
        raise CopyInvalid("malformed binding")
    return header, payload


def _check_objects(objs: Any, n: int) -> None:
    """Every object's extent must lie inside the payload (the loader slices by them)."""
    if not isinstance(objs, list):
        raise CopyInvalid("malformed object table")
    for m in objs:
        if not (isinstance(m, dict) and _is_int(m.get("g")) and isinstance(m.get("kind"), str)
                and _is_int(m.get("offset")) and _is_int(m.get("nbytes"))):
            raise CopyInvalid("malformed object table")
        if m["offset"] < 0 or m["nbytes"] < 0 or m["offset"] + m["nbytes"] > n or m["nbytes"] % 4:
            raise CopyInvalid("object extent outside the payload")
        for f in ("ver", "abi"):
            if f in m and not _is_int(m[f]):
                raise CopyInvalid("malformed object table")


def check_header(header: dict[str, Any], model_id: str, versions: dict[str, int]) -> None:
    """The copy must come from this model architecture and the current model weights and ABI
    (compressor/indexer versions are recorded per object and checked by the funnel)."""
    if header.get("model_id") != model_id:
        raise CopyInvalid("foreign copy (another model architecture)")
    if header.get("ver") != versions["ver"]:
        raise CopyInvalid(f"stale copy (model version {header.get('ver')} != {versions['ver']})")
    if header.get("abi") != versions["abi"]:
        raise CopyInvalid(f"foreign layout (ABI {header.get('abi')} != {versions['abi']})")


def check_binding(header: dict[str, Any], expect: dict[str, Any], check_key: bool = True) -> None:
    """The copy's `bind` must match every field the caller expects (the key, the block and its
    objects, the writer's identity). `check_key=False` is the planted fault
    `engine_disk_copy_key_unchecked`: the key and the block are not compared."""
    b = header.get("bind")
    if not isinstance(b, dict):
        raise CopyInvalid("unbound copy (no binding to a key and a model)")
    for f, want in expect.items():
        if not check_key and f in ("key", "block", "objects", "salt"):
            continue
        got = b.get(f)
        if got != want:
            what = "misplaced copy (written for another block)" if f in ("key", "block", "objects") \
                else f"foreign copy ({f} differs)"
            raise CopyInvalid(f"{what}: {f} {_short(got)} != {_short(want)}")


def _short(x: Any) -> str:
    s = repr(x)
    return s if len(s) <= 24 else s[:21] + "..."


def tmp_name(path: Path) -> Path:
    """A temp file next to `path`, named after the writing process (recovery removes those of
    dead processes only: a live writer sharing the directory keeps its own)."""
    return path.parent / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{path.name}"


def durable_write(path: Path, blob: bytes, crash_after: int | None = None) -> None:
    """temp file + fsync + atomic rename + directory fsync. `crash_after` (tests): write only
    that many bytes of the temp file and raise, as a process dying mid-write would. The temp
    file is created with mode 0666 minus the umask (mkstemp's 0600 would not honour it)."""
    tmp = tmp_name(path)
    LIVE_TMP.add(tmp.name)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except BaseException:
        LIVE_TMP.discard(tmp.name)
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            if crash_after is not None:
                f.write(blob[:crash_after])
                raise OSError("simulated crash mid-write")
            view, off = memoryview(blob), 0
            while off < len(blob):
                f.write(view[off:off + WRITE_CHUNK])
                off = min(len(blob), off + WRITE_CHUNK)
                if CRASH_HOOK is not None:
                    f.flush()
                    _at("write", off)
            f.flush()
            os.fsync(f.fileno())
        _at("before_rename", len(blob))
        os.replace(tmp, path)
        _at("before_dirsync", len(blob))
        fsync_dir(path.parent)
    except BaseException:
        if crash_after is None and os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        LIVE_TMP.discard(tmp.name)


def fsync_dir(d: Path) -> None:
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
