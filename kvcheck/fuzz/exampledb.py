"""The Hypothesis example database a campaign saves its failures to and replays first.

A directory (one machine, or a shared filesystem) or a Redis URL (Hypothesis's own
`RedisExampleDatabase`: every worker of a cluster and every later run see the same failures).
redis is an optional dependency (`pip install 'kvcheck[scale]'`), imported only for a URL.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

INSTALL = "pip install 'kvcheck[scale]'"
KEY_PREFIX = b"kvcheck:hypothesis:"       # Redis keys of kvcheck's examples start with this
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class DatabaseError(Exception):
    """A database that cannot be opened or reached (one line: the URL and why)."""


def is_redis_url(db: str | None) -> bool:
    return bool(db) and db.startswith(REDIS_SCHEMES)


def _client(url: str) -> Any:
    try:
        import redis
    except ImportError:
        raise DatabaseError(f"a Redis example database ({url}) needs the redis package: {INSTALL}") from None
    try:
        return redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30)
    except ValueError as e:
        raise DatabaseError(f"bad Redis URL {url!r}: {e}") from None


def check_redis(url: str) -> None:
    """Fail now, with one line, rather than in every worker: the URL parses and answers PING."""
    client = _client(url)
    import redis
    try:
        client.ping()
    except redis.RedisError as e:
        raise DatabaseError(f"cannot reach Redis at {url}: {' '.join(str(e).split())}") from None


def namespace(sut: str, fault: str | None) -> str:
    """Where a campaign's examples live in a database. Every campaign's state machine has the
    same Hypothesis key, so without this a clean run would replay a planted fault's examples,
    find them passing and delete them; per SUT and fault, a fixed SUT still replays (and, once
    they pass, retires) the examples its buggy version failed."""
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", f"{sut}:{fault or 'clean'}")


def open_database(db: str | None, space: str = "") -> Any:
    """None (no database), a Redis URL (keys KEY_PREFIX + space + ':' + Hypothesis's key), or a
    directory (a subdirectory per space)."""
    if not db:
        return None
    if is_redis_url(db):
        from hypothesis.extra.redis import RedisExampleDatabase
        prefix = KEY_PREFIX + (space.encode() + b":" if space else b"")
        return RedisExampleDatabase(_client(db), key_prefix=prefix)
    from hypothesis.database import DirectoryBasedExampleDatabase
    return DirectoryBasedExampleDatabase(Path(db) / space.replace(":", "-") if space else db)
