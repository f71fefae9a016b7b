"""Crash consistency with real process kills. A writer process (tier_crash_writer.py) writes
copies and SIGKILLs itself at a named point (mid-write at a byte offset, between fsync and
rename, between rename and the directory fsync, during the start-up scan). After each kill a
new store recovers the directory, and then: every load serves exactly the last durable bytes of
its key (the last acknowledged write, or the one in flight if its rename happened) or degrades
(missing / CopyInvalid) only where nothing was acknowledged; nothing acknowledged is lost; no
temp file remains. Points come from a printed seed; KVCHECK_CRASH_TRIALS=N runs more (the
`slow` test runs 1000). SIGKILL keeps the page cache: this tests process crashes, not power loss.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tier_crash_writer as w

import kvcheck
from kvcheck.reference.tiers import CopyInvalid, TierStore, unpack

WRITER = Path(w.__file__)
ROOT = str(Path(kvcheck.__file__).resolve().parent.parent)
POINTS = ("write", "before_rename", "before_dirsync")


def child(args: list[str], crash: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("KVCHECK_CRASH_AT", None)
    if crash:
        env["KVCHECK_CRASH_AT"] = crash
    return subprocess.run([sys.executable, str(WRITER), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def plan(seed: int, trials: int) -> list[tuple[str, int, int]]:
    """(point, copy index, byte offset) per trial, every point about equally often; a fifth
    of the trials crash the recovery scan instead."""
    rng = random.Random(seed)
    out = []
    for t in range(trials):
        if t % 5 == 4:
            out.append(("recovery", rng.randrange(1, 7), 0))
            continue
        point = POINTS[t % 3] if t % 5 != 3 else "write"
        n = rng.randrange(0, 7)
        size = len(w.payload(seed, n))
        out.append((point, n, rng.randrange(1, size) if point == "write" else 0))
    return out


def judge(d: Path, seed: int, acked: set[int], started: set[int]) -> dict[str, int]:
    """Recover d and compare every key's served copy with what was durable."""
    t = TierStore(d)
    got = {"corrupt_serves": 0, "lost_durable": 0, "tmp_left": len(list(d.glob(".tmp-*")))}
    inflight = started - acked
    for k in range(w.KEYS):
        key = w.key(k)
        mine = [i for i in started if i % w.KEYS == k]
        last = max((i for i in acked if i % w.KEYS == k), default=None)
        allowed = {i for i in mine if (last is None or i >= last) and (i == last or i in inflight)}
        try:
            t.expect(key, w.header(k))
            t.load(key)
            header, payload = unpack(t.loaded(key))
        except (CopyInvalid, OSError):
            got["lost_durable"] += last is not None
            continue
        i = header.get("serial")
        if i not in allowed or payload != w.payload(seed, i):
            got["corrupt_serves"] += 1
    t.close()
    return got


def run_trials(tmp_path: Path, seed: int, trials: int) -> dict[str, int]:
    tally = {"trials": 0, "killed": 0, "corrupt_serves": 0, "lost_durable": 0, "tmp_left": 0}
    points: dict[str, int] = {}
    for n, (point, i, off) in enumerate(plan(seed, trials)):
        d = tmp_path / f"t{n}"
        d.mkdir()
        if point == "recovery":
            # debris of earlier crashes: durable copies, a torn one, temp files of dead writers
            p = child(["write", str(d), str(seed), "6"], "write:5:1")
            assert p.returncode == -signal.SIGKILL, p.stderr[-500:]
            (d / f".tmp-{2**22 + n}-0-{w.key(0)}.kvblk").write_bytes(b"x" * 100)
            (d / f"{7:064x}.kvblk").write_bytes(b"torn")          # not one of the writer's keys
            acked, started = set(range(5)), set(range(6))
            crash = f"recovery:{i}:0"
            p = child(["recover", str(d)], crash)
        else:
            crash = f"{point}:{i}:{off}"
            p = child(["write", str(d), str(seed), "7"], crash)
            lines = p.stdout.split()
            acked = {int(x) for a, x in zip(lines[::2], lines[1::2]) if a == "ACK"}
            started = {int(x) for a, x in zip(lines[::2], lines[1::2]) if a == "START"}
        tally["trials"] += 1
        tally["killed"] += p.returncode == -signal.SIGKILL
        assert p.returncode == -signal.SIGKILL, (crash, p.returncode, p.stderr[-500:])
        points[point] = points.get(point, 0) + 1
        got = judge(d, seed, acked, started)
        for f in ("corrupt_serves", "lost_durable", "tmp_left"):
            tally[f] += got[f]
        assert got == {"corrupt_serves": 0, "lost_durable": 0, "tmp_left": 0}, (seed, crash, got)
        assert not list(d.glob(".tmp-*"))
    print(f"crash trials seed={seed}: {tally} points={points}")
    return {**tally, **{f"at_{k}": v for k, v in points.items()}}


def test_sigkill_at_named_points(tmp_path) -> None:
    trials = int(os.environ.get("KVCHECK_CRASH_TRIALS", "60"))
    seed = int(os.environ.get("KVCHECK_CRASH_SEED", "0"))
    tally = run_trials(tmp_path, seed, trials)
    assert tally["killed"] == trials and tally["corrupt_serves"] == tally["lost_durable"] == 0


@pytest.mark.slow
def test_sigkill_many_points(tmp_path) -> None:
    tally = run_trials(tmp_path, 1, 1000)
    assert tally["killed"] == 1000 and tally["corrupt_serves"] == tally["lost_durable"] == 0
