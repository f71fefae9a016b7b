"""Child process of the crash-consistency test: writes copies, or recovers a directory, and
SIGKILLs itself at the point named by KVCHECK_CRASH_AT ("point:n:offset"):

  write:n:offset      while writing copy n, once `offset` bytes of its temp file are written
  before_rename:n:0   copy n's temp file written and fsync'ed, not yet renamed
  before_dirsync:n:0  copy n renamed over the old copy, the directory not yet fsync'ed
  recovery:n:0        the start-up scan has handled n directory entries

    python tier_crash_writer.py write DIR SEED N     prints "START i" / "ACK i" per copy
    python tier_crash_writer.py recover DIR
"""
from __future__ import annotations

import os
import random
import signal
import sys

KEYS = 3
HDR = {"model_id": "crash", "ver": 0, "ix": 0, "cmp": 0, "abi": 0}


def key(i: int) -> str:
    return f"{i % KEYS:064x}"


def payload(seed: int, i: int) -> bytes:
    """Copy i's bytes (its size varies, so crash offsets land in every part of the file)."""
    rng = random.Random(seed * 1_000_003 + i)
    return rng.randbytes(rng.randrange(64, 6000))


def header(i: int) -> dict:
    return {**HDR, "block": i % KEYS, "serial": i}


def _arm(current: list[int]) -> None:
    from kvcheck.reference import disk_format
    spec = os.environ.get("KVCHECK_CRASH_AT")
    if not spec:
        return
    point, n, offset = spec.split(":")
    n_, off = int(n), int(offset)

    def hook(p: str, at: int) -> None:
        if p != point:
            return
        if (p == "recovery" and at >= n_) or (p != "recovery" and current[0] == n_ and at >= off):
            os.kill(os.getpid(), signal.SIGKILL)
    disk_format.WRITE_CHUNK = 256
    disk_format.CRASH_HOOK = hook


def main(argv: list[str]) -> int:
    from kvcheck.reference.tiers import TierStore
    current = [-1]
    _arm(current)
    if argv[0] == "recover":
        TierStore(argv[1], workers=1).close()
        return 0
    d, seed, n = argv[1], int(argv[2]), int(argv[3])
    t = TierStore(d, workers=1)
    for i in range(n):
        current[0] = i
        print(f"START {i}", flush=True)
        t.offload(key(i), header(i), payload(seed, i)).result()
        print(f"ACK {i}", flush=True)
    t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
