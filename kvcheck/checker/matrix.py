"""`kvcheck matrix`: every release of an engine x every layout, one verdict per cell.

For each release (an environment built by matrix_envs, or an interpreter given with --python)
one driver process (matrix_driver, run by that release's python) lists the layouts the release
has and runs a `kvcheck fuzz` campaign on each, writing one JSON line per cell as it goes. This
module runs the drivers (`run_driver`: a watchdog, a log per driver), reads their lines
(`read_lines`: anything unreadable is an `error` cell, never an exception), judges each cell
(`classify`) and gives the matrix's exit code. Rendering is matrix_report's.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..spec.outputs import file_stem
from ..spec.verdict import ExitCode
from .matrix_cells import (FINDING_CODES, LEGEND, UNPROVEN, VERDICTS, BadLine, classify,  # noqa: F401 - re-exported
                           plain)
from .matrix_envs import ROOT, Env, ensure_env, last_line

FIRST_LINE_TIMEOUT_S = 900.0            # importing the engine and listing its layouts
COLUMN = "{COLUMN}"                     # in a cell's argument template: the cell's layout / model type


# ---- one driver's lines -> one row ----------------------------------------------------------
def read_lines(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The driver's records, and each unreadable line described (garbage, a cut-off line)."""
    good, bad = [], []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
        ok = isinstance(obj, dict) and obj.get("type") in ("release", "start", "cell", "done")
        if ok and obj["type"] == "release":
            err = obj.get("error")
            ok = isinstance(err, str) if err is not None else (
                isinstance(obj.get("layouts"), dict) and isinstance(obj.get("unsupported") or {}, dict)
                and (obj.get("release") is None or isinstance(obj["release"], str)))
        if ok and obj["type"] in ("start", "cell"):
            ok = isinstance(obj.get("layout"), str)
        if ok:
            good.append(obj)
        else:
            bad.append(f"line {n}: {raw.strip()[:80]!r}")
    return good, bad


@dataclass
class Source:
    """Where a row's python comes from: a release to build, or an interpreter given."""
    release: str | None = None
    python: str | None = None


@dataclass
class Plan:
    engine: str
    budget: str
    seed: int
    out: Path
    columns: list[str]                      # the layouts the table shows
    layouts: list[str] | None               # --layouts (None: every layout a release has)
    sources: list[Source] = field(default_factory=list)
    distribution: str = ""
    script: str | None = None
    envs: Path | None = None
    workers: int = 1
    cell_timeout_s: float = 3600.0
    fuzz_args: list[str] = field(default_factory=list)    # --fuzz-option: every cell's fuzz gets them
    # one cell's kvcheck arguments (Engine.matrix_cell with COLUMN for the column); empty: fuzz
    cell_args: list[str] = field(default_factory=list)
    resume: bool = False                    # keep the cells a previous run with the same key finished


def fill_cell(template: list[str] | None, engine: str, budget: Any, seed: Any, column: str) -> list[str]:
    """A cell's kvcheck arguments from its template (Engine.matrix_cell with COLUMN; none: a fuzz
    campaign on the layout, as matrices written before templates ran), `column` put in."""
    template = template or ["fuzz", "--sut", engine, "--layout", COLUMN, "--budget", str(budget), "--seed", str(seed)]
    return [column if a == COLUMN else a for a in template]


def cell_argv(plan: Plan, layout: str) -> list[str]:
    """The kvcheck arguments of one cell, before --fuzz-option, --json and --out."""
    return fill_cell(plan.cell_args, plan.engine, plan.budget, plan.seed, layout)


def rerun_command(python: str, plan: Plan, layout: str, out_dir: str, drive: Any = None) -> str:
    """The command that reruns one cell, as the driver ran it; `drive`: the one the cell's run
    resolved (vLLM's --drive auto), named unless --fuzz-option gave one."""
    pin = ["--drive", drive] if isinstance(drive, str) and drive and "--drive" not in plan.fuzz_args else []
    return shlex.join([f"PYTHONPATH={ROOT}", python, "-m", "kvcheck", *cell_argv(plan, layout), *plan.fuzz_args,
                       *pin, "--out", out_dir])


def build_row(text: str, exit_code: int | None, plan: Plan, python: str, expected: str | None = None,
              note: str | None = None, stderr: str = "") -> dict[str, Any]:
    """A release's row from its driver's lines and how the driver ended (`exit_code`, and `note`:
    timed out / interrupted). Every wanted layout gets exactly one cell."""
    events, garbage = read_lines(text)
    rel = next((e for e in events if e["type"] == "release"), None)
    out_dir = (rel or {}).get("out_dir")
    row: dict[str, Any] = {"release": (rel or {}).get("release") or expected, "requested": expected,
                           "python": python, "error": None, "cells": {},
                           "out_dir": out_dir if isinstance(out_dir, str) else None}
    died = note or (f"the driver died (exit {exit_code})" if exit_code not in (0, None) or
                    not any(e["type"] == "done" for e in events) else None)
    tail = last_line(stderr)[:300]

    def missing_why(layout: str | None = None) -> str:
        if garbage:
            return f"unreadable driver output ({garbage[0]})"
        started = [e["layout"] for e in events if e["type"] == "start"]
        during = f" while running {layout}" if layout and started and started[-1] == layout else ""
        if died:
            return f"{died}{during}" + (f": {tail}" if tail else "")
        return "the driver wrote no result for it"

    wanted = plan.layouts
    if rel is None or rel.get("error") is not None:
        why = (rel["error"] or "the driver failed without saying why") if rel else missing_why()
        return dict(error_row(plan, row["release"], python, why), out_dir=row["out_dir"])
    layouts, unsupported = rel["layouts"], rel.get("unsupported") or {}
    out_dir = row["out_dir"] or str(plan.out.resolve() / file_stem(f"{plan.engine}-{row['release']}"))
    row["out_dir"] = out_dir
    cells = {e["layout"]: e for e in events if e["type"] == "cell"}
    for lay in wanted if wanted is not None else list(layouts):
        if lay not in layouts:
            row["cells"][lay] = plain(lay, "cannot express", f"{plan.engine} {row['release']} has no layout {lay!r}")
        elif lay in unsupported:
            row["cells"][lay] = plain(lay, "cannot express", str(unsupported[lay]))
        elif lay in cells:
            try:
                res = cells[lay].get("result")
                drive = res.get("drive") if isinstance(res, dict) else None
                row["cells"][lay] = classify(cells[lay], rerun_command(python, plan, lay, out_dir, drive))
            except BadLine as e:
                row["cells"][lay] = plain(lay, "error", f"unreadable driver output for {lay}: {e}")
        else:
            row["cells"][lay] = plain(lay, "error", missing_why(lay), rerun=rerun_command(python, plan, lay, out_dir))
    return row


def error_row(plan: Plan, release: str | None, python: str | None, why: str) -> dict[str, Any]:
    """A row whose release never got to run a cell: every layout shown is an `error` with `why`."""
    return {"release": release, "requested": release, "python": python, "error": why, "out_dir": None,
            "cells": {lay: plain(lay, "error", why) for lay in (plan.layouts or plan.columns)}}


def cell_key(spec: dict[str, Any]) -> str:
    """What makes two runs of a cell the same run (--resume keeps a cell only under the same key)."""
    return json.dumps([str(spec.get("budget")), spec.get("seed"), spec.get("cell") or [], spec.get("fuzz_args") or []])


# ---- running a driver -----------------------------------------------------------------------
def cell_timeout(budget_seconds: float | None) -> float:
    """How long a cell may take before its driver is stopped: its budget three times over plus
    ten minutes (shrinking a finding, writing its reproducer); an hour for a step budget."""
    return 3 * budget_seconds + 600 if budget_seconds is not None else 3600.0


def run_driver(python: str, plan: Plan, label: str, expected: str | None,
               stop: threading.Event) -> tuple[str, int | None, str | None, str]:
    """Run one driver to its end: (its lines, exit code, a note when kvcheck stopped it, the
    tail of its stderr). Its lines and stderr are kept in OUT/drivers/."""
    logs = plan.out.resolve() / "drivers"          # the driver runs in kvcheck's repository
    logs.mkdir(parents=True, exist_ok=True)
    lines, errlog = logs / f"{file_stem(label)}.jsonl", logs / f"{file_stem(label)}.stderr.log"
    spec = {"lines": str(lines), "sut": plan.engine, "budget": plan.budget, "seed": plan.seed,
            "out": str(plan.out.resolve()), "layouts": plan.layouts, "expected": expected,
            "fuzz_args": plan.fuzz_args, "cell": plan.cell_args}
    kept = kept_cells(lines, spec) if plan.resume else []
    lines.write_text("".join(json.dumps(c) + "\n" for c in kept))
    spec["kept"] = {c["layout"]: c["release"] for c in kept}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    note = None
    with open(errlog, "w") as err:
        try:
            proc = subprocess.Popen([python, "-m", "kvcheck.checker.matrix_driver", json.dumps(spec)],
                                    cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        except OSError as e:
            return "", None, f"the driver did not start ({python}: {e.strerror or e})", ""
        size, since = -1, time.monotonic()
        while True:
            try:
                code: int | None = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            now, n = time.monotonic(), lines.stat().st_size
            if n != size:
                size, since = n, now
            limit = FIRST_LINE_TIMEOUT_S if n == 0 else plan.cell_timeout_s
            if stop.is_set() or now - since > limit:
                note = "interrupted" if stop.is_set() else f"the driver timed out (no result in {limit:g}s)"
                proc.kill()
                proc.wait()
                code = None
                break
    return lines.read_text(errors="replace"), code, note, errlog.read_text(errors="replace")[-4000:]


def kept_cells(path: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """--resume: the cell records of a previous driver's file that ran under the same key
    (budget, seed, cell command, fuzz options) and say which release they ran on; a cell with a
    traceback or no exit code is run again."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    events, _ = read_lines(text)
    key = cell_key(spec)
    cells = {e["layout"]: e for e in events if e["type"] == "cell" and e.get("key") == key
             and isinstance(e.get("release"), str) and type(e.get("code")) is int and e.get("traceback") is None}
    return list(cells.values())


# ---- the whole matrix ------------------------------------------------------------------------
Builder = Callable[[str], Env]
Driver = Callable[..., tuple]          # run_driver's signature


_SAY = threading.Lock()


def progress_line(text: str) -> None:
    """One whole line on stderr (the release threads never interleave within a line)."""
    with _SAY:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def run_matrix(plan: Plan, build: Builder | None = None, drive: Driver | None = None,
               say: Callable[[str], None] = progress_line) -> list[dict[str, Any]]:
    """Every source's row (release order), builds and drivers `plan.workers` at a time. Ctrl-C:
    the drivers are stopped, their rows say "interrupted", KeyboardInterrupt is re-raised with
    the rows so far on it (`.rows`)."""
    if build is None:
        def build(release: str) -> Env:
            assert plan.envs is not None and plan.script is not None
            return ensure_env(plan.engine, plan.distribution, plan.script, release, plan.envs)
    drive = drive or run_driver
    stop = threading.Event()

    def one(i: int, src: Source) -> dict[str, Any]:
        t0 = time.monotonic()
        python, env = src.python, None
        if src.release is not None and python is None:
            say(f"kvcheck matrix: {plan.engine} {src.release}: environment ...")
            env = build(src.release)
            if env.error:
                say(f"kvcheck matrix: {plan.engine} {src.release}: {env.error}")
                return dict(error_row(plan, src.release, None, env.error), env=env.dir, env_built=False,
                            elapsed_s=round(time.monotonic() - t0, 1))
            python = env.python
            say(f"kvcheck matrix: {plan.engine} {src.release}: "
                + (env.summary if env.built else f"environment reused ({env.dir})"))
        assert python is not None
        label = f"{plan.engine}-{src.release}" if src.release else f"{plan.engine}-python{i + 1}"
        say(f"kvcheck matrix: {label}: driver started ({python})")
        text, code, note, stderr = drive(python, plan, label, src.release, stop)
        row = build_row(text, code, plan, python, src.release, note=note, stderr=stderr)
        if env is not None:
            row.update(env=env.dir, env_built=env.built, env_summary=env.summary)
        row["elapsed_s"] = round(time.monotonic() - t0, 1)
        counts = count(row["cells"].values())
        say(f"kvcheck matrix: {plan.engine} {row['release'] or python}: "
            + ", ".join(f"{n} {v}" for v, n in counts.items() if n))
        return row

    rows: list[dict[str, Any] | None] = [None] * len(plan.sources)
    pool = ThreadPoolExecutor(max_workers=max(1, plan.workers))
    futures = {pool.submit(one, i, s): i for i, s in enumerate(plan.sources)}
    try:
        for fut, i in futures.items():
            rows[i] = fut.result()
    except KeyboardInterrupt as e:
        stop.set()
        for fut in futures:
            fut.cancel()
        pool.shutdown(wait=True)
        for fut, i in futures.items():                        # what finished, or stopped, says so
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                rows[i] = fut.result()
        e.rows = [r for r in rows if r is not None]          # type: ignore[attr-defined]
        raise
    pool.shutdown(wait=True)
    return sort_rows([r for r in rows if r is not None])


def sort_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from packaging.version import InvalidVersion, Version

    def key(r: dict[str, Any]) -> tuple:
        try:
            return (0, Version(str(r.get("release"))), "")
        except InvalidVersion:
            return (1, Version("0"), str(r.get("python")))
    return sorted(rows, key=key)


def count(cells: Any) -> dict[str, int]:
    out = {v: 0 for v in VERDICTS}
    for c in cells:
        out[c["verdict"]] = out.get(c["verdict"], 0) + 1
    return out


def exit_code(rows: list[dict[str, Any]]) -> int:
    """3 when any cell is unproven (cannot drive, undecided, error) or no cell ran at all; else
    the first finding's exit code; else 0."""
    cells = [c for r in rows for c in r["cells"].values()]
    if not cells or any(c["verdict"] in UNPROVEN for c in cells) or \
            all(c["verdict"] == "cannot express" for c in cells):
        return int(ExitCode.UNDECIDED)
    for c in cells:
        if c["verdict"] == "finding":
            return int(c["exit_code"]) if c.get("exit_code") in FINDING_CODES else int(ExitCode.INVARIANT)
    return int(ExitCode.OK)
