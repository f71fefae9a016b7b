#!/usr/bin/env bash
# Build a side venv that runs kvcheck's SGLang adapter on CPU: a clean venv with the CPU torch,
# `pip install --no-deps sglang==VERSION`, the pure-Python modules its radix-cache import chain
# needs (scripts/requirements-sglang.txt, installed --no-deps so torch is never replaced), and
# kvcheck itself (editable, --no-deps). GPU-only modules the chain reaches (torchvision users,
# sgl_kernel on releases before 0.5.7) get KVCHECK_CPU_STUB stand-ins at import time
# (kvcheck/fuzz/adapters/sglang_install.py); nothing is written into SGLang.
# Usage: scripts/install-sglang.sh VERSION [DIR]   (DIR defaults to .venv-sglang-VERSION)
set -euo pipefail
VERSION=${1:?usage: scripts/install-sglang.sh VERSION [DIR]}
DIR=${2:-.venv-sglang-$VERSION}
HERE=$(cd "$(dirname "$0")/.." && pwd)
TORCH=${KVCHECK_TORCH:-torch==2.13.0}
q() { "$@" >/dev/null 2>&1; }
[ -x "$DIR/bin/python" ] || python3 -m venv "$DIR"
PIP="$DIR/bin/pip"
"$DIR/bin/python" -c "import torch" 2>/dev/null || q "$PIP" install -q "$TORCH" || { echo "install-sglang: cannot install $TORCH" >&2; exit 2; }
q "$PIP" install -q --no-deps "sglang==$VERSION" || { echo "install-sglang: no sglang==$VERSION on the package index" >&2; exit 2; }
q "$PIP" install -q --no-deps -r "$HERE/scripts/requirements-sglang.txt" || { echo "install-sglang: the import-chain requirements failed to install" >&2; exit 2; }
q "$PIP" install -q --no-deps -e "$HERE" || true
if out=$(cd "$HERE" && PYTHONPATH="$HERE" "$DIR/bin/python" -c "
from kvcheck.fuzz.adapters.sglang_install import load, STUBBED
S = load(); ok = [k for k, v in S['classes'].items() if isinstance(v, type)]
print('classes:', ', '.join(ok), '| CPU stand-ins:', ', '.join(STUBBED) or 'none')" 2>&1 | tail -1); then
  echo "install-sglang: sglang $VERSION in $DIR ($out); left out: sglang's own pins (CUDA torch, kernels, serving stack) — the caches need none of them"
else
  echo "install-sglang: sglang $VERSION installed in $DIR but does not import: $out" >&2; exit 2
fi
