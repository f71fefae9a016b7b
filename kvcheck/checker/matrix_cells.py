"""One cell of `kvcheck matrix`: the verdicts and their legend, and the verdict of one driver
`cell` line (`classify`: a fuzz campaign's or a transformers diff's result, a cannot-drive, a
traceback); matrix.py builds rows of them, matrix_report renders them."""
from __future__ import annotations

from typing import Any

from ..spec.verdict import ExitCode
from .matrix_envs import last_line

VERDICTS = ("clean", "finding", "cannot express", "cannot drive", "undecided", "error")
UNPROVEN = frozenset({"cannot drive", "undecided", "error"})      # the matrix did not prove the release
LEGEND = {
    "clean": "the campaign ran its whole budget with every check holding and every action exercised (exit 0)",
    "finding": "a check failed on this release: the engine's defect (a recognised known defect is named), "
               "with the command that replays it (exit 10-13)",
    "cannot express": "the release has no way to build this layout (a class or option it lacks); not run",
    "cannot drive": "kvcheck itself cannot drive this release (its side of the engine boundary broke: a "
                    "stand-in lacks what the release calls, a signature it does not have); not a finding "
                    "about the engine",
    "undecided": "the campaign ran but decided nothing (exit 3: e.g. actions never exercised in the budget)",
    "error": "the cell did not run to a verdict: a traceback, bad input, a driver that died or timed out, "
             "an environment that failed to build",
}
FINDING_CODES = frozenset({10, 11, 12, 13})


class BadLine(ValueError):
    """A driver line that is not one of its records."""


# ---- one cell -------------------------------------------------------------------------------
def _list(x: Any) -> list[Any]:
    return x if isinstance(x, list) else []


def _stderr_line(line: dict[str, Any]) -> str:
    return last_line(str(line.get("stderr") or ""))[:300]


def classify(line: dict[str, Any], rerun: str | None = None) -> dict[str, Any]:
    """The verdict of one driver `cell` line (module doc); BadLine when it is malformed."""
    lay, code, res, tb = line.get("layout"), line.get("code"), line.get("result"), line.get("traceback")
    if not isinstance(lay, str) or not (code is None or type(code) is int) \
            or not (res is None or isinstance(res, dict)) or not (tb is None or isinstance(tb, dict)):
        raise BadLine("a cell line without a layout, an integer code, a result object")
    cell: dict[str, Any] = {"layout": lay, "exit_code": code, "rerun": rerun,
                            "elapsed_s": line.get("elapsed_s"), "finding": None, "known": []}
    res = res or {}
    cd = res.get("cannot_drive")
    if tb is not None:
        cell.update(verdict="error", line=f"{tb.get('line')} (at {tb.get('where')})", where=str(tb.get("where")))
    elif cd:
        what = cd.get("line") if isinstance(cd, dict) else cd
        cell.update(verdict="cannot drive", line=str(what or "kvcheck cannot drive this release"),
                    where=str(cd.get("where")) if isinstance(cd, dict) else None)
    elif code == ExitCode.USAGE and isinstance(res.get("cannot_express"), str):
        cell.update(verdict="cannot express", line=res["cannot_express"][:500])   # (said by the run itself)
    elif code == 0:
        done = (f"{res['scenarios_run']} scenarios, reuse equal to the recompute within tolerance (max |dlogit| "
                f"{res.get('max_abs_diff', '?'):.3g})" if isinstance(res.get("scenarios_run"), int)
                and isinstance(res.get("max_abs_diff"), (int, float))
                else f"{res.get('steps', '?')} steps, every check held")
        cell.update(verdict="clean", line=done)
    elif code in FINDING_CODES:
        _finding(cell, res, code)
    elif code == ExitCode.UNDECIDED:
        missing = _list(res.get("missing_actions"))
        why = res.get("undecided") or (f"never exercised: {', '.join(map(str, missing))}" if missing
                                       else _stderr_line(line) or "exit 3, nothing decided")
        cell.update(verdict="undecided", line=str(why))
    elif code == ExitCode.USAGE:
        cell.update(verdict="error", line=f"exit 2 (bad input) on a layout the release lists: "
                    f"{_stderr_line(line) or 'no message'}")
    else:
        cell.update(verdict="error", line=f"exit {code}: {_stderr_line(line) or 'no message'}")
    cell["short"] = _short(cell)
    return cell


def _finding(cell: dict[str, Any], res: dict[str, Any], code: int) -> None:
    known = [r for r in _list(res.get("known")) if isinstance(r, dict) and r.get("status") == "finding"]
    found = [f for f in _list(res.get("findings")) if isinstance(f, dict)]
    first = found[0] if found else (known[0] if known else {})
    cell["finding"] = {k: first.get(k) for k in ("kind", "check", "message", "replay", "trace", "reproducer")}
    cell["known"] = [{k: r.get(k) for k in ("name", "upstream", "check", "kind", "reproducer")} for r in known]
    names = [f"known defect {r['name']} ({r.get('upstream') or 'no upstream reference'}): "
             f"{r.get('kind') or '?'}: {r.get('check') or '?'}" for r in cell["known"]]
    plain_ = [f"{f.get('kind') or '?'}: {f.get('check') or '?'}: {f.get('message') or ''}".rstrip(": ")
              for f in found[:1]]
    cell["line"] = " ".join("; ".join(plain_ + names).split())[:500] or f"exit {code}"
    cell["verdict"] = "finding"
    cell["unexplained"] = bool(found)           # a finding no known defect explains: it leads


def _short(cell: dict[str, Any]) -> str:
    """The table's text for a cell."""
    v = cell["verdict"]
    if v != "finding":
        return v
    if cell["known"] and not cell.get("unexplained"):
        k = cell["known"][0]
        more = f" +{len(cell['known']) - 1}" if len(cell["known"]) > 1 else ""
        return f"finding: {k['name']} (known, {k.get('upstream') or '?'}){more}"
    more = f" (+{len(cell['known'])} known)" if cell["known"] else ""
    return f"finding: {(cell['finding'] or {}).get('check') or '?'}{more}"


def plain(layout: str, verdict: str, line: str, **more: Any) -> dict[str, Any]:
    cell = {"layout": layout, "verdict": verdict, "line": line, "exit_code": None, "rerun": None,
            "finding": None, "known": [], **more}
    cell["short"] = _short(cell)
    return cell
