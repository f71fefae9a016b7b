"""One release's row of `kvcheck matrix`, run by that release's own python:

    PYTHONPATH=<kvcheck repo> PY -m kvcheck.checker.matrix_driver SPEC_JSON

It asks the engine there for its release and layouts (`kvcheck engines NAME --layouts --json`),
then runs each cell's command (SPEC["cell"], the engine's `matrix_cell` with "{COLUMN}" for the
layout: `kvcheck fuzz --sut NAME --layout L ...`, or `kvcheck diff --sut transformers --model-type
M ...`) with --json for each layout the release can express, all in this one process (`kvcheck.checker.cli.main`, the command line's own parser,
errors and exit codes): importing vLLM or SGLang costs seconds, paid once per release.

With SPEC["kept"] ({layout: release}, --resume) a layout whose verdict on this same release is
already in the file is not run again.

It appends one JSON object per line to SPEC["lines"] as it goes, flushed, so that a driver that
dies still leaves what it finished: {"type": "release", ...} first (or with "error"), then
{"type": "start", "layout"} and {"type": "cell", "layout", "code", "result", "stderr",
"traceback"} per layout, {"type": "done"} last. A command that raises is caught and recorded
(its last traceback line and where); judging the cells is the parent's (checker/matrix.py).
"""
from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import sys
import time
import traceback
from typing import Any

from kvcheck.checker.matrix import cell_key, fill_cell

# result keys a matrix cell keeps (the rest, coverage profiles and such, stay in fuzz's own output)
KEEP = ("exit_code", "steps", "episodes", "elapsed_s", "missing_actions", "lookups_with_hit", "command",
        "cannot_drive", "cannot_express", "verdict", "undecided", "vllm_version", "sglang_version",
        "drive", "drive_reason", "transformers_version", "scenarios_run", "max_abs_diff", "counts",
        "first_divergent_operation")
FINDING_KEYS = ("kind", "check", "message", "trace", "replay", "reproducer", "steps", "layout")
KNOWN_KEYS = ("name", "status", "check", "kind", "upstream", "releases", "recognised", "message", "reproducer")


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    name = f.filename
    root = os.getcwd() + os.sep
    if name.startswith(root):
        name = name[len(root):]
    return f"{name}:{f.lineno} ({f.name})"


def cli(*argv: str) -> dict[str, Any]:
    """`kvcheck ARGV` in this process: exit code, stdout, stderr, and a raised exception's
    last traceback line and where (None when it returned)."""
    o, e = io.StringIO(), io.StringIO()
    tb = None
    try:
        with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
            from kvcheck.checker.cli import main        # a python without kvcheck's needs: this cell's error
            code: int | None = main(list(argv))
    except KeyboardInterrupt:
        raise
    except SystemExit as x:              # argparse's own errors
        code = x.code if isinstance(x.code, int) else 2
    except BaseException as x:  # noqa: BLE001 - a cell's crash is its verdict, not the driver's end
        code = None
        tb = {"line": (traceback.format_exception_only(type(x), x)[-1].strip() or type(x).__name__)[:500],
              "where": _where(x)}
    return {"code": code, "stdout": o.getvalue(), "stderr": e.getvalue(), "traceback": tb}


def parse_json(text: str) -> Any:
    """The JSON object a `--json` command printed (anything printed before it skipped)."""
    text = text.strip()
    for start in [0] + [i + 1 for i, c in enumerate(text) if c == "\n" and text[i + 1:i + 2] == "{"]:
        try:
            return json.loads(text[start:])
        except ValueError:
            continue
    return None


def trim(res: Any) -> dict[str, Any] | None:
    if not isinstance(res, dict):
        return None
    out = {k: res[k] for k in KEEP if k in res}
    out["findings"] = [{k: f.get(k) for k in FINDING_KEYS if k in f}
                       for f in (res.get("findings") or [])[:5] if isinstance(f, dict)]
    out["finding_count"] = len(res.get("findings") or [])
    out["known"] = [{k: r.get(k) for k in KNOWN_KEYS if k in r} for r in (res.get("known") or []) if isinstance(r, dict)]
    return out


def _same(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    try:
        from packaging.version import Version
        return Version(a) == Version(b)
    except Exception:  # noqa: BLE001 - not a version: compare as text
        return a.strip() == b.strip()


def run(spec: dict[str, Any]) -> int:
    sut, want = spec["sut"], spec.get("layouts")
    with open(spec["lines"], "a", encoding="utf-8") as f:
        def put(obj: dict[str, Any]) -> None:
            f.write(json.dumps(obj, default=str) + "\n")
            f.flush()

        r = cli("engines", sut, "--layouts", "--json")
        info = parse_json(r["stdout"]) if r["code"] == 0 else None
        rows = [x for x in (info or {}).get("engines", []) if isinstance(x, dict) and x.get("name") == sut]
        if not rows:
            tb = r["traceback"]
            why = (f"{tb['line']} (at {tb['where']})" if tb else
                   (r["stderr"].strip().splitlines() or [f"exit {r['code']}, no engine {sut!r} listed"])[-1])
            put({"type": "release", "error": f"kvcheck engines {sut} failed here: {why}", "python": sys.executable})
            return 1
        row = rows[0]
        release = row.get("release")
        layouts, unsupported = row.get("layouts"), row.get("unsupported") or {}
        base = {"type": "release", "python": sys.executable, "release": release, "layouts": layouts,
                "unsupported": unsupported}
        if release is None:
            put(dict(base, error=f"{sut} is not installed for {sys.executable} (kvcheck engines reports no release)"))
            return 1
        if not isinstance(layouts, dict):
            errs = row.get("errors") or {}
            put(dict(base, error=f"{sut} {release}: its layouts cannot be listed: {errs.get('layouts', '?')}"))
            return 1
        if spec.get("expected") and not _same(release, spec["expected"]):
            put(dict(base, error=f"the environment has {sut} {release}, not {spec['expected']} as asked"))
            return 1
        out = os.path.join(spec["out"], f"{sut}-{release}")
        put(dict(base, out_dir=out))
        kept = spec.get("kept") or {}
        for lay in (want if want is not None else list(layouts)):
            if lay not in layouts or lay in unsupported:
                continue                           # cannot express: judged by the parent, not run
            if _same(kept.get(lay), release):
                continue                           # --resume: this release's verdict is already in the file
            put({"type": "start", "layout": lay})
            t0 = time.monotonic()
            r = cli(*fill_cell(spec.get("cell"), sut, spec["budget"], spec["seed"], lay), *spec.get("fuzz_args", []),
                    "--json", "--out", out)
            put({"type": "cell", "layout": lay, "release": release, "key": cell_key(spec),
                 "code": r["code"], "result": trim(parse_json(r["stdout"])),
                 "stderr": r["stderr"][-2000:], "traceback": r["traceback"],
                 "elapsed_s": round(time.monotonic() - t0, 2)})
            gc.collect()
        put({"type": "done"})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvcheck.checker.matrix_driver SPEC_JSON (run by kvcheck matrix)", file=sys.stderr)
        return 2
    return run(json.loads(args[0]))


if __name__ == "__main__":
    sys.exit(main())
