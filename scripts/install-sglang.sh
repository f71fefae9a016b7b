#!/usr/bin/env bash
# Build a side venv that runs kvcheck's SGLang adapter on CPU, quietly (one summary line).
#
#   scripts/install-sglang.sh VERSION [DIR]            a clean venv DIR (default
#                                                      .venv-sglang-VERSION) with the CPU torch
#   PYTHON=.venv/bin/python scripts/install-sglang.sh VERSION DIR
#                                                      DIR layered over PYTHON's env (a .pth
#                                                      file): torch, kvcheck and whatever it
#                                                      already has come from there (fast; CI)
#
# `pip install --no-deps sglang==VERSION`, then the pure-Python modules its radix-cache import
# chain needs (scripts/requirements-sglang.txt, --no-deps so torch is never replaced; in a
# layered DIR only those the base env lacks). GPU-only modules the chain reaches (torchvision
# users, sgl_kernel before 0.5.7, ...) get KVCHECK_CPU_STUB stand-ins at import time
# (kvcheck/engines/sglang/install.py); nothing is written into SGLang.
set -euo pipefail
VERSION=${1:?usage: scripts/install-sglang.sh VERSION [DIR]}
DIR=${2:-.venv-sglang-$VERSION}
HERE=$(cd "$(dirname "$0")/.." && pwd)
TORCH=${KVCHECK_TORCH:-torch==2.13.0}
log=$(mktemp "${TMPDIR:-/tmp}/install-sglang.XXXXXX.log")
NAME=install-sglang
. "$(dirname "$0")/pip-lib.sh"
start=$SECONDS
if [ -n "${PYTHON:-}" ]; then
  "$PYTHON" -c 'import torch' 2>/dev/null || fail "no torch in $PYTHON: install kvcheck first (./setup.sh)"
  [ -x "$DIR/bin/python" ] || "$PYTHON" -m venv "$DIR" >>"$log" 2>&1 || fail "cannot create a venv at $DIR"
  base=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  site=$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$base')" > "$site/zz-kvcheck-base.pth"     # after DIR's own site-packages: DIR's sglang wins
  mode="layered over $PYTHON"
else
  [ -x "$DIR/bin/python" ] || python3 -m venv "$DIR" >>"$log" 2>&1 || fail "cannot create a venv at $DIR"
  "$DIR/bin/python" -c "import torch" 2>/dev/null || "$DIR/bin/pip" install -q "$TORCH" >>"$log" 2>&1 \
    || fail "cannot install $TORCH"
  mode="clean venv"
fi
PY="$DIR/bin/python"
pip_install "$PY" --no-deps "sglang==$VERSION" || fail "cannot install sglang==$VERSION (not on the package index, or the download failed)"
# the requirements the environment does not already have (a layered DIR sees its base's)
reqs=$(mktemp "${TMPDIR:-/tmp}/install-sglang.XXXXXX.txt")
"$PY" - "$HERE/scripts/requirements-sglang.txt" > "$reqs" <<'EOF'
import importlib.metadata as md, re, sys
for line in open(sys.argv[1]):
    name = re.split(r"[=<>\s#]", line.strip(), maxsplit=1)[0]
    if not name:
        continue
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(line.strip())
EOF
if [ -s "$reqs" ]; then
  pip_install "$PY" --no-deps -r "$reqs" || fail "the import-chain requirements failed to install"
fi
nreq=$(wc -l < "$reqs"); rm -f "$reqs"
[ -n "${PYTHON:-}" ] || pip_install "$PY" --no-deps -e "$HERE" || true
if out=$(cd "$HERE" && PYTHONPATH="$HERE" "$PY" -c "
from kvcheck.engines.sglang.install import summary
print(summary())" 2>&1 | tail -1) && [ "${out#ok }" != "$out" ]; then
  echo "install-sglang: sglang $VERSION in $DIR ($mode, $nreq requirements added, $((SECONDS - start)) s): ${out#ok }; left out: sglang's own pins (CUDA torch, kernels, serving stack) — the caches need none of them"
else
  fail "sglang $VERSION installed in $DIR but its caches do not import: ${out#ok }"
fi
