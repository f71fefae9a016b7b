"""`kvcheck init`: write a commented starter project file for `kvcheck gate`.

The starter parses and passes as written (tests run it); its comments show every key, the
other systems (vLLM layouts, transformers model types, your own MODULE:CLASS adapter) and
where the corpus goes.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..spec.outputs import write_atomic
from .common import UsageError, check_out_file, emit

STARTER = '''\
# kvcheck project file: what `kvcheck gate` checks in this repository.
# (In pyproject.toml, put the same keys under [tool.kvcheck] and [tool.kvcheck.systems.NAME].)
# Paths are relative to this file; MODULE:CLASS adapters import from the working directory.
# Budgets: a step count ("2000"; walk counts steps, diff counts scenarios) or a duration ("30s", "5m").

# Finding traces of every gate run are saved here and replayed first on the next one.
corpus = "kvcheck-corpus"
# Seeds of every random choice (each system may override with its own `seeds`).
seeds = [0]

# The executable spec itself: seeded random walks with every invariant after every step, a
# Hypothesis campaign against the spec, and (slower) Z3 proofs and exhaustive exploration.
[systems.spec]
engines = ["walk", "replay-corpus"]              # also: "fuzz", "prove", "explore"
budgets = { walk = 10000 }                       # with "fuzz": budgets = { walk = 10000, fuzz = "30s" }
# Planted faults kept as regression checks: each must be caught by its expected check
# (`kvcheck faults` lists them).
expected_faults = ["eviction_ignores_pins"]
fault_budget = "30s"

# The reference engine: lockstep campaign and reuse == recompute (bitwise) on a tiny model.
[systems.reference]
engines = ["fuzz", "diff", "replay-corpus"]
budgets = { fuzz = 3000, diff = 10 }
# config = "my-config.json"                      # a kvcheck config (default: the embedded one)

# vLLM's real KV cache manager (needs vLLM: bash scripts/install-vllm.sh); layouts by name
# (`kvcheck fuzz --sut vllm --list-layouts`).
# [systems.vllm]
# layouts = ["full+swa", "mixed_block"]
# engines = ["fuzz", "replay-corpus"]
# budget = "2000"
# expected_faults = ["drop_ref_on_free"]
# cover = true                                   # the vLLM cache code each campaign reached, in the report

# transformers models with a non-uniform cache (`kvcheck diff --sut transformers --list-models`).
# [systems.transformers]
# model_types = ["mistral"]
# budget = 10

# Your own cache manager behind the adapter protocol (docs/adapters.md), with its config.
# [systems."mypkg.cache_adapter:MyCacheSUT"]
# config = "kvcheck-config.json"
# engines = ["fuzz", "replay-corpus"]
# budget = "60s"
# expected_faults = []                           # names from the class's `faults` dict
'''


def cmd_init(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if path.exists() and not args.force:
        raise UsageError(f"{path} already exists; use --force to overwrite it")
    check_out_file(path, "kvcheck init", (".toml",))
    write_atomic(path, STARTER)
    emit(args, {"written": str(path)},
         lambda: f"kvcheck init: wrote {path}; edit it, then run `kvcheck gate`")
    return 0
