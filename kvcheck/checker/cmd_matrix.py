"""`kvcheck matrix`: every release of an engine x every layout, one verdict per cell.

Parses and checks everything up front (one line, exit 2, before any environment is built), then
hands the plan to checker/matrix.py and writes matrix_report's outputs. Kept light at import:
cli.py adds the command's arguments from here."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from ..spec.verdict import ExitCode
from .common import UsageError, check_writable, emit, positive_int

DESCRIPTION = """\
Run a short kvcheck fuzz campaign on every layout of every release of an engine (vLLM, SGLang)
and show one verdict per cell, release x layout; for transformers, a column is a model type and a
cell is `kvcheck diff --sut transformers --model-type M --scenarios N` (reuse vs recompute). Each release gets its own side environment
(built once with the engine's install script, then reused), or give interpreters with --python.

what a cell says:
  clean           the campaign ran its budget, every check held, every action was exercised
  finding         a check failed (transformers: reuse diverged from the recompute): the release's defect (a recognised known defect is named,
                  e.g. "finding: fine_cow_same_step (known, vllm#...)"); the notes give the
                  command that replays it
  cannot express  the release cannot build this layout or model type (a class or option it lacks)
  cannot drive    kvcheck cannot drive this release (its stand-ins or call signatures do not fit
                  it): kvcheck's gap, not a finding about the engine
  undecided       the campaign ran but decided nothing (e.g. actions never exercised: a longer
                  --budget-per-cell)
  error           no verdict: a traceback, a driver that died or timed out, an environment that
                  did not build (its one line is in the notes)

exit: 3 if any cell is cannot drive, undecided or error (the matrix did not prove the releases);
else the first finding's code (10-13); else 0. Outputs in --out: matrix-ENGINE.json, .md, .html;
each release's traces under OUT/ENGINE-RELEASE/, the drivers' logs under OUT/drivers/.
Docs: docs/matrix.md

--differential: instead of campaigns, the same workloads (generated from --seed at each layout's
sizes, or --traces FILE|DIR: workloads, saved differences or the engine's campaign traces)
replayed on every release, lookup by lookup: a release x release table per layout (reuse ratio,
lookups where one release hits less than another), each difference shrunk with a two-release
reproducer. exit 3 if a release could not replay, 10 if a lookup broke a check, 13 if reuse
differs between releases, else 0; outputs differential-ENGINE.json, .md, .html, differences/
(docs/differential.md)."""


def add_matrix_arguments(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.add_argument("--sut", required=True, metavar="NAME",
                   help="the engine: vllm, sglang or transformers (any registered engine with a release_range)")
    p.add_argument("--releases", default=None, metavar="WHICH",
                   help="all (every release on the package index in the engine's claimed range), minors "
                        "(the newest release of each X.Y; the default), patches (the newest post release of "
                        "each X.Y.Z: SGLang's releases are all 0.5.Z), rotate:KEY (one X.Y.Z strictly inside "
                        "the range, picked by a hex KEY such as a commit hash: CI), A,B,... or A..B")
    p.add_argument("--python", action="append", metavar="PY", default=None,
                   help="use this existing interpreter as a release instead of building one (repeatable; "
                        "its release is whatever the engine reports there); not with --releases")
    p.add_argument("--allow-outside-range", action="store_true",
                   help="run releases outside the range kvcheck claims to drive")
    p.add_argument("--layouts", metavar="L1,L2", default=None,
                   help="only these layouts (transformers: model types) (default: every one each release has)")
    p.add_argument("--budget-per-cell", default=None, metavar="BUDGET",
                   help="each cell's campaign: a time (30s, 5m) or a step count (300) (default: 30s); "
                        "transformers: a number of kvcheck diff scenarios (default: 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of every campaign (default: %(default)s)")
    p.add_argument("--envs", metavar="DIR", default=None,
                   help="where release environments are built and reused (default: $KVCHECK_ENVS or "
                        "~/.cache/kvcheck/envs)")
    p.add_argument("--out", metavar="DIR", default="kvcheck-matrix", help="output directory (default: %(default)s)")
    p.add_argument("--resume", action="store_true",
                   help="keep every cell a previous run into the same --out finished with the same budget, seed "
                        "and options on the same release, and run only the rest (a long matrix in several "
                        "sittings, or after Ctrl-C)")
    p.add_argument("--workers", type=positive_int, default=1,
                   help="releases built and run side by side (default: %(default)s)")
    p.add_argument("--fuzz-option", action="append", metavar="NAME=VALUE", default=None,
                   help="an option of the engine's kvcheck fuzz for every cell (repeatable), e.g. drive=engine "
                        "or sched_policy=priority for --sut vllm; on/off options take true or false")
    d = p.add_argument_group("cross-release differential (--differential)")
    d.add_argument("--differential", action="store_true",
                   help="replay the same workloads on every release and compare reuse lookup by lookup")
    d.add_argument("--workloads", type=positive_int, default=8, metavar="N",
                   help="generated workloads per layout (chats, resends, shared system prompts, long "
                        "prompts, in turn) (default: %(default)s)")
    d.add_argument("--traces", metavar="PATH", default=None,
                   help="replay these workloads instead: a file or a directory (every *.json in it, sorted) of "
                        "workload lists, saved differences, or kvcheck campaign traces of the engine (each "
                        "trace's requests become one workload; docs/differential.md)")
    d.add_argument("--shrink-seconds", type=float, default=30.0, metavar="S",
                   help="CPU seconds to shrink each difference (default: %(default)s)")
    d.add_argument("--max-differences", type=positive_int, default=6, metavar="N",
                   help="differences shrunk, with a reproducer each (default: %(default)s)")


# fuzz options a cell cannot take from --fuzz-option: the matrix sets the layout, runs each cell
# in its driver's process and keeps its own outputs
CELL_OWNED = frozenset({"layout", "list_layouts", "layout_file", "ray", "redis", "observability"})
SWITCHES = frozenset({"strict_reuse", "strict_known"})        # on/off: VALUE is true or false


def fuzz_args(items: list[str] | None, eng: Any) -> list[str]:
    """--fuzz-option NAME=VALUE ... -> the arguments every cell's `kvcheck fuzz` gets (UsageError:
    one line naming the option)."""
    from .cmd_fuzz import ENGINE_OPTIONS
    allowed = sorted(d for d in ENGINE_OPTIONS if d in eng.fuzz_options and d not in CELL_OWNED)
    out: list[str] = []
    for item in items or []:
        name, sep, value = item.partition("=")
        dest, value = name.strip().removeprefix("--").replace("-", "_"), value.strip()
        if not sep or not value:
            raise UsageError(f"--fuzz-option {item[:60]!r}: expected NAME=VALUE (e.g. drive=engine)")
        if dest not in allowed:
            raise UsageError(f"--fuzz-option {name[:40]!r}: a matrix cell of --sut {eng.name} takes "
                             f"{', '.join(allowed) or 'no fuzz option'}")
        if dest in SWITCHES:
            if value.lower() not in ("true", "false"):
                raise UsageError(f"--fuzz-option {dest}: expected true or false, not {value[:40]!r}")
            out += [ENGINE_OPTIONS[dest]] if value.lower() == "true" else []
        else:
            out += [ENGINE_OPTIONS[dest], value]
    return out


def _command(args: argparse.Namespace) -> str:
    cmd = ["kvcheck", "matrix", "--sut", args.sut]
    if args.python:
        for py in args.python:
            cmd += ["--python", py]
    else:
        cmd += ["--releases", args.releases or "minors"]
    if args.allow_outside_range:
        cmd.append("--allow-outside-range")
    if args.layouts:
        cmd += ["--layouts", args.layouts]
    if not args.differential:
        cmd += ["--budget-per-cell", args.budget_per_cell or _engine(args.sut, False).matrix_budget]
    cmd += ["--seed", str(args.seed), "--out", args.out]
    if args.envs:
        cmd += ["--envs", args.envs]
    if args.workers != 1:
        cmd += ["--workers", str(args.workers)]
    if args.resume:
        cmd.append("--resume")
    for item in args.fuzz_option or []:
        cmd += ["--fuzz-option", item]
    if args.differential:
        cmd += ["--differential", "--workloads", str(args.workloads)] + (["--traces", args.traces] if args.traces else [])
    return shlex.join(cmd)


def _engine(name: str, building: bool) -> Any:
    from ..fuzz import registry
    try:
        eng = registry.get(name)
    except registry.UnknownEngine as e:
        raise UsageError(f"--sut: {e}") from None
    missing = [a for a in ("distribution", "release_range") + (("install_script",) if building else ())
               if not getattr(eng, a, None)]
    if missing:
        with_range = [n for n, e in registry.engines().items() if e.release_range and e.install_script]
        raise UsageError(f"--sut {name}: the engine declares no {' or '.join(missing)}, so it has no release "
                         f"matrix (engines with one: {', '.join(with_range) or 'none'})")
    return eng


def _layouts(text: str | None, eng: Any) -> tuple[list[str] | None, list[str]]:
    try:
        known = list(eng.layouts())
    except Exception as e:  # noqa: BLE001 - an engine that cannot list its layouts here
        raise UsageError(f"--sut {eng.name}: its layouts cannot be listed: {type(e).__name__}: {e}") from None
    if text is None:
        return None, known
    names = [x.strip() for x in text.split(",")]
    if not all(names):
        raise UsageError(f"--layouts: {text[:60]!r} has an empty entry")
    unknown = [x for x in names if x not in known]
    if unknown:
        raise UsageError(f"--layouts: unknown {eng.name} {eng.matrix_column} {unknown[0]!r}; known: {', '.join(known)}")
    names = list(dict.fromkeys(names))
    return names, names


def cmd_matrix(args: argparse.Namespace) -> int:
    from ..fuzz.pool import cap_workers
    from . import matrix as mx
    from .matrix_envs import ReleaseError, default_envs, index_versions, select_releases
    from .matrix_report import matrix_data, render_text, write_outputs

    if args.python and args.releases is not None:
        raise UsageError("--releases and --python both say which releases: give one (--python uses the "
                         "release installed for each interpreter)")
    building = not args.python
    eng = _engine(args.sut, building)
    cell_budget = (args.budget_per_cell or eng.matrix_budget).strip()
    try:
        budget_s = eng.check_matrix_budget(cell_budget)
    except ValueError as e:
        raise UsageError(f"--budget-per-cell: {e}") from None
    wanted, columns = _layouts(args.layouts, eng)
    extra = fuzz_args(args.fuzz_option, eng)
    sources: list[mx.Source] = []
    for py in args.python or []:
        path = os.path.abspath(py)           # not resolved: a venv's python is a link into its base
        if not os.path.isfile(path) or not os.access(path, os.X_OK):
            raise UsageError(f"--python {py}: no such interpreter (not an executable file)")
        sources.append(mx.Source(python=path))
    out = Path(args.out)
    check_writable(out)
    envs = None
    if building:
        envs = Path(args.envs) if args.envs else default_envs()
        check_writable(envs, "environments directory (--envs)")
        try:
            releases = select_releases(args.releases or "minors", eng.distribution, tuple(eng.release_range),
                                       lambda: index_versions(eng.distribution), args.allow_outside_range)
        except ReleaseError as e:
            raise UsageError(str(e)) from None
        sources = [mx.Source(release=r) for r in releases]
    elif args.envs:
        raise UsageError("--envs: with --python nothing is built (drop --envs)")
    if args.differential:
        from .cmd_differential import run
        return run(args, eng, sources, envs, wanted or columns, _command(args))
    workers, note = cap_workers(args.workers)
    if note:
        print(f"kvcheck matrix: {note}", file=sys.stderr)
    plan = mx.Plan(engine=eng.name, budget=cell_budget, seed=args.seed, out=out,
                   columns=columns, layouts=wanted, sources=sources, distribution=eng.distribution,
                   script=eng.install_script, envs=envs, workers=workers, fuzz_args=extra,
                   cell_timeout_s=mx.cell_timeout(budget_s),
                   cell_args=eng.matrix_cell(mx.COLUMN, cell_budget, args.seed), resume=args.resume)
    meta = {"distribution": eng.distribution, "release_range": list(eng.release_range),
            "releases": None if args.python else (args.releases or "minors"),
            "pythons": [s.python for s in sources] if args.python else None,
            "envs": str(envs) if envs else None, "kvcheck_python": sys.executable, "fuzz_args": extra,
            "column": eng.matrix_column, "cell_args": plan.cell_args}
    try:
        rows = mx.run_matrix(plan)
        code, interrupted = mx.exit_code(rows), False
    except KeyboardInterrupt as e:
        rows, code, interrupted = mx.sort_rows(getattr(e, "rows", [])), int(ExitCode.INTERRUPTED), True
    data = matrix_data(eng.name, rows, columns, command=_command(args), seed=args.seed,
                       budget=plan.budget, code=code, meta=dict(meta, interrupted=interrupted))
    write_outputs(data, out)
    emit(args, data, lambda: render_text(data))
    return code
