"""One release's side of the cross-release differential, run by that release's own python:

    PYTHONPATH=<kvcheck repo> PY -m kvcheck.checker.differential_driver ENGINE

ENGINE is a registered engine's name or `MODULE:CLASS` (an Engine subclass: tests' fake
engines). It answers on stdout in JSON lines, one per line it reads on stdin, so that the engine
is imported once per release however many layouts, workloads and shrink candidates it replays:
first {"type": "release", "release", "layouts": [...], "unsupported": {layout: why}} (or
{"type": "release", "error"}), then for each request {"id", "layout", "sizes": true} one
{"id", "sizes"}, for each {"id", "layout", "workloads": [...]} one {"id", "records": [...]}, or
{"id", "error"}. Anything the engine prints goes to stderr (the protocol keeps stdout).
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from typing import Any, TextIO


def load_engine(ref: str) -> Any:
    """A registered engine by name, or `MODULE:CLASS` instantiated."""
    if ":" in ref:
        mod, _, attr = ref.partition(":")
        obj = getattr(importlib.import_module(mod), attr)
        return obj() if isinstance(obj, type) else obj
    from kvcheck.fuzz import registry
    return registry.get(ref)


def _error(e: BaseException) -> str:
    return (traceback.format_exception_only(type(e), e)[-1].strip() or type(e).__name__)[:500]


def serve(ref: str, lines: TextIO, out: TextIO) -> int:
    def put(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj, default=str) + "\n")
        out.flush()

    try:
        eng = load_engine(ref)
        release = eng.release()
        if not eng.has_replay_reuse():
            raise RuntimeError(f"engine {eng.name} has no replay_reuse (no cross-release differential)")
        layouts = list(eng.layouts())
        unsupported = {str(k): str(v) for k, v in dict(eng.unsupported() or {}).items()}
    except Exception as e:  # noqa: BLE001 - this release's one line, never a traceback
        put({"type": "release", "error": _error(e), "python": sys.executable})
        return 1
    put({"type": "release", "release": release, "layouts": layouts, "unsupported": unsupported,
         "python": sys.executable})
    for raw in lines:
        if not raw.strip():
            continue
        req = json.loads(raw)
        try:
            if req.get("sizes"):
                put({"id": req.get("id"), "sizes": eng.reuse_sizes(req["layout"])})
            else:
                put({"id": req.get("id"), "records": eng.replay_reuse(req["layout"], req["workloads"])})
        except Exception as e:  # noqa: BLE001 - a workload that crashes the engine: its error line
            put({"id": req.get("id"), "error": _error(e)})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvcheck.checker.differential_driver ENGINE (run by kvcheck matrix "
              "--differential)", file=sys.stderr)
        return 2
    out = os.fdopen(os.dup(1), "w")             # the protocol's stdout; the engine's prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return serve(args[0], sys.stdin, out)


if __name__ == "__main__":
    sys.exit(main())
