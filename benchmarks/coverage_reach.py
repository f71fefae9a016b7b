"""How much of vLLM's cache code one campaign reaches of what all of kvcheck's layouts reach
(issue 34's target: >= 90 % of the lines reachable on CPU in 10 minutes), printing JSON.

"Reachable on CPU" has no oracle: this estimates it as the union of the run-time lines (function
bodies, engine_coverage.body_lines) every layout's clean campaign reaches, each layout on the
default drive (vLLM's own scheduler where it runs the layout) and on kvcheck's manager drive.
Then one campaign of the `generated` layout (a layout sampled per episode from a grammar of every
group kind the release has) is measured after each of --after seconds, against that union.

    PYTHONPATH=. python benchmarks/coverage_reach.py --layouts all --per-layout-s 20 --after 60,600 \
        [--part 0/2] [--save FILE] [--merge FILE,FILE]

`--part i/n` runs every n-th layout (two processes on two cores), `--save` keeps the line sets,
`--merge` reads saved parts and prints the union and the generated rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]   # (vllm.py would shadow vLLM)


def _measured(run, files: dict[str, str]) -> dict[str, list[int]]:
    """The run-time statements of each cache file `run()` executed (a line event inside a
    multi-line statement is not a statement of its own)."""
    import coverage

    cov = coverage.Coverage(data_file=None, branch=False, config_file=False, include=list(files.values()))
    cov.start()
    try:
        run()
    finally:
        cov.stop()
    data = cov.get_data()
    out = {}
    for mod, path in files.items():
        got = set(data.lines(path) or []) & _RUNTIME[path]
        out[mod] = sorted(got)
    return out


def _files() -> dict[str, str]:
    from kvcheck.engines.vllm.engine import VllmEngine
    from kvcheck.fuzz.engine_coverage import resolve
    found, _ = resolve(VllmEngine.cache_code)
    for mod in found:                       # imported first: import-time lines are not run-time lines anyway
        __import__(mod)
    return found


_RUNTIME: dict[str, set[int]] = {}


def _statements(files: dict[str, str]) -> dict[str, int]:
    """Each file's run-time statements (coverage.py's statements inside function bodies)."""
    import coverage

    from kvcheck.fuzz.engine_coverage import body_lines
    cov = coverage.Coverage(data_file=None, config_file=False)
    for p in files.values():
        _RUNTIME[p] = set(cov.analysis2(p)[1]) & body_lines(p)
    return {m: len(_RUNTIME[p]) for m, p in files.items()}


def layouts_part(spec: str, part: str | None) -> list[str]:
    from kvcheck.engines.vllm import drivers as V
    ok = V.supported_layouts()              # layout -> None (runs here) or why not
    names = list(ok) if spec == "all" else spec.split(",")
    names = [n for n in names if n != "generated" and ok.get(n) is None]
    if part:
        i, n = (int(x) for x in part.split("/"))
        names = names[i::n]
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="full,full+swa,full+mamba")
    ap.add_argument("--per-layout-s", type=float, default=5.0)
    ap.add_argument("--after", default="10", help="seconds of the generated campaign to measure at (comma list)")
    ap.add_argument("--part", default=None)
    ap.add_argument("--save", default=None)
    ap.add_argument("--merge", default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from kvcheck.engines.vllm import drivers as V
    files = _files()
    stmts = _statements(files)
    union: dict[str, set[int]] = {m: set() for m in files}
    per: dict[str, int] = {}
    if a.merge:
        for f in a.merge.split(","):
            saved = json.load(open(f, encoding="utf-8"))
            for m, lines in saved["union"].items():
                union.setdefault(m, set()).update(lines)
            per.update(saved["per_layout"])
            a.per_layout_s = saved.get("per_layout_s", a.per_layout_s)
    d = tempfile.mkdtemp(prefix="kvcheck-reach-")
    if not a.merge:
        for name in layouts_part(a.layouts, a.part):
            for drive in ("auto", "mixed"):
                got = _measured(lambda: V.run_campaign(name, budget_s=a.per_layout_s, seed=a.seed, out_dir=d,
                                                       drive=drive), files)
                per[f"{name}@{drive}"] = sum(len(v) for v in got.values())
                for m, lines in got.items():
                    union[m].update(lines)
                print(json.dumps({"layout": name, "drive": drive, "lines": per[f"{name}@{drive}"]}),
                      file=sys.stderr, flush=True)
        if a.save:
            json.dump({"union": {m: sorted(v) for m, v in union.items()}, "per_layout": per,
                       "per_layout_s": a.per_layout_s}, open(a.save, "w"))
    total = sum(len(v) for v in union.values())
    out = {"vllm": V.vllm_version(), "per_layout_s": a.per_layout_s, "layouts_drives": len(per),
           "union_runtime_lines": total, "runtime_statements": sum(stmts.values()),
           "union_pct_of_statements": round(100 * total / max(1, sum(stmts.values())), 1),
           "per_module": {m: {"union": len(union[m]), "statements": stmts[m]} for m in files}, "generated": []}
    after = sorted(float(x) for x in a.after.split(",") if x) if a.after else []
    for s in after:
        t0 = time.perf_counter()
        got = _measured(lambda: V.run_campaign("generated", budget_s=s, seed=a.seed, out_dir=d), files)
        hit = sum(len(set(v) & union[m]) for m, v in got.items())
        beyond = sum(len(set(v) - union[m]) for m, v in got.items())
        out["generated"].append({"seconds": s, "wall_s": round(time.perf_counter() - t0, 1), "lines": hit + beyond,
                                 "of_union_pct": round(100 * hit / max(1, total), 1), "beyond_union": beyond})
        print(json.dumps(out["generated"][-1]), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
