#!/usr/bin/env bash
# One command to a working kvcheck: a CPU-only virtual environment (.venv) with torch, triton,
# hypothesis, z3, networkx, numpy, rich, pytest and the tested transformers release.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kvcheck needs Python >= 3.11")'
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[test]" -r requirements-transformers.txt
echo "kvcheck installed in $VENV: $("$VENV/bin/kvcheck" --version)"
