"""Line and branch coverage of an engine's own cache code over a campaign (`kvcheck fuzz --cover`).

What a campaign exercised is otherwise unknown: a clean 10-minute run says nothing of the
branches of vLLM's `kv_cache_coordinator.py` or SGLang's radix caches it never reached. The
engine declares its cache code (`Engine.cache_code`: module names, those a release lacks are
listed as absent); coverage.py measures exactly those files (its C tracer, branch mode), and the
result goes into the command's JSON (`engine_coverage`), its console (one line per file) and an
annotated listing of the lines never reached (coverage.py's HTML report under --out).

Written once for every engine: `kvcheck fuzz` starts a measurement around the engine's own
driver and `checker.common.emit` attaches it to whatever the driver prints. In-process only: the
campaign's steps run in this interpreter (not with --ray or worker processes).
"""
from __future__ import annotations

import ast
import importlib.util
import json
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence


class CoverageUnavailable(RuntimeError):
    """coverage.py is not importable, or the engine declares no cache code: one line."""


def body_lines(path: str) -> set[int]:
    """The lines of `path` inside function bodies: what runs when the code is *called*, not when
    its module is imported (module and class bodies, `def` and decorator lines). Whether the
    cache modules were imported before or during a measurement then changes nothing: the floor
    (`below_floor`) is judged on these lines."""
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return set()
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            body = node.body if isinstance(node.body, list) else [node.body]
            for stmt in body:
                for sub in ast.walk(stmt):
                    if isinstance(sub, (ast.stmt, ast.expr)) and hasattr(sub, "lineno"):
                        out.add(sub.lineno)
    return out


def below_floor(res: dict[str, Any], floor: Mapping[str, float]) -> str | None:
    """Why a measurement is below an engine's coverage floor (`Engine.coverage_floor`: module ->
    percent of its run-time lines), or None. A campaign under it drove too little of the engine
    to vouch for it (a driver that stops after setup, a layout whose lookups never hit): its gate
    check is undecided, never passed. A module this release lacks is not judged."""
    short = []
    for mod, pct in floor.items():
        f = res.get("files", {}).get(mod)
        if not f or not f.get("runtime_statements"):
            continue
        if (f.get("runtime_pct") or 0.0) < pct:
            short.append(f"{mod} {f.get('runtime_pct') or 0.0}% < {pct}% "
                         f"({f['runtime_lines']}/{f['runtime_statements']} run-time lines)")
    return "below the engine-code coverage floor: " + "; ".join(short) if short else None


def resolve(modules: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """The source files of `modules` (module -> path) and the modules this install lacks. Found
    from the top-level package's folder without importing anything: a module imported before
    the measurement starts would count its definitions as never run."""
    found, absent = {}, []
    roots: dict[str, list[Path]] = {}
    for m in modules:
        top, *rest = m.split(".")
        if top not in roots:
            try:
                spec = importlib.util.find_spec(top)
            except (ImportError, ValueError):
                spec = None
            roots[top] = [Path(d) for d in (spec.submodule_search_locations or [])] if spec else []
            if spec and not roots[top] and spec.origin and spec.origin.endswith(".py"):
                roots[top] = [Path(spec.origin)]          # a plain module
        path = None
        for d in roots[top]:
            if not rest:
                cands = [d / "__init__.py"] if d.is_dir() else [d]
            else:
                base = d.joinpath(*rest)
                cands = [base.with_name(base.name + ".py"), base / "__init__.py"]
            path = next((c for c in cands if c.is_file()), None)
            if path:
                break
        if path is None:
            absent.append(m)
        else:
            found[m] = str(path.resolve())
    return found, absent


@dataclass
class Measure:
    """One measurement: started before the campaign, summarised (and stopped) once."""

    engine: str
    modules: dict[str, str]
    absent: list[str]
    html_dir: Path | None
    cov: Any = None
    result: dict[str, Any] | None = field(default=None)

    def start(self) -> "Measure":
        try:
            import coverage
        except ImportError as e:      # a dependency of kvcheck: only a broken install lacks it
            raise CoverageUnavailable(f"--cover needs coverage.py (pip install coverage): {e}") from None
        self.cov = coverage.Coverage(data_file=None, branch=True, config_file=False,
                                     include=list(self.modules.values()))
        self.cov.start()
        return self

    def stop(self) -> dict[str, Any]:
        """Stop measuring (idempotent) and summarise per file: lines and branches reached."""
        if self.result is not None:
            return self.result
        self.cov.stop()
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")      # "No data was collected": reported as 0 lines below
            report = Path(d) / "coverage.json"
            try:
                self.cov.json_report(outfile=str(report))
                data = json.loads(report.read_text())["files"]
            except Exception:    # noqa: BLE001 - coverage.py raises its NoDataError when nothing ran
                data = {}
        by_path = {str(Path(k).resolve()): v for k, v in data.items()}
        files, tl, tc, bl, bc, rl, rc = {}, 0, 0, 0, 0, 0, 0
        for mod, path in self.modules.items():
            f = by_path.get(path)
            body = body_lines(path)
            if f is None:                  # imported before measuring and never run since, or never imported
                stmts = self._statements(path)
                s = {"num_statements": len(stmts), "covered_lines": 0, "num_branches": 0, "covered_branches": 0}
                missing = ["all"] if stmts else []
                run_stmts, run_hit = body & set(stmts), set()
            else:
                s, missing = f["summary"], _ranges(f["missing_lines"])
                run_hit = body & set(f["executed_lines"])
                run_stmts = run_hit | (body & set(f["missing_lines"]))
            files[mod] = {"path": path, "lines": s["covered_lines"], "statements": s["num_statements"],
                          "lines_pct": _pct(s["covered_lines"], s["num_statements"]),
                          "branches": s.get("covered_branches", 0), "branch_count": s.get("num_branches", 0),
                          "branches_pct": _pct(s.get("covered_branches", 0), s.get("num_branches", 0)),
                          "runtime_lines": len(run_hit), "runtime_statements": len(run_stmts),
                          "runtime_pct": _pct(len(run_hit), len(run_stmts)),
                          "missing_lines": missing}
            tl, tc = tl + s["num_statements"], tc + s["covered_lines"]
            rl, rc = rl + len(run_stmts), rc + len(run_hit)
            bl, bc = bl + s.get("num_branches", 0), bc + s.get("covered_branches", 0)
        html = None
        if self.html_dir is not None and data:
            try:
                self.cov.html_report(directory=str(self.html_dir), title=f"kvcheck: {self.engine} cache code")
                html = str(self.html_dir / "index.html")
            except OSError:
                html = None
        self.result = {"engine": self.engine, "lines_pct": _pct(tc, tl), "branches_pct": _pct(bc, bl),
                       "lines": tc, "statements": tl, "runtime_pct": _pct(rc, rl), "runtime_lines": rc,
                       "runtime_statements": rl, "files": files, "absent_modules": self.absent,
                       "annotated": html}
        return self.result

    def _statements(self, path: str) -> list[int]:
        try:
            return list(self.cov.analysis2(path)[1])
        except Exception:    # noqa: BLE001 - not Python coverage.py can parse
            return []


def _pct(n: int, d: int) -> float | None:
    return round(100.0 * n / d, 1) if d else None


def _ranges(lines: list[int]) -> list[str]:
    """[3, 4, 5, 9] -> ["3-5", "9"]: the lines never reached, as an annotated listing names them."""
    out: list[str] = []
    for n in sorted(lines):
        if out and int(out[-1].split("-")[-1]) == n - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return out


def text_lines(res: dict[str, Any]) -> list[str]:
    """The console lines: the total, then one per file."""
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x}%"
    lines = [f"  engine coverage ({res['engine']} cache code): lines {pct(res['lines_pct'])} "
             f"({res['lines']}/{res['statements']}), branches {pct(res['branches_pct'])}, "
             f"run-time lines {pct(res.get('runtime_pct'))}"
             + (f"; annotated: {res['annotated']}" if res.get("annotated") else "")]
    for mod, f in res["files"].items():
        lines.append(f"    {mod}: lines {pct(f['lines_pct'])}, branches {pct(f['branches_pct'])}")
    if res["absent_modules"]:
        lines.append(f"    not in this release: {', '.join(res['absent_modules'])}")
    return lines


_ACTIVE: list[Measure] = []


def measure(engine: str, modules: Sequence[str], html_dir: Path | None) -> Measure:
    """A started measurement of `engine`'s cache code (its caller stops it: `Measure.stop`)."""
    found, absent = resolve(modules)
    if not found:
        raise CoverageUnavailable(f"--cover: none of {engine}'s cache-code modules is importable here "
                                  f"({', '.join(modules)})")
    return Measure(engine, found, absent, html_dir).start()


def begin(engine: str, modules: Sequence[str], html_dir: Path | None) -> Measure:
    """Start measuring `engine`'s cache code; `checker.common.emit` ends it (see `attach`)."""
    m = measure(engine, modules, html_dir)
    _ACTIVE.append(m)
    return m


def attach(data: Any) -> list[str]:
    """Stop the active measurement, put it in `data` (a result dict) and return its console lines."""
    if not _ACTIVE:
        return []
    res = _ACTIVE.pop().stop()
    if isinstance(data, dict):
        data["engine_coverage"] = res
    return text_lines(res)


def active() -> Measure | None:
    """The measurement under way (`--cover`), if any: a second tracer would suspend it."""
    return _ACTIVE[-1] if _ACTIVE else None


def abandon() -> None:
    """Stop an active measurement whose command ended without emitting (an error, Ctrl-C)."""
    while _ACTIVE:
        m = _ACTIVE.pop()
        if m.result is None and m.cov is not None:
            m.cov.stop()
