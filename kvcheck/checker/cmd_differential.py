"""`kvcheck matrix --differential`: checked arguments -> releases replayed, compared, shrunk.

cmd_matrix parses and checks the matrix's common arguments (engine, releases or --python, layouts,
--out, --envs) and hands over here; this module refuses what the differential does not take,
reads --traces (differential_traces.py), builds the releases' environments (matrix_envs, one at a time), then runs
differential.py, shrinks each difference (differential_shrink.py) and writes the outputs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..spec.outputs import file_stem
from .common import UsageError, emit

NOT_WITH = {"budget_per_cell": "--budget-per-cell", "fuzz_option": "--fuzz-option", "resume": "--resume"}


def check_args(args: argparse.Namespace, eng: Any) -> list[dict[str, Any]] | None:
    """Refuse what the differential does not take; the workloads of --traces (None: generated)."""
    for dest, flag in NOT_WITH.items():
        if getattr(args, dest, None):
            raise UsageError(f"{flag}: not used by --differential (it replays workloads, no campaign)")
    if not 0 <= args.shrink_seconds < float("inf"):
        raise UsageError(f"--shrink-seconds: expected a number of seconds >= 0, not {args.shrink_seconds!r}")
    if args.workers != 1:
        raise UsageError("--workers: --differential runs one release at a time")
    if not eng.has_replay_reuse():
        raise UsageError(f"--differential: engine {eng.name} has no replay_reuse (no cross-release differential)")
    if args.traces is None:
        return None
    from .differential_traces import read_traces
    return read_traces(args.traces, eng)


def pythons_of(sources: list[Any], eng: Any, envs: Path | None, say: Any) -> tuple[list[str], list[dict[str, str]]]:
    """Each source's python: given, or its release's environment (built once, then reused);
    and the releases whose environment did not build, with why."""
    from .matrix_envs import ensure_env
    out, failed = [], []
    for src in sources:
        if src.python is not None:
            out.append(src.python)
            continue
        assert envs is not None
        say(f"kvcheck matrix --differential: {eng.name} {src.release}: environment ...")
        env = ensure_env(eng.name, eng.distribution, eng.install_script, src.release, envs)
        if env.error:
            failed.append({"release": src.release, "why": env.error})
        else:
            out.append(str(env.python))
    return out, failed


def run(args: argparse.Namespace, eng: Any, sources: list[Any], envs: Path | None, layouts: list[str],
        command: str) -> int:
    from . import differential as df
    from .differential_report import layout_data, render_text, write_outputs
    from .differential_shrink import breaks, less_than, shrink_trace, shrunk_hits, write_difference
    from .matrix import progress_line as say

    given = check_args(args, eng)
    out = Path(args.out)
    ref = f"{type(eng).__module__}:{type(eng).__qualname__}"
    logs = out.resolve() / "drivers"
    logs.mkdir(parents=True, exist_ok=True)
    pythons, failed = pythons_of(sources, eng, envs, say)

    def opener(py: str) -> df.ReleaseProc:
        return df.ReleaseProc(py, ref, logs / "differential.stderr.log")

    sides, workloads = df.run_releases(pythons, layouts, opener, args.seed, args.workloads, given, say,
                                       out / "records")
    for f in failed:
        for lay in layouts:
            sides[lay].append(df.Side(f["release"], "", status="error", why=f["why"]))
    per_layout: dict[str, dict[str, Any]] = {}
    judged: dict[str, dict[str, Any]] = {}
    differences: list[dict[str, Any]] = []
    (out / "workloads").mkdir(parents=True, exist_ok=True)
    for lay in layouts:
        cmp = df.compare(sides[lay])
        per_layout[lay] = layout_data(sides[lay], cmp, workloads.get(lay))
        judged[lay] = {"sides": per_layout[lay]["sides"], "compare": cmp}
        (out / "workloads" / f"{file_stem(lay)}.json").write_text(json.dumps(workloads.get(lay) or []))
        ran = {s.label: s for s in sides[lay] if s.status == "ran"}
        for d in _todo(cmp, workloads.get(lay) or [], args.max_differences - len(differences)):
            key = (d["origin"], d["step"])
            d["hit_less"], d["hit_more"] = (ran[d[k]].hits()[key]["hit"] for k in ("less", "more"))
            procs: dict[str, df.ReleaseProc] = {}
            try:
                for k in dict.fromkeys([d["less"], d["more"]]):
                    procs[k] = opener(ran[k].python)
                holds = breaks(d["less"], d["check"]) if d.get("check") else less_than(d["less"], d["more"])
                d["trace"] = shrink_trace(d["trace"], lay, procs, holds, args.shrink_seconds)
                d["shrunk_hits"] = shrunk_hits(d["trace"], lay, procs)
            except df.DriverError as e:              # kept whole: the difference stands unshrunk
                d["shrink_error"] = str(e)
            finally:
                for p in procs.values():
                    p.close()
            differences.append(write_difference(out, eng.name, ref, lay, d,
                                                {k: v.python for k, v in ran.items()}, command))
    data = {"engine": eng.name, "command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "seed": args.seed, "workloads": len(given) if given is not None else args.workloads,
            "pythons": pythons, "build_failures": failed, "layouts": per_layout, "differences": differences,
            "out": str(out), "kvcheck_python": sys.executable, "exit_code": df.exit_code(judged)}
    write_outputs(data, out)
    emit(args, data, lambda: render_text(data))
    return data["exit_code"]


def _todo(cmp: dict[str, Any], workloads: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """The differences to shrink: one per ordered pair of release classes (releases with the same
    hits on every lookup; the first workload that shows it) and one per class and broken check,
    at most `limit`."""
    from .differential import class_pairs
    by_name = {w["name"]: w for w in workloads}
    out: list[dict[str, Any]] = []
    members = {c[0]: c for c in cmp["classes"]}
    for a, b, keys in class_pairs(cmp):
        t, step = keys[0]
        out.append({"less": a, "more": b, "origin": t, "step": step, "trace": by_name[t], "check": None,
                    "less_class": members[a], "more_class": members[b], "lookups": len(keys)})
    rep = {r: c[0] for c in cmp["classes"] for r in c}
    seen = set()
    for u in cmp["unsound"]:                   # one per class of releases and check
        if (rep.get(u["release"]), u["check"]) not in seen:
            seen.add((rep.get(u["release"]), u["check"]))
            out.append({"less": u["release"], "more": (u["more_than"] or [u["release"]])[0], "origin": u["trace"],
                        "step": u["step"], "trace": by_name[u["trace"]], "check": u["check"], "kind": u["kind"],
                        "known": u["known"]})
    return out[:max(0, limit)]
