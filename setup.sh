#!/usr/bin/env bash
# One command to a working kvcheck: a CPU-only virtual environment (.venv) with torch, triton,
# hypothesis, z3, networkx, numpy, rich, pytest, the tested transformers release and vLLM 0.34.0's
# KV cache manager (installed without its dependencies: torch stays the CPU build).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kvcheck needs Python >= 3.11")'
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
# KVCHECK_EXTRAS=scale (comma-separated) adds optional extras: scale = Ray + redis for `fuzz --ray`
EXTRAS="test${KVCHECK_EXTRAS:+,$KVCHECK_EXTRAS}"
"$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]" -r requirements-transformers.txt
# vLLM's KV cache manager for `kvcheck fuzz --sut vllm` (--no-deps; torch stays as installed)
PYTHON="$VENV/bin/python" bash scripts/install-vllm.sh
echo "kvcheck installed in $VENV: $("$VENV/bin/kvcheck" --version)"
