"""Helpers for the bad-input tests: run the CLI in-process and check the one-line contract."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvcheck.checker.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `kvcheck ARGV` run in this process."""
    try:
        code = main(list(argv))
    except SystemExit as e:          # argparse's own errors
        code = e.code if isinstance(e.code, int) else 2
    out, err = capsys.readouterr()
    return int(code), out, err


def assert_bad_input(code: int, err: str, *needles: str) -> None:
    """Exit 2, exactly one line on stderr, no traceback, and the line says what is wrong."""
    assert code == 2, (code, err)
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)


def trace_dict(**over: Any) -> dict[str, Any]:
    """A valid one-step trace on the default config, with fields replaced."""
    d = {"format": "kvcheck-trace/1", "engine": "walk", "sut": "spec", "seed": 0, "fault": None,
         "config": {}, "steps": [{"action": "submit", "params": {"r": 0, "n": 1}}],
         "violation": None, "meta": {}}
    d.update(over)
    return d


def write(path: Path, data: Any) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else
                     (data if isinstance(data, str) else json.dumps(data)).encode())
    return path
