"""vLLM's layouts, planted faults and lazy import: the data the vLLM adapter is built from.

Owns the hybrid layouts (groups of full, sliding-window, chunked-local, MLA, compressed and
indexer attention, their block sizes), the spec Configs that give each layout's ground
truth, the faults the adapter can plant and the check each must trip, and importing vLLM
lazily (about 8 s the first time; without it :class:`VllmUnavailable`, one line).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvcheck.spec.config import Config, LayerSpec
from kvcheck.spec.faults import Fault, Planted, UnknownFault

from .runtime import (INSTALL_HINT, NEWEST, OLDEST, VllmUnavailable, vllm_modules,  # noqa: F401 (re-exported)
                      vllm_version)
from .release import fault_gap, layout_gap

B = 4                 # hash block size (tokens) of the small layouts (presets set their own)
MAX_MODEL_LEN = 64
MAX_TOKENS = 48       # requests never grow past this (max_model_len = 64)
VOCAB = 40

# name -> (description, groups); a group is (kind, block_size, param) with kind in
# full | swa | chunked_local | mla | swa_mla; param = window / chunk size.
LAYOUT_DATA: dict[str, tuple[str, list[tuple[str, int, int | None]], int]] = {
    "full": ("one full-attention group (Llama-like), block 4",
             [("full", 4, None)], 4),
    "full+swa": ("full + sliding window W=6 (Gemma-like), block 4",
                 [("full", 4, None), ("swa", 4, 6)], 4),
    "full+chunked_local": ("full + chunked local attention C=8 (Llama-4-like), block 4",
                           [("full", 4, None), ("chunked_local", 4, 8)], 4),
    "mla+swa_mla": ("MLA + sliding-window MLA W=6 (DeepSeek-V4 SWA branch), block 4",
                    [("mla", 4, None), ("swa_mla", 4, 6)], 4),
    "mixed_block": ("full block 8 + SWA W=6 block 4: scheduler block 8 (LCM), hash block 4 (GCD)",
                    [("full", 8, None), ("swa", 4, 6)], 8),
    "full+swa+swa": ("full + two sliding windows W=6 and W=11 (3 groups, fixed-point lookup)",
                     [("full", 4, None), ("swa", 4, 6), ("swa", 4, 11)], 4),
    "full+mamba": ("full + a Mamba group (MambaSpec, align mode: state cached at block boundaries), "
                   "block 4", [("full", 4, None), ("mamba", 4, None)], 4),
    "full+mamba-fine": ("full block 8 + a Mamba group block 8, hash block 4: hits inside a Mamba block "
                        "(fine-grained, copy-on-write; vLLM 0.33)", [("full", 8, None), ("mamba", 8, None)], 8),
    "dsv4": ("DeepSeek-V4-like: SWA-MLA W=8 + CSA compressed MLA (m=4) + its sparse indexer (m=4) "
             "+ HCA compressed MLA (m=16, block 16) + compressor tail ring (not cacheable)",
             [("swa_mla", 4, 8), ("compressed", 4, 4), ("indexer", 4, 4), ("compressed", 16, 16),
              ("tail_ring", 8, None)], 16),
}
# Sparse prefix-cache retention (KVCacheConfig.prefix_cache_retention_interval = 0): sliding-window
# groups only keep the blocks a reachable boundary (replay point, shared-prefix junction) needs.
RETENTION: dict[str, int] = {}
for _base in ("full+swa", "mixed_block"):
    _d, _g, _s = LAYOUT_DATA[_base]
    LAYOUT_DATA[f"{_base}-sparse"] = (f"{_d}; sparse SWA retention (prefix_cache_retention_interval=0)", _g, _s)
    RETENTION[f"{_base}-sparse"] = 0
# Per-layout scale and drafter: name -> (hash block, max_model_len) when not (B, MAX_MODEL_LEN);
# name -> the groups holding EAGLE/MTP draft layers (KVCacheManager(use_eagle=True)).
SCALE: dict[str, tuple[int, int]] = {}
EAGLE: dict[str, tuple[int, ...]] = {}
_REFUSED: dict[str, str] = {}            # layouts listed but refused (why, one line)
from .presets import install_presets  # noqa: E402
install_presets(LAYOUT_DATA, SCALE, EAGLE, _REFUSED)
GENERATED = "generated"                  # run_campaign samples a layout per episode (generator.py)
LAYOUTS: dict[str, str] = {k: v[0] for k, v in LAYOUT_DATA.items()}
LAYOUTS[GENERATED] = ("a layout sampled per episode from a grammar (1-6 groups of any kind the "
                      "release has, mixed block sizes, hash block, use_eagle, retention None/0/N)")
FILE_LAYOUTS: dict[str, dict] = {}      # name -> the JSON a --layout-file gave (kept in traces)


def layout_scale(layout: str) -> tuple[int, int]:
    """(hash block size, max_model_len) of a layout."""
    return SCALE.get(layout, (B, MAX_MODEL_LEN))


def register_layout(definition: Any, where: str, prefix: str = "file") -> str:
    """Validate a user's (or the generator's) layout (layout_file.py) and make it a layout
    like the presets; its name is `prefix` + ":" + `where`. Returns the name."""
    from .layout_file import parse_layout, parse_scale
    desc, groups, sched, ret = parse_layout(definition, where, B, MAX_MODEL_LEN)
    hb, max_len, eagle = parse_scale(definition, B, MAX_MODEL_LEN)
    name = f"{prefix}:{Path(where).stem}"
    LAYOUT_DATA[name] = (desc, groups, sched)
    LAYOUTS[name] = desc
    RETENTION.pop(name, None)
    SCALE.pop(name, None)
    EAGLE.pop(name, None)
    if ret is not None:
        RETENTION[name] = ret
    if (hb, max_len) != (B, MAX_MODEL_LEN):
        SCALE[name] = (hb, max_len)
    if eagle is not None:
        EAGLE[name] = eagle
    FILE_LAYOUTS[name] = definition
    return name


def load_layout_file(path: str) -> str:
    """`--layout-file PATH` -> the registered layout's name (ValueError: one line)."""
    from .layout_file import read_layout_file
    return register_layout(read_layout_file(path), path)

# The faults the adapter plants in vLLM's own classes (declared patches: the adapter's sites
# ask `planted(FAULT)`); `kvcheck faults` lists them through fuzz/faults.py.
def _fault(name: str, site: str, bug_class: str, expected: str, doc: str) -> Fault:
    return Fault(name, "vllm", site, bug_class, "vLLM v1 KV cache manager (planted in a thin wrapper)",
                 expected, doc, ("vllm",))


DROP_REF_ON_FREE = _fault(
    "drop_ref_on_free", "vllm:KVCacheManager.free", "refcount imbalance", "refcount_equals_holders",
    "free() drops one extra reference of a block still shared by another request")
SWA_HIT_UNCHECKED = _fault(
    "swa_hit_unchecked", "vllm:SlidingWindowManager._contiguous_blocks_for_hit",
    "window not covering needed positions", "hit_sound_swa_window",
    "sliding-window lookup accepts a hit after checking only its last block (window coverage unchecked)")
EVICT_KEEPS_HASH = _fault(
    "evict_keeps_hash", "vllm:BlockPool._maybe_evict_cached_block", "stale hash after free",
    "hash_map_sound", "reusing a free cached block does not remove its hash from the prefix-cache map")
SWA_OVERSTRICT = _fault(
    "swa_overstrict", "vllm:SlidingWindowManager._contiguous_blocks_for_hit", "lost reuse",
    "lost_reuse", "sliding-window lookup demands one more contiguous block than the window needs")
RETENTION_DROPS_TAIL = _fault(
    "retention_drops_tail", "vllm:SlidingWindowManager.reachable_block_mask", "lost reuse (retention)",
    "lost_reuse_retention", "sparse retention leaves out the last sliding-window block before the replay "
    "boundary, so a resend or longer sibling of a prompt cannot hit where the policy promises "
    "(caught by the dense twin, twin.py; needs a layout with a retention interval)")
MAMBA_OLDER_STATE = _fault(
    "mamba_hit_older_state", "vllm:MambaManager.find_longest_cache_hit", "stale recurrent state",
    "hit_sound_recurrent_state", "the Mamba lookup accepts the longest boundary the other groups hit "
    "although no state is cached there, handing out the newest older state padded with null blocks "
    "(needs a layout with a mamba group)")
MAMBA_STATE_FREED = _fault(
    "mamba_state_freed_early", "vllm:MambaManager.remove_skipped_blocks", "state block freed before its copy",
    "state_copy_sound", "align mode retires a request's current state block once it is full (as if it "
    "were KV), so the next step has no state to copy from (needs a layout with a mamba group)")
MAMBA_SAME_STEP = _fault(
    "mamba_same_step_hit", "vllm:MambaManager.get_num_blocks_to_allocate (cached_blocks_this_step)",
    "state read before its forward wrote it", "state_copy_sound", "the Mamba manager forgets the states "
    "published in the open step, so a request is admitted with a hit on a state that only this step's "
    "forward writes: the step's state copy (before the forward) reads bytes not written yet (needs "
    "scheduler steps and a mamba group)")
MAMBA_MOVE_UNCOPIED = _fault(
    "mamba_partial_move_uncopied", "vllm:MambaManager.allocate_new_blocks (copy-on-write move)",
    "cache entry without its state", "hash_map_sound", "a running request's partial-tail state entry "
    "moves to a fresh block before its forward overwrites the state in place, but the copy that fills "
    "the fresh block is dropped: the entry points at a block without that state (needs a Mamba block "
    "larger than the hash block: fine-grained hits)")
MAMBA_PARTIAL_OFF_BY_ONE = _fault(
    "mamba_partial_hit_off_by_one", "vllm:MambaManager.find_longest_cache_hit (fine-grained)",
    "stale recurrent state", "hit_sound_recurrent_state", "the fine-grained Mamba lookup reports a hit "
    "inside a Mamba block one hash block past the boundary whose state it found (off by one): the "
    "resume reads the state after fewer tokens than its hit (needs fine-grained hits)")
EARLY_READER_FORWARD = _fault(
    "early_reader_forward", "vllm:Scheduler forward (the step's execution)", "read before write",
    "read_before_write", "the step runs the requests it admitted in a forward of their own before the "
    "running requests' forward (a micro-batched step), so a hit on a block published in the same step "
    "reads it before its writer's forward has written it (timeline.py)")
WORKER_TABLE_STALE = _fault(
    "worker_table_stale", "vllm:Scheduler._make_cached_request_data (new_block_ids)", "stale block table",
    "worker_table_sound", "the scheduler's output leaves a running request's first new block out of "
    "new_block_ids, so the worker's block table (built from the outputs alone, worker.py) no longer "
    "matches the manager's: the forward writes its slots into the wrong blocks (needs --drive engine)")
MAMBA_ACCEPT_IGNORED = _fault(
    "mamba_accept_ignored", "vllm:preprocess_mamba (num_accepted_tokens)", "stale recurrent state",
    "state_copy_sound", "the worker forgets how many draft tokens the sampler accepted and resumes the "
    "next step from the state after the step's known tokens (column 0 of its state block), not the one "
    "after the accepted drafts (mamba_worker.py; needs --drive engine and a Mamba layout with a drafter)")
CONNECTOR_CACHE_EARLY = _fault(
    "connector_cache_early", "vllm:KVCacheManager.allocate_slots (delay_cache_blocks)", "read before write",
    "read_before_write", "an asynchronous KV connector load's blocks are published in the prefix cache at "
    "allocation, before the worker has loaded them: another request hits them and its forward reads bytes "
    "the load has not delivered (connector.py; needs --drive engine and a layout the connector serves)")
VLLM_FAULTS: tuple[Fault, ...] = (DROP_REF_ON_FREE, SWA_HIT_UNCHECKED, EVICT_KEEPS_HASH, SWA_OVERSTRICT,
                                  RETENTION_DROPS_TAIL, EARLY_READER_FORWARD, WORKER_TABLE_STALE, MAMBA_OLDER_STATE, MAMBA_STATE_FREED,
                                  MAMBA_SAME_STEP, MAMBA_MOVE_UNCOPIED, MAMBA_PARTIAL_OFF_BY_ONE, MAMBA_ACCEPT_IGNORED,
                                  CONNECTOR_CACHE_EARLY)
ENGINE_FAULTS = (WORKER_TABLE_STALE, MAMBA_ACCEPT_IGNORED, CONNECTOR_CACHE_EARLY)   # planted in what only the engine drive runs
FAULTS: dict[str, tuple[str, str]] = {f.name: (f.expected, f.doc) for f in VLLM_FAULTS}  # name -> (check, doc)
SWA_FAULTS = (SWA_HIT_UNCHECKED, SWA_OVERSTRICT)      # need a layout with a sliding-window group
MAMBA_FAULTS = (MAMBA_OLDER_STATE, MAMBA_STATE_FREED, MAMBA_SAME_STEP,   # need a layout with a mamba
                 MAMBA_MOVE_UNCOPIED, MAMBA_PARTIAL_OFF_BY_ONE)            # group (mamba_faults.py)
MAMBA_FINE_FAULTS = (MAMBA_MOVE_UNCOPIED, MAMBA_PARTIAL_OFF_BY_ONE)      # and hits inside a Mamba block


def planted(name: str | None) -> Planted:
    """The adapter's probe for a fault name (unknown names are refused, naming the SUT)."""
    by_name = {f.name: f for f in VLLM_FAULTS}
    if name is not None and name not in by_name:
        raise UnknownFault(name, f"unknown vLLM fault {name!r}; --sut vllm plants: {', '.join(by_name)}")
    return Planted(None if name is None else by_name[name])

# The mapped actions (every one must be exercised by a campaign).
SINGLE_ACTIONS = ("submit", "lookup", "prefill", "decode", "finish", "preempt", "reset_prefix_cache",
                  "evict_blocks")      # one request per step (each allocation's forward completes at once)
STEP_ACTIONS = ("begin_step", "forward")   # a scheduler step: several allocations, then its forward
ACTIONS = SINGLE_ACTIONS + STEP_ACTIONS
SAFETY_CHECKS = ("hit_aligned", "hit_leaves_last_token", "hit_length_equal",
                 "hit_sound_swa_window", "hit_sound_chunked_local", "hit_sound_compressed_kv",
                 "hit_sound_indexer", "hit_sound_tail", "hit_sound_recurrent_state", "state_copy_sound",
                 "read_before_write", "worker_table_sound")
BOOKKEEPING_CHECKS = ("refcount_equals_holders", "free_queue_iff_unreferenced", "free_count",
                      "null_block_inert", "no_alias", "hash_map_sound", "toctou_bound_stable")


_FAULT_SITE = {"swa_hit_unchecked": "swa_contiguous_rule", "swa_overstrict": "swa_contiguous_rule",
               "retention_drops_tail": "retention_interval", "mamba_partial_move_uncopied": "mamba_partial_hits",
               "mamba_partial_hit_off_by_one": "mamba_partial_hits"}


def release_gap(layout: str, fault: str | None = None) -> str | None:
    """Why the installed release cannot run this layout (or plant this fault): one line, or None."""
    V = vllm_modules()
    if layout in _REFUSED:
        return f"vLLM {V['version']}: {_REFUSED[layout]}"
    groups = LAYOUT_DATA[layout][1]
    hb = layout_scale(layout)[0]
    gap = layout_gap(V["version"], V["features"], [k for k, _, _ in groups], layout in RETENTION,
                     any(k == "mamba" and bs != hb for k, bs, _ in groups))
    if gap is None and layout in EAGLE and "use_eagle" not in V["features"]:
        gap = f"vLLM {V['version']} cannot express this layout: KVCacheManager has no use_eagle"
    if gap is None and layout in EAGLE and "is_eagle_group" not in V["features"] \
            and any(k == "chunked_local" for k, _, _ in groups):
        gap = (f"vLLM {V['version']} cannot express this layout: without is_eagle_group every group "
               "takes the EAGLE drop, and its chunked local lookup refuses EAGLE")
    if gap is None and layout in EAGLE and "eagle_mixed_block" not in V["features"] \
            and any(bs != LAYOUT_DATA[layout][2] for k, bs, _ in groups if k in ("swa", "swa_mla")):
        gap = (f"vLLM {V['version']} cannot express this layout: its sliding-window lookup asserts "
               "block_size == the hit alignment under EAGLE")
    site = next((f.site for f in VLLM_FAULTS if f.name == fault), "")
    return gap or fault_gap(V["version"], V["features"], _FAULT_SITE.get(fault or ""), site)


def supported_layouts() -> dict[str, str | None]:
    """Every layout with the reason the installed release cannot run it (None: it can)."""
    return {name: release_gap(name) for name in LAYOUT_DATA}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# vLLM's semantics among the spec's configurable ones (docs/spec.md "Configurable semantics"),
# declared in every layout's Config, and the adapter check that holds each semantic's invariant:
# eviction = "drop_hash" (a reused free block's hash leaves the map: published_hash_resident ->
# hash_map_sound), decode = true (only full blocks are cached: hit_full_blocks -> hit_aligned),
# alloc = "evict" (allocate_slots evicts LRU free cached blocks itself or returns None:
# toctou_bound_stable -> toctou_bound_stable, admission_cap -> free_count). Token content is the
# adapter's own (any prompt; hit_content_sound -> the content shadow of every hit_sound_* check).
VLLM_SEMANTICS = {"eviction": "drop_hash", "decode": True, "alloc": "evict"}
SEMANTIC_CHECKS = {"published_hash_resident": "hash_map_sound", "hit_full_blocks": "hit_aligned",
                   "toctou_bound_stable": "toctou_bound_stable", "admission_cap": "free_count"}


def layout_config(layout: str) -> Config:
    """The spec Config whose groups give the layout's ground truth (and which traces carry),
    with vLLM's semantics declared (VLLM_SEMANTICS): one `full` layer for the full-attention
    groups, one `swa` layer per distinct sliding window (each group reads its own window: the
    spec retains a window per group), `mamba` for a Mamba group. Page sizes are keyed by layer
    kind: the first group's of each kind (the checks map blocks with each vLLM group's own block
    size). Chunked local has no spec kind: it is checked by the adapter's own rule and left out."""
    if layout.startswith("dsv4"):   # the spec's view: swa + csa (m=4, indexer) + hca (m=16)
        layers = (LayerSpec("swa", window=8), LayerSpec("csa", window=8, m=4, topk=1),
                  LayerSpec("hca", window=8, m=16))
        return Config(layers=layers, block_size=B, page_tokens={"hca": 16}, **VLLM_SEMANTICS)
    hb = layout_scale(layout)[0]
    full, swas = [], {}
    rec = [LayerSpec("mamba")] if any(k == "mamba" for k, _, _ in LAYOUT_DATA[layout][1]) else []
    for kind, bs, p in LAYOUT_DATA[layout][1]:
        if kind in ("full", "mla", "mla_indexer"):
            full.append(bs)
        elif kind in ("swa", "swa_mla"):
            swas.setdefault(p, bs)
    # chunked-local-only layouts: a full config stands in (chunked local has no spec kind)
    layers = [LayerSpec("full")] if full or not swas else []
    layers += [LayerSpec("swa", window=w) for w in swas]
    page = {"full": full[0]} if full else {}
    if swas:
        page["swa"] = next(iter(swas.values()))
    page = {k: v for k, v in page.items() if v != hb}
    return Config(layers=tuple(layers + rec), block_size=hb, page_tokens=page, **VLLM_SEMANTICS)


def make_specs(layout: str) -> list:
    from .mamba import spec_kwargs
    V = vllm_modules()
    torch = V["torch"]
    common = dict(num_kv_heads=1, head_size=8, dtype=torch.float32)
    out = []
    for kind, bs, p in LAYOUT_DATA[layout][1]:
        if kind == "full":
            out.append(V["FullAttentionSpec"](block_size=bs, **common))
        elif kind == "swa":
            out.append(V["SlidingWindowSpec"](block_size=bs, sliding_window=p, **common))
        elif kind == "chunked_local":
            out.append(V["ChunkedLocalAttentionSpec"](block_size=bs, attention_chunk_size=p, **common))
        elif kind == "mla":
            out.append(V["MLAAttentionSpec"](block_size=bs, num_kv_heads=1, head_size=16,
                                             dtype=torch.float32))
        elif kind == "mla_indexer":   # DeepSeek-V3.2's lightning indexer: one key vector per token
            out.append(V["MLAAttentionSpec"](block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32,
                                             cache_role=V["SparseCacheRole"].INDEXER))
        elif kind == "swa_mla":
            out.append(V["SlidingWindowMLASpec"](block_size=bs, sliding_window=p, num_kv_heads=1,
                                                 head_size=16, dtype=torch.float32,
                                                 **({"model_version": "deepseek_v4"} if layout.startswith("dsv4") else {})))
        elif kind in ("compressed", "indexer"):
            extra = {"cache_role": V["SparseCacheRole"].INDEXER} if kind == "indexer" else {}
            out.append(V["MLAAttentionSpec"](block_size=bs, num_kv_heads=1, head_size=16,
                                             dtype=torch.float32, tokens_per_state=p,
                                             model_version="deepseek_v4", **extra))
        elif kind == "mamba":       # align mode: the state cached at block boundaries
            out.append(V["MambaSpec"](block_size=bs, shapes=((2, 4),), dtypes=(torch.float32,),
                                      mamba_cache_mode="align", **spec_kwargs(layout in EAGLE, V["features"])))
        elif kind == "tail_ring":
            out.append(V["CircularBufferSpec"](block_size=bs, num_kv_heads=1, head_size=16,
                                               head_size_v=0, dtype=torch.float32))
    return out


