"""The corpus of finding traces the gate replays first, like Hypothesis's example database.

A bug the gate once found stays a regression test: every finding of a gate run is saved here
(atomically, named by its content so a finding found again is not saved twice), and every
trace here is replayed on the system its `sut` names before the engines run. A trace that
still fails is a failing check; one that now replays clean is reported "fixed" (a passing
check; the file stays, as a regression test). A file that is not a clean-run kvcheck trace is
bad input: one line naming the file, exit 2, before anything runs.
"""
from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path
from typing import Any

from ..spec.outputs import kvcheck_command, write_atomic
from ..spec.trace import Trace, TraceError
from .common import UsageError
from .project_engines import check, finding


def load_corpus(root: Path) -> list[tuple[Path, Trace]]:
    """Every *.json trace under `root` (none when it does not exist); bad files are exit 2."""
    if not root.exists():
        return []
    if not root.is_dir():
        raise UsageError(f"corpus {root} is a file, not a directory")
    out = []
    for p in sorted(root.glob("*.json")):
        try:
            t = Trace.load(p)
        except TraceError as e:
            msg = " ".join(str(e).split())
            raise UsageError(msg if str(p) in msg else f"corpus trace {p}: {msg}") from None
        if not t.steps or not t.violation:
            raise UsageError(f"corpus trace {p}: records no finding ({'no steps' if not t.steps else 'violation is null'}"
                             "); the corpus keeps the traces of findings")
        planted = t.fault or (t.meta or {}).get("sut_fault")
        if planted:
            raise UsageError(f"corpus trace {p}: plants fault {planted!r}; the corpus keeps findings of "
                             "clean runs (list planted faults as expected_faults instead)")
        out.append((p, t))
    return out


def replay_one(path: Path, trace: Trace) -> tuple[int, dict[str, Any]]:
    """Replay on the trace's own SUT (vLLM's driver for vLLM traces)."""
    from ..fuzz import registry
    from ..fuzz.engine import EngineUnavailable
    try:
        eng = registry.get(trace.sut) if trace.sut != "spec" and ":" not in trace.sut else None
    except registry.UnknownEngine:
        eng = None
    if eng is not None and eng.has_replay():
        try:
            code, r, _ = eng.replay(trace)
        except (EngineUnavailable, ValueError) as e:
            return -1, {"why": str(e)}
        return code, {"finding": r.get("violation") and {"kind": r["violation"]["kind"],
                                                         "message": r["violation"]["message"]}}
    from ..fuzz.suts import SutError, resolve_sut
    from ..fuzz.traces import replay
    try:
        sut = None if trace.sut == "spec" else resolve_sut(trace.sut)()
    except SutError as e:
        return -1, {"why": str(e)}
    return replay(trace, sut)


def replay_corpus(entries: list[tuple[Path, Trace]], enabled: set[str]) -> list[dict[str, Any]]:
    """One check per trace, under its system's replay-corpus engine."""
    checks = []
    for path, trace in entries:
        system = trace.sut
        if system not in enabled:
            checks.append(check(system, "replay-corpus", path.name, "skipped", 0.0, {"steps": len(trace.steps)},
                                note=f"replay-corpus is not enabled for {system} in the project file"))
            continue
        t0 = time.perf_counter()
        code, out = replay_one(path, trace)
        secs = time.perf_counter() - t0
        counts = {"steps": len(trace.steps), "exit_code": code}
        cmd = kvcheck_command("replay", path, *([] if system == "spec" else ["--sut", system]))
        if code == -1:
            checks.append(check(system, "replay-corpus", path.name, "skipped", secs, counts, note=out["why"]))
        elif code == 0:
            checks.append(check(system, "replay-corpus", path.name, "fixed", secs, counts,
                                note="replays clean now: the finding is fixed (kept as a regression test)"))
        else:
            f = out.get("finding") or {}
            checks.append(check(system, "replay-corpus", path.name, "failed", secs, counts,
                                finding(f.get("kind", "conformance"), f.get("message", f"replay exit {code}"),
                                        cmd, [s.label() for s in trace.steps])))
    return checks


def finding_key(t: Trace) -> tuple[str, str]:
    """What a trace reproduces: its system and the check it fails."""
    v = t.violation or {}
    return t.sut, str(v.get("check") or ",".join(v.get("invariants") or []) or v.get("kind"))


def save_findings(root: Path, traces: list[tuple[str, str, str]], known: list[tuple[Path, Trace]]) -> list[str]:
    """Copy each (system, engine, trace file) into the corpus, unless the corpus already holds a
    trace of the same system failing the same check (one trace per finding, as Hypothesis keeps
    one example per failure: a re-found bug's trace may shrink differently under a time bound)
    or the same bytes."""
    have = {hashlib.sha256(p.read_bytes()).hexdigest()[:12] for p, _ in known}
    keys = {finding_key(t) for _, t in known}
    saved = []
    for system, engine, src in traces:
        data = Path(src).read_bytes()
        digest = hashlib.sha256(data).hexdigest()[:12]
        try:
            key = finding_key(Trace.load(src))
        except TraceError:
            continue                     # not a trace of the one format: nothing to replay
        if digest in have or key in keys or any(root.glob(f"*-{digest}.json")):
            continue
        have.add(digest)
        keys.add(key)
        stem = re.sub(r"[^A-Za-z0-9_.+-]", "_", f"{system}-{engine}")
        dest = write_atomic(root / f"{stem}-{digest}.json", data)
        saved.append(str(dest))
    return saved
