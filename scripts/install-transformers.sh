#!/usr/bin/env bash
# Build a side venv that runs `kvcheck diff --sut transformers` on another transformers release,
# quietly (one summary line).
#
#   scripts/install-transformers.sh VERSION [DIR]       a clean venv DIR (default
#                                                       .venv-transformers-VERSION) with the CPU
#                                                       torch, transformers and kvcheck
#   PYTHON=.venv/bin/python scripts/install-transformers.sh VERSION DIR
#                                                       DIR layered over PYTHON's env (a .pth
#                                                       file): torch, kvcheck and whatever it
#                                                       already has come from there (fast)
#
# Layered: `pip install --no-deps transformers==VERSION`, then, transitively, only the
# requirements of what was installed that the environment does not already satisfy (each
# --no-deps, so torch is never replaced; e.g. 5.16.0 needs huggingface-hub<2.0, and hub 1.x
# needs httpx). huggingface-hub, when transformers needs another, at the release's own floor (the
# version it was built against: a later hub broke 5.4.0's configs). Nothing is written into
# PYTHON's env. Then run kvcheck from the checkout:
#   PYTHONPATH=$PWD DIR/bin/python -m kvcheck diff --sut transformers --model-type mistral
set -euo pipefail
VERSION=${1:?usage: scripts/install-transformers.sh VERSION [DIR]}
DIR=${2:-.venv-transformers-$VERSION}
HERE=$(cd "$(dirname "$0")/.." && pwd)
TORCH=${KVCHECK_TORCH:-torch==2.13.0}
log=$(mktemp "${TMPDIR:-/tmp}/install-transformers.XXXXXX.log")
NAME=install-transformers
. "$(dirname "$0")/pip-lib.sh"
start=$SECONDS
added=()
if [ -n "${PYTHON:-}" ]; then
  "$PYTHON" -c 'import torch' 2>/dev/null || fail "no torch in $PYTHON: install kvcheck first (./setup.sh)"
  [ -x "$DIR/bin/python" ] || "$PYTHON" -m venv "$DIR" >>"$log" 2>&1 || fail "cannot create a venv at $DIR"
  base=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  site=$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$base')" > "$site/zz-kvcheck-base.pth"     # after DIR's own site-packages: DIR's transformers wins
  mode="layered over $PYTHON"
  PY="$DIR/bin/python"
  pip_install "$PY" --no-deps "transformers==$VERSION" || fail "cannot install transformers==$VERSION (not on the package index, or the download failed)"
  todo=(transformers)
  for _ in 1 2 3 4 5 6 7 8; do
    # the requirements of `todo` this environment does not satisfy (a layered DIR sees its base's)
    mapfile -t reqs < <("$PY" - "${todo[@]}" <<'EOF'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
from packaging.version import Version
# the hub a release was built against: its floor, not today's newest (5.4.0's configs fail
# strict validation under huggingface-hub 1.33; its floor, 1.5.0, builds them)
PINNED = {"huggingface-hub"}
for name in sys.argv[1:]:
    for line in md.distribution(name).requires or []:
        r = Requirement(line)
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(r.name)
        except md.PackageNotFoundError:
            have = None
        if have is None or not r.specifier.contains(have, prereleases=True):
            floor = [s.version for s in r.specifier if s.operator in (">=", "==", "~=")]
            if name == "transformers" and r.name.lower().replace("_", "-") in PINNED and floor:
                print(f"{r.name}=={max(floor, key=Version)}")     # the release's own floor
            else:
                print(f"{r.name}{r.specifier}")
EOF
)
    [ "${#reqs[@]}" -gt 0 ] || break
    pip_install "$PY" --no-deps "${reqs[@]}" || fail "cannot install ${reqs[*]}"
    todo=()
    for r in "${reqs[@]}"; do todo+=("$(echo "$r" | sed -E 's/[<>=!~;, ].*$//')"); done
    added+=("${todo[@]}")
  done
  [ "${#added[@]}" -eq 0 ] || mapfile -t added < <("$PY" -c '
import importlib.metadata as md, sys
print("\n".join(f"{n} {md.version(n)}" for n in dict.fromkeys(sys.argv[1:])))' "${added[@]}")
else
  [ -x "$DIR/bin/python" ] || python3 -m venv "$DIR" >>"$log" 2>&1 || fail "cannot create a venv at $DIR"
  PY="$DIR/bin/python"
  "$PY" -c "import torch" 2>/dev/null || "$DIR/bin/pip" install -q "$TORCH" >>"$log" 2>&1 || fail "cannot install $TORCH"
  pip_install "$PY" "transformers==$VERSION" || fail "cannot install transformers==$VERSION (not on the package index, or the download failed)"
  pip_install "$PY" -e "$HERE" || fail "cannot install kvcheck from $HERE"
  mode="clean venv"
fi
if out=$(cd "$HERE" && PYTHONPATH="$HERE" "$PY" -W ignore -c "
import transformers
from kvcheck.engines.transformers.interface import cache_parameters
from transformers.modeling_outputs import CausalLMOutputWithPast as O
assert transformers.__version__ == '$VERSION', transformers.__version__
kw = cache_parameters(transformers.MistralForCausalLM)
print(f'ok the cache is passed as {kw[0]}= and read back from .{[f for f in O.__dataclass_fields__ if f in (\"cache\", \"past_key_values\")][0]}' if kw else 'no cache parameter')
" 2>&1 | tail -1) && [ "${out#ok }" != "$out" ]; then
  adds=$(IFS=,; echo "${added[*]:-none}"); adds=${adds//,/, }
  echo "install-transformers: transformers $VERSION in $DIR ($mode, requirements added: $adds, $((SECONDS - start)) s): ${out#ok }; run: PYTHONPATH=$HERE $DIR/bin/python -m kvcheck diff --sut transformers --model-type mistral"
else
  fail "transformers $VERSION installed in $DIR but kvcheck cannot drive it: ${out#ok }"
fi
