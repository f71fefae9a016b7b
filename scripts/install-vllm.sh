#!/usr/bin/env bash
# Install vLLM's v1 KV cache manager for `kvcheck fuzz --sut vllm`, quietly, never touching torch.
#
#   scripts/install-vllm.sh [VERSION]        into the current environment (PYTHON=..., default
#                                            `python`): a user's own env, or kvcheck's .venv
#   scripts/install-vllm.sh VERSION DIR      a side environment DIR layered over the current
#                                            one: DIR has only vllm==VERSION and the modules its
#                                            KV cache manager imports; torch, kvcheck and the rest
#                                            come from the current env (a .pth file). Run kvcheck
#                                            there with DIR/bin/python -m kvcheck.
#
# vllm is installed with --no-deps: its own pins would replace the CPU torch with a CUDA build
# and pull the serving stack. What the KV cache manager imports is in requirements-vllm.txt
# (installed with its dependencies, torch pinned to the installed build). pip's resolver
# complaints about vLLM's pins left out go to a log, not the terminal.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
VERSION=${1:-0.34.0}
DIR=${2:-}
PY=${PYTHON:-python}
log=$(mktemp "${TMPDIR:-/tmp}/install-vllm.XXXXXX.log")
NAME=install-vllm
. "$(dirname "$0")/pip-lib.sh"
"$PY" -c 'import torch' 2>/dev/null || fail "no torch in $PY: install kvcheck first (./setup.sh)"
if [ -n "$DIR" ]; then
  [ -x "$DIR/bin/python" ] || "$PY" -m venv "$DIR" >>"$log" 2>&1 || fail "cannot create a venv at $DIR"
  base=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  site=$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$base')" > "$site/zz-kvcheck-base.pth"     # after DIR's own site-packages: DIR's vllm wins
  TARGET="$DIR/bin/python"
else
  TARGET="$PY"
fi
start=$SECONDS
pip_install "$TARGET" --no-deps "vllm==$VERSION" || fail "cannot install vllm==$VERSION (not on the package index, or the download failed)"
# with their own dependencies (multidict for aiohttp, ...), torch pinned to the installed build
cons=$(mktemp "${TMPDIR:-/tmp}/install-vllm.XXXXXX.txt")
"$TARGET" -c 'import torch; print("torch==" + torch.__version__)' > "$cons"
pip_install "$TARGET" -c "$cons" -r "$HERE/requirements-vllm.txt" \
  || fail "the KV cache manager's import requirements failed to install"
rm -f "$cons"
if out=$(cd "$HERE" && VLLM_TARGET_DEVICE=cpu "$TARGET" -c "
from kvcheck.engines.vllm.layouts import supported_layouts, vllm_version
s = supported_layouts(); ok = [k for k, v in s.items() if v is None]
print(f'vllm {vllm_version()}: {len(ok)}/{len(s)} layouts run here (not: {\", \".join(k for k in s if k not in ok) or \"none\"}; kvcheck fuzz --sut vllm --list-layouts says why)')" 2>&1 | tail -1); then
  torch=$("$TARGET" -c 'import torch; print(torch.__version__)')
  echo "install-vllm: $out; in ${DIR:-$TARGET} in $((SECONDS - start)) s; torch $torch kept; left out: vLLM's pins of torch, CUDA kernels and the serving stack (the KV cache manager needs none)"
else
  fail "vllm $VERSION installed but its KV cache manager does not import: $out"
fi
