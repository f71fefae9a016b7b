"""`kvcheck matrix --differential`: the same workloads on every release, compared lookup by lookup.

Each release runs in its own python (an environment matrix_envs built, or one given with
--python), one driver process at a time (differential_driver: JSON lines on its stdin and
stdout, the engine imported once). The workloads are generated once per layout from the seed at
the engine's sizes (fuzz/reuse_workloads.py), or read from --traces, and every release replays
exactly them. `compare` gives, per layout, each release's reuse ratio (tokens hit / prompt
tokens), for each pair the lookups where one hits less than the other ("reuse available
elsewhere"), and every lookup that broke a check (a release serving what it must not).
Shrinking and reproducers are differential_shrink's; rendering is differential_report's.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..fuzz.reuse_workloads import generate
from ..spec.outputs import file_stem
from ..spec.verdict import ExitCode
from .matrix_envs import ROOT

START_TIMEOUT_S = 900.0            # importing the engine and listing its layouts
REPLY_TIMEOUT_S = 1800.0           # one request's workloads


class DriverError(RuntimeError):
    """A release's driver failed: one line."""


Key = tuple[str, int]              # (trace, step) of a lookup


def driver_env() -> dict[str, str]:
    """kvcheck's repository first on PYTHONPATH (the release's python runs this kvcheck)."""
    extra = [p for p in [os.environ.get("PYTHONPATH")] if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + extra))


class ReleaseProc:
    """One release's driver process; `ask` sends one request and waits for its line."""

    def __init__(self, python: str, engine_ref: str, log: Path | None = None) -> None:
        self.python, self.n = python, 0
        err = open(log, "a") if log else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen([python, "-m", "kvcheck.checker.differential_driver", engine_ref],
                                         cwd=ROOT, env=driver_env(), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True)
        except OSError as e:
            raise DriverError(f"the driver did not start ({python}: {e.strerror or e})") from None
        finally:
            if log:
                err.close()
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.hello = self._line(START_TIMEOUT_S)
        if self.hello.get("type") != "release" or self.hello.get("error"):
            self.close()
            raise DriverError(str(self.hello.get("error") or f"unexpected first line {str(self.hello)[:80]}"))
        self.release: str | None = self.hello.get("release")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw)
        self.lines.put(None)

    def _line(self, timeout: float) -> dict[str, Any]:
        try:
            raw = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise DriverError(f"the driver timed out (no answer in {timeout:g}s)") from None
        if raw is None:
            raise DriverError(f"the driver died (exit {self.proc.wait()})")
        try:
            obj = json.loads(raw)
        except ValueError:
            raise DriverError(f"unreadable driver output {raw.strip()[:80]!r}") from None
        if not isinstance(obj, dict):
            raise DriverError(f"unreadable driver output {raw.strip()[:80]!r}")
        return obj

    def ask(self, request: dict[str, Any], timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        self.n += 1
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(dict(request, id=self.n)) + "\n")
            self.proc.stdin.flush()
        except OSError:
            raise DriverError(f"the driver died (exit {self.proc.wait()})") from None
        got = self._line(timeout)
        if got.get("error"):
            raise DriverError(str(got["error"]))
        return got

    def sizes(self, layout: str) -> dict[str, int]:
        return self.ask({"layout": layout, "sizes": True})["sizes"]

    def replay(self, layout: str, workloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        recs = self.ask({"layout": layout, "workloads": workloads}).get("records")
        if not isinstance(recs, list) or not all(isinstance(r, dict) and isinstance(r.get("trace"), str)
                                                 and type(r.get("step")) is int and type(r.get("hit")) is int
                                                 for r in recs):
            raise DriverError("unreadable driver output: records without trace, step and hit")
        return recs

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@dataclass
class Side:
    """One release on one layout: its records, or why it has none."""
    label: str                          # its release (or python, when it reports none)
    python: str
    records: list[dict[str, Any]] = field(default_factory=list)
    status: str = "ran"                 # ran, cannot express, error
    why: str | None = None

    def hits(self) -> dict[Key, dict[str, Any]]:
        return {(r["trace"], r["step"]): r for r in self.records}

    def ratio(self) -> float | None:
        total = sum(int(r.get("prompt_tokens") or 0) for r in self.records)
        return round(sum(r["hit"] for r in self.records) / total, 4) if total else None


Opener = Callable[[str], ReleaseProc]


def run_releases(pythons: list[str], layouts: list[str], opener: Opener, seed: int, count: int,
                 given: list[dict[str, Any]] | None, say: Callable[[str], None], records: Path | None = None
                 ) -> tuple[dict[str, list[Side]], dict[str, list[dict[str, Any]]]]:
    """Every release (one driver at a time) on every layout: the sides per layout, and the
    workloads each layout ran (generated by the first release that can express it); with
    `records`, each side's records in records/LAYOUT/RELEASE.jsonl."""
    sides: dict[str, list[Side]] = {lay: [] for lay in layouts}
    workloads: dict[str, list[dict[str, Any]]] = {}
    for py in pythons:
        try:
            proc = opener(py)
        except DriverError as e:
            say(f"kvcheck matrix --differential: {py}: {e}")
            for lay in layouts:
                sides[lay].append(Side(py, py, status="error", why=str(e)))
            continue
        label = proc.release or py
        taken = {s.label for ss in sides.values() for s in ss}
        label = next(f"{label} ({n})" for n in range(2, 10**6) if f"{label} ({n})" not in taken) \
            if label in taken else label            # (two pythons with one release: both shown)
        say(f"kvcheck matrix --differential: {label} ({py}) ...")
        try:
            for lay in layouts:
                sides[lay].append(_one(proc, label, lay, seed, count, given, workloads, records))
        finally:
            proc.close()
    return sides, workloads


def _one(proc: ReleaseProc, label: str, lay: str, seed: int, count: int, given: list[dict[str, Any]] | None,
         workloads: dict[str, list[dict[str, Any]]], records: Path | None) -> Side:
    side = Side(label, proc.python)
    known, unsupported = proc.hello.get("layouts") or [], proc.hello.get("unsupported") or {}
    if lay not in known or lay in unsupported:
        side.status, side.why = "cannot express", str(unsupported.get(lay) or f"{label} has no layout {lay!r}")
        return side
    try:
        if lay not in workloads:
            workloads[lay] = given if given is not None else generate(seed, count, proc.sizes(lay))
        side.records = proc.replay(lay, workloads[lay])
        if records is not None:                 # every lookup's record, for reading later
            path = records / file_stem(lay) / f"{file_stem(label)}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r) + "\n" for r in side.records))
    except (DriverError, ValueError) as e:
        side.status, side.why = "error", str(e)
    return side


# ---- comparing ------------------------------------------------------------------------------
def compare(sides: list[Side]) -> dict[str, Any]:
    """Per release its reuse ratio; per ordered pair (A, B) the lookups where A hits less than B;
    the releases grouped by identical hits; every lookup that broke a check."""
    ran = [s for s in sides if s.status == "ran"]
    hits = {s.label: s.hits() for s in ran}
    less: dict[str, dict[str, list[Key]]] = {a.label: {} for a in ran}
    for a in ran:
        for b in ran:
            if a is not b:
                less[a.label][b.label] = [k for k, r in hits[a.label].items()
                                          if k in hits[b.label] and r["hit"] < hits[b.label][k]["hit"]]
    classes: dict[tuple, list[str]] = {}
    for s in ran:
        classes.setdefault(tuple(sorted((k, r["hit"]) for k, r in hits[s.label].items())), []).append(s.label)
    unsound = [{"release": s.label, "trace": r["trace"], "step": r["step"], "check": r["violation"].get("check"),
                "kind": r["violation"].get("kind"), "message": r["violation"].get("message"), "hit": r["hit"],
                "known": r["violation"].get("known"),
                "more_than": [b.label for b in ran if (r["trace"], r["step"]) in hits[b.label]
                              and hits[b.label][(r["trace"], r["step"])]["hit"] < r["hit"]]}
               for s in ran for r in s.records
               if isinstance(r.get("violation"), dict) and r["violation"].get("kind") != "lost_reuse"]
    return {"ratios": {s.label: s.ratio() for s in ran}, "less": less, "classes": list(classes.values()),
            "unsound": unsound}


def class_pairs(cmp: dict[str, Any]) -> list[tuple[str, str, list[Key]]]:
    """(less, more, lookups) for each ordered pair of release classes where the first class's
    representative hits less on some lookup: one difference to shrink per pair."""
    reps = [c[0] for c in cmp["classes"]]
    return [(a, b, cmp["less"][a][b]) for a in reps for b in reps if a != b and cmp["less"][a][b]]


def exit_code(per_layout: dict[str, dict[str, Any]]) -> int:
    """3 when a release could not be replayed or no layout ran on two releases (nothing was
    compared); else 10 for an unsound lookup; else 13 when reuse differs between releases; else 0."""
    sides = [s for d in per_layout.values() for s in d["sides"]]
    compared = any(sum(s["status"] == "ran" for s in d["sides"]) >= 2 for d in per_layout.values())
    if not compared or any(s["status"] == "error" for s in sides):
        return int(ExitCode.UNDECIDED)
    if any(d["compare"]["unsound"] for d in per_layout.values()):
        return int(ExitCode.INVARIANT)
    if any(class_pairs(d["compare"]) for d in per_layout.values()):
        return int(ExitCode.CONFORMANCE)
    return int(ExitCode.OK)
