"""`kvcheck gate` with a project file: the user's systems, engines, budgets and seeds.

Order: the corpus is replayed first (a bug once found stays a regression test), then every
system's engines for each of its seeds (and each vLLM layout / transformers model type), then
its expected faults (each must be caught by its expected check). Results are per check and
merged over seeds; the verdict's exit code is the first failing check's, else 3 when a check
could not decide (or a planted fault survived), else 0. New findings go into the corpus.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from .. import __version__
from ..spec.config import Config
from ..spec.verdict import ExitCode
from . import project_engines as pe
from .corpus import load_corpus, replay_corpus, save_findings
from .project import FAULT_ENGINES, Project, System

RANK = {"failed": 4, "undecided": 3, "passed": 2, "fixed": 2, "acknowledged": 2, "skipped": 1}


def variants(sys: System) -> list[str | None]:
    return list(sys.variants) or [None]


def _run_engine(sys: System, engine: str, cfg: Config, seed: int, variant: str | None, out: Path) -> pe.EngineRun:
    if engine == "walk":
        return pe.run_walk(sys, cfg, seed, out)
    if engine == "prove":
        return pe.run_prove(sys, cfg, out)
    if engine == "explore":
        return pe.run_explore(sys, out)
    if engine == "exhaustive":
        return pe.run_exhaustive(sys, cfg, seed, out)
    if variant is not None:                      # a registered engine's layout / model type
        return pe.run_engine_variant(sys, variant, seed, out)
    if engine == "fuzz":
        return pe.run_fuzz(sys, cfg, seed, out)
    return pe.run_reference_diff(sys, cfg, seed, out)


class Results:
    """Checks merged over seeds (worst verdict, summed time and counts), per engine run."""

    def __init__(self) -> None:
        self.checks: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.engines: dict[str, dict[str, Any]] = {}
        self.traces: list[tuple[str, str, str]] = []

    def add(self, engine: str, run: pe.EngineRun, system: str | None = None) -> None:
        for c in run.checks:
            key = (c["system"], c["engine"], c["check"])
            old = self.checks.get(key)
            if old is None:
                self.checks[key] = dict(c, counts=dict(c["counts"]))
                continue
            old["seconds"] = round(old["seconds"] + c["seconds"], 3)
            for k, v in c["counts"].items():
                if isinstance(v, int) and isinstance(old["counts"].get(k), int):
                    old["counts"][k] += v
            if RANK[c["verdict"]] > RANK[old["verdict"]]:
                old.update(verdict=c["verdict"], finding=c["finding"], note=c["note"])
        label = system or (run.checks[0]["system"] if run.checks else "?")
        e = self.engines.setdefault(f"{label} {engine}", {"system": label, "engine": engine, "runs": 0,
                                                         "seconds": 0.0, "counts": {}, "exit_code": 0})
        e["runs"] += 1
        e["seconds"] = round(e["seconds"] + run.seconds, 3)
        for k, v in run.counts.items():
            if isinstance(v, int) and not isinstance(v, bool):
                e["counts"][k] = e["counts"].get(k, 0) + v
        if e["exit_code"] in (0, ExitCode.UNDECIDED) and run.code not in (0,):
            e["exit_code"] = int(run.code)
        self.traces += [(label, engine, t) for t in run.traces]
        for k, v in run.extra.items():          # e.g. reuse_profile: {layout: points}, merged
            if k == "metrics":
                merge_metrics(e.setdefault(k, {}), v)
            else:
                e.setdefault(k, {}).update(v)

    def finish(self) -> None:
        for e in self.engines.values():
            mine = [c for c in self.checks.values() if c["system"] == e["system"] and c["engine"] == e["engine"]]
            tally = {v: sum(c["verdict"] == v for c in mine) for v in RANK}
            e["checks"] = {k: n for k, n in tally.items() if n}
            e["verdict"] = ("failed" if tally["failed"] else "undecided" if tally["undecided"] else
                            "skipped" if mine and tally["skipped"] == len(mine) else "holds")


def merge_metrics(old: dict[str, Any], new: dict[str, Any]) -> None:
    """Hit rates over seeds: the mean weighted by each run's `weight`; degradations summed."""
    w0, w1 = old.get("weight", 0), new["weight"]
    for k in ("logical_hit_rate", "usable_hit_rate"):
        old[k] = round((old.get(k, 0.0) * w0 + new[k] * w1) / (w0 + w1), 4) if w0 + w1 else new[k]
    old["weight"] = w0 + w1
    degr = old.setdefault("degradations", {})
    for reason, n in new["degradations"].items():
        degr[reason] = degr.get(reason, 0) + n


def run_project(proj: Project, out: Path, cfg: Config, command: str,
                progress: Callable[..., None] | None = None) -> tuple[int, dict[str, Any]]:
    corpus = load_corpus(proj.corpus)          # a bad trace is exit 2 before anything runs
    report: dict[str, Any] = {"kvcheck": __version__, "command": command, "project": str(proj.path),
                              "corpus": str(proj.corpus), "seed": None, "fault": None,
                              "systems": [s.name for s in proj.systems], "engines": {}}
    res = Results()
    enabled = {s.name for s in proj.systems if "replay-corpus" in s.engines}
    interrupted = None
    phase = "replay-corpus"
    try:
        if progress:
            progress("replaying the corpus")
        t0 = time.perf_counter()
        rc = replay_corpus(corpus, enabled)
        if rc:
            res.add("replay-corpus", pe.EngineRun(0, time.perf_counter() - t0, {"traces": len(rc)}, rc), "corpus")
        for sys in proj.systems:
            scfg = pe.system_config(sys, cfg)
            for engine in sys.engines:
                if engine == "replay-corpus":
                    continue
                seeds = sys.seeds[:1] if engine in ("prove", "explore") else sys.seeds
                for seed in seeds:
                    for v in variants(sys):
                        phase = f"{sys.name} {engine}" + (f" {v}" if v else "") + f" seed {seed}"
                        if progress:
                            progress(phase)
                        res.add(engine, _run_engine(sys, engine, scfg, seed, v, out))
            for fault in sys.expected_faults:
                for v in variants(sys):
                    phase = f"{sys.name} expected fault {fault}"
                    if progress:
                        progress(phase)
                    c = expected_fault(sys, scfg, out, fault, v)
                    res.add(c["engine"], pe.EngineRun(pe.code_of(c), c["seconds"], {}, [c]), c["system"])
    except KeyboardInterrupt:
        interrupted = phase
    res.finish()
    try:
        saved = save_findings(proj.corpus, res.traces, corpus) if res.traces else []
    except OSError as e:              # the report is still written, and says what was not saved
        saved = []
        report["corpus_error"] = (f"{len(res.traces)} finding trace(s) not saved to the corpus {proj.corpus}: "
                                  f"{e.strerror or e}")
    checks = list(res.checks.values())
    report["engines"] = res.engines
    report["checks"] = checks
    report["findings"] = findings_of(checks)
    report["corpus_saved"] = saved
    report["corpus_replayed"] = len(corpus)
    code = verdict_code(checks)
    failed = [c for c in checks if c["verdict"] == "failed"]
    if interrupted:
        report["interrupted"] = interrupted
        report["verdict"] = f"interrupted during {interrupted}"
        if code not in (ExitCode.OK, ExitCode.UNDECIDED):
            report["verdict"] += f" (after {len(failed)} failing checks)"
        else:
            code = ExitCode.INTERRUPTED
    elif failed:
        report["verdict"] = f"failed ({len(failed)} of {len(checks)} checks)"
    elif code == ExitCode.UNDECIDED:
        report["verdict"] = "undecided: " + "; ".join(
            f"{c['system']} {c['engine']} {c['check']}" for c in checks if c["verdict"] == "undecided")
    else:
        report["verdict"] = "holds"
    report["exit_code"] = int(code)
    return int(code), report


def expected_fault(sys: System, cfg: Config, out: Path, fault: str, variant: str | None) -> dict[str, Any]:
    """A planted fault is caught when one of the system's engines that plant faults catches it
    with its expected check (as in `kvcheck mutants`): they run in order until one does; the
    check is that engine's (the first engine's when none does, with what each one caught)."""
    first: dict[str, Any] | None = None
    seen: list[str] = []
    for engine in (e for e in sys.engines if e in FAULT_ENGINES[sys.kind]):
        c = pe.run_expected_fault(sys, engine, cfg, sys.seeds[0], out, fault, variant)
        if c["verdict"] in ("passed", "skipped", "acknowledged"):
            return c
        seen.append(f"{engine}: {c['finding']['message']}")
        first = first or c
    assert first is not None              # validation requires an engine that plants faults
    if len(seen) > 1:
        first["finding"] = dict(first["finding"], message="; ".join(seen))
    return first


def verdict_code(checks: list[dict[str, Any]]) -> int:
    codes = [pe.code_of(c) for c in checks]
    hard = [c for c in codes if c not in (ExitCode.OK, ExitCode.UNDECIDED)]
    return hard[0] if hard else ExitCode.UNDECIDED if ExitCode.UNDECIDED in codes else ExitCode.OK


def findings_of(checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """report.json "findings": each failing finding once (one finding may fail several checks)."""
    seen: dict[tuple, dict[str, Any]] = {}
    for c in checks:
        f = c.get("finding")
        if c["verdict"] != "failed" or not f:
            continue
        key = (c["system"], c["engine"], f["kind"], f["message"], f.get("replay"))
        if key not in seen:
            seen[key] = {"system": c["system"], "engine": c["engine"], "kind": f["kind"], "check": c["check"],
                         "message": f["message"], "replay": f.get("replay"),
                         "trace_steps": list(f.get("trace_steps") or [])}
    return list(seen.values())


def render_project_md(rep: dict[str, Any]) -> str:
    lines = [f"# kvcheck gate: {rep['verdict']}", "", f"- command: `{rep['command']}` (exit {rep['exit_code']})",
             f"- kvcheck {rep['kvcheck']}, project file `{rep['project']}`, corpus `{rep['corpus']}` "
             f"({rep['corpus_replayed']} traces replayed, {len(rep['corpus_saved'])} findings saved)", "",
             "## Engines", "", "| system | engine | verdict | checks | counts | seconds |", "|---|---|---|---|---|---|"]
    for e in rep["engines"].values():
        lines.append(f"| {e['system']} | {e['engine']} | {e['verdict']} | "
                     + ", ".join(f"{k} {n}" for k, n in e["checks"].items())
                     + " | " + ", ".join(f"{k} {v}" for k, v in e["counts"].items()) + f" | {e['seconds']} |")
    rates = [e for e in rep["engines"].values() if e.get("metrics")]
    if rates:                       # plotted per system in report.html
        lines += ["", "## Hit rates", "", "| system | engine | logical hit rate | usable hit rate | degradations |",
                  "|---|---|---|---|---|"]
        lines += [f"| {e['system']} | {e['engine']} | {e['metrics']['logical_hit_rate']} | "
                  f"{e['metrics']['usable_hit_rate']} | "
                  + (", ".join(f"{k} {n}" for k, n in e["metrics"]["degradations"].items()) or "none") + " |"
                  for e in rates]
    cov = [(e, run, c) for e in rep["engines"].values() for run, c in (e.get("engine_coverage") or {}).items()]
    if cov:                         # `cover` (default on): the engine's own cache code each campaign reached
        lines += ["", "## Engine-code coverage", "",
                  "| system | campaign | lines | run-time lines | branches | annotated |", "|---|---|---|---|---|---|"]
        lines += [f"| {e['system']} | {run} | {c['lines_pct']}% ({c['lines']}/{c['statements']}) | "
                  f"{c.get('runtime_pct')}% | {c['branches_pct']}% | {c.get('annotated') or ''} |" for e, run, c in cov]
    if rep["findings"]:
        lines += ["", "## Findings", ""]
        for f in rep["findings"]:
            lines += [f"- {f['system']} {f['engine']} [{f['kind']}] {f['check']}: {f['message']}"]
            if f["replay"]:
                lines.append(f"  - replay: `{f['replay']}`")
    lines += ["", "## Checks", "", "| system | engine | check | verdict | note |", "|---|---|---|---|---|"]
    lines += [f"| {c['system']} | {c['engine']} | {c['check']} | {c['verdict']} | {c.get('note') or ''} |"
              for c in rep["checks"]]
    return "\n".join(lines) + "\n"
