"""`--layout generated`: every episode samples a KV cache layout from a grammar, so a campaign
reaches layouts nobody listed.

Grammar: 1-6 groups, each of a kind the installed release can express (full, mla, swa, swa_mla,
chunked_local, mla_indexer, mamba (then the Mamba block is the scheduler block, 1, 2 or 4 hash
blocks where the release has fine-grained Mamba hits, no retention); any kind may repeat, identical groups included, as vLLM builds
for n:1 patterns), block sizes of 1, 2 or 4 hash blocks (mixed), a hash block of 4, 8 or 16
tokens with max_model_len = 16 hash blocks (a third of the seeds draw real models' ratios
instead: blocks up to 16 hash blocks, windows and chunks of 1-64 blocks, max_model_len three
of the largest, up to 4096), an EAGLE/MTP drafter (none, the conservative
"every group" fallback, or one flagged group) and a retention interval None / 0 / N (N a
multiple of the scheduler block) where the layout has a sliding window. The draws come from
the episode seed only; the definition is a `--layout-file` object, registered as "gen:SEED"
and written into a finding's trace (meta.layout_file), so the finding replays anywhere.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

from .layouts import (EAGLE, FILE_LAYOUTS, LAYOUT_DATA, MAMBA_FAULTS, MAMBA_FINE_FAULTS, RETENTION,
                      SCALE, SWA_FAULTS, LAYOUTS, vllm_modules, register_layout)

_KIND_FEATURE = {"chunked_local": "ChunkedLocalAttentionSpec", "swa_mla": "SlidingWindowMLASpec",
                 "mla_indexer": "SparseCacheRole", "mamba": "MambaSpec.mamba_cache_mode"}
_WINDOWED = ("swa", "swa_mla")
MAX_WIDE = 4096            # the ratio draws' max_model_len cap (a step stays milliseconds)


def kinds_available() -> list[str]:
    feats = vllm_modules()["features"]
    return [k for k in ("full", "mla", "swa", "swa_mla", "chunked_local", "mla_indexer", "mamba")
            if k not in _KIND_FEATURE or _KIND_FEATURE[k] in feats]


def sample_definition(seed: int | str, fault: str | None = None) -> dict[str, Any]:
    """One layout definition (the --layout-file grammar) from the seed; a fault that needs a
    sliding window gets one."""
    rng = random.Random(f"vllm-layout-{seed}")
    feats = vllm_modules()["features"]
    kinds = kinds_available()
    hb = rng.choice([4, 4, 8, 16])
    max_len = 16 * hb
    n = rng.choice([1, 2, 2, 3, 3, 4, 5, 6])
    # A third of the layouts draw real models' ratios (their own stream: the others are unchanged):
    # blocks up to 16 hash blocks, windows and chunks of up to 64 blocks, max_model_len to cross
    # the largest three times (NAME@real: hash 16 : block 16 : window 4096 : len 12288).
    wide = random.Random(f"vllm-layout-wide-{seed}")
    ratios = wide.random() < 1 / 3
    mults = [1, 2, 4, 8, 16] if ratios else [1, 1, 2, 4]
    sizes = [hb * rng.choice(mults) for _ in range(n)] if n > 1 else [hb]   # unitary: block = hash
    if ratios:
        max_len = min(MAX_WIDE, max(max_len, 4 * math.lcm(*sizes)))
    while math.lcm(*sizes) > max_len // 4:
        sizes[sizes.index(max(sizes))] //= 2
    picked = [rng.choice(kinds) for _ in sizes]
    if any(f.name == fault for f in MAMBA_FAULTS) and "mamba" in kinds:
        picked[-1] = "mamba"       # a fault planted in the Mamba manager needs one
    mamba = "mamba" in picked
    if mamba:                      # align mode: the Mamba block is the scheduler block
        mult = rng.choice([1, 2, 4]) if "mamba_partial_hits" in feats and n > 1 else 1
        if any(f.name == fault for f in MAMBA_FINE_FAULTS) and "mamba_partial_hits" in feats and n > 1:
            mult = rng.choice([2, 4])       # (its site: hits inside a Mamba block)
        sizes = [hb * mult if k == "mamba" else hb * rng.choice([d for d in (1, 2, 4) if mult % d == 0])
                 for k in picked]
    eagle = "use_eagle" in feats and rng.random() < 0.3
    if eagle and "eagle_mixed_block" not in feats:
        sizes = [max(sizes) if mamba else sizes[0]] * n   # old releases' EAGLE SWA lookup: block == alignment
    sched = math.lcm(*sizes)
    sizes = [sched if k == "chunked_local" else bs for k, bs in zip(picked, sizes)]  # vLLM's rule
    groups = []
    for bs, kind in zip(sizes, picked):
        g: dict[str, Any] = {"kind": kind, "block_size": bs}
        if kind in _WINDOWED:
            g["window"] = rng.randint(2, max_len // 2)   # W=1 attends only itself: no model, vLLM needs a block
            if ratios:                                   # 1-64 blocks, not always block-aligned
                g["window"] = max(2, bs * wide.choice([1, 2, 4, 8, 16, 64]) + wide.randint(-bs // 2, bs // 2))
        elif kind == "chunked_local":
            g["chunk"] = bs * rng.randint(1, max(1, max_len // (2 * bs)))
            if ratios:
                g["chunk"] = bs * wide.choice([1, 2, 4, 8, 16, 64])
        groups.append(g)
    if ratios:          # prompts cross the largest window / chunk three times (capped)
        unit = max([g.get("window", 0) for g in groups] + [g.get("chunk", 0) for g in groups] + [max_len // 3])
        max_len = min(MAX_WIDE, -(-3 * unit // hb) * hb)
        for g in groups:
            for k in ("window", "chunk"):
                if k in g and g[k] > max_len:
                    g[k] = max_len if k == "window" else max_len // g["block_size"] * g["block_size"]
    if rng.random() < 0.5 and groups and groups[0]["kind"] not in ("full", "mla"):
        groups[0] = {"kind": rng.choice(["full", "mla"]), "block_size": groups[0]["block_size"]}
    if any(f.name == fault for f in SWA_FAULTS) and not any(g["kind"] in _WINDOWED for g in groups):
        groups[-1] = {"kind": "swa", "block_size": groups[-1]["block_size"],
                      "window": rng.randint(2, max_len // 2)}
    d: dict[str, Any] = {"description": f"generated from seed {seed}", "groups": groups,
                         "hash_block_size": hb, "max_model_len": max_len}
    if eagle:
        d["use_eagle"] = True
        plain = [i for i, g in enumerate(groups) if g["kind"] not in ("chunked_local", "mamba")]
        chunked = any(g["kind"] == "chunked_local" for g in groups)
        if plain and "is_eagle_group" in feats and (chunked or rng.random() < 0.5):
            d["eagle_groups"] = [rng.choice(plain)]     # vLLM: no EAGLE drop on chunked local
        elif chunked:
            del d["use_eagle"]
    if "retention_interval" in feats and any(g["kind"] in _WINDOWED for g in groups) and not mamba:
        d["retention_interval"] = rng.choice([None, None, 0, sched * rng.randint(1, 3)])
    return d


REFUSALS: Counter = Counter()    # vLLM's construction errors for sampled layouts (first line)


def sample_layout(seed: int, fault: str | None = None, engine: bool = False) -> str:
    """Register the seed's layout; returns its name ("gen:SEED"). A layout the installed
    release refuses to build (its own construction rules differ across releases: 0.14's hybrid
    coordinator wants two distinct specs, ...) is counted in REFUSALS and redrawn; `engine`: so is
    one whose block sizes the release's engine derives otherwise (sched_build.build: CannotExpress;
    none of 150 on 0.34.0)."""
    from kvcheck.fuzz.boundary import CannotExpress

    from .adapter import VllmAdapter
    from .sched_build import SchedKnobs, build
    for k in range(50):
        name = register_layout(sample_definition(seed if k == 0 else f"{seed}/{k}", fault), str(seed), prefix="gen")
        try:
            VllmAdapter(name, 64, fault)
            if engine:
                build(name, SchedKnobs())
            return name
        except (AssertionError, ValueError, TypeError, CannotExpress) as e:
            REFUSALS[f"{type(e).__name__}: {e}".splitlines()[0][:160]] += 1
            forget(name)
    raise ValueError(f"vLLM {vllm_modules()['version']} refused 50 generated layouts in a row ({REFUSALS.most_common(1)})")


def forget(name: str) -> None:
    """Drop a generated layout that produced no finding (a campaign samples thousands)."""
    for table in (LAYOUT_DATA, LAYOUTS, RETENTION, SCALE, EAGLE, FILE_LAYOUTS):
        table.pop(name, None)
