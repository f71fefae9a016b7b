#!/usr/bin/env bash
# Install vLLM 0.33.0 (CPU use of its KV cache manager only) into the current Python environment
# without touching torch: vllm with --no-deps, then requirements-vllm.txt with torch pinned to
# the version already installed.  Usage: bash scripts/install-vllm.sh  (PYTHON=... to override)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
cons="$(mktemp)"
trap 'rm -f "$cons"' EXIT
if TORCH="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"; then
  echo "torch==$TORCH" > "$cons"
fi
start=$SECONDS
"$PY" -m pip install --no-deps "vllm==0.33.0"
"$PY" -m pip install -c "$cons" -r requirements-vllm.txt
VLLM_TARGET_DEVICE=cpu "$PY" -c "import vllm.v1.core.kv_cache_manager, torch; print('vllm ok; torch', torch.__version__)"
echo "install-vllm: done in $((SECONDS - start)) s"
