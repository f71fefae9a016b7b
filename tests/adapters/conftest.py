"""Shared by the adapter tests: running a generated standalone reproducer in this process."""
from __future__ import annotations

import runpy
import sys

import pytest


@pytest.fixture
def run_script(capsys):
    """Run a reproducer script in this process (the engine is imported already: seconds, not a
    fresh interpreter's start): `run_script(path, *args)` -> (exit code, stdout)."""
    def run(path, *args: str) -> tuple[int, str]:
        capsys.readouterr()
        old, sys.argv = sys.argv, [str(path), *args]
        try:
            runpy.run_path(str(path), run_name="__main__")
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
        finally:
            sys.argv = old
        return code, capsys.readouterr().out
    return run
