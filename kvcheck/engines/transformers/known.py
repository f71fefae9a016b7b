"""Known transformers defects a `kvcheck diff` run recognises by their signature (fuzz/known.py
decides what a recognised defect means for the verdict, the same for every engine).

`recurrent_state_multitoken_extend`: a layer whose cache holds a recurrent / convolution state
(Mamba, Mamba2, gated delta net) continues a populated cache correctly one token at a time and
wrongly with several tokens at once: the mixer takes its cached state only when `seq_len == 1`
and otherwise restarts from zero (or crashes), so chunked prefill after a cache, speculative
verification and any multi-token extend are wrong while generate()'s decode is right. Upstream:
transformers PR #45513 (gated delta net: qwen3_next, qwen3_5, qwen3_5_moe, olmo_hybrid; fixed in
5.7.0), issue #46032 / PR #46084 (Mamba2Mixer; fixed in 5.13) and PR #46741 (the Mamba2 mixers of
Zamba2, Nemotron-H, Bamba, FalconH1, GraniteMoeHybrid); the Mamba1 mixer (mamba, falcon_mamba,
jamba) still has it in 5.24, no upstream report found (docs/repro/transformers_multitoken_extend.py
exits 1 on every 5.x minor for mamba). The signature is read from the run's own scenarios, never from the model
type's name: every token-by-token continuation agrees with the recompute (and at least one ran),
and every scenario that diverged or crashed continued with several tokens at once and first
went wrong in a layer that holds such a state.

`sliding_record_uncropped_forward`: with the cache's past recording on (assisted decoding's
roll-back support), a second forward before any crop, past the sliding window, crashes in the
attention: the sliding layer's `update` returns every recorded key while `get_mask_sizes`
announces only the window (later releases slice what `update` returns; their comment names an
assistant that calls `generate` with a past-aware cache). Signature: a `crop_continue` scenario
(several forwards, then the crop) crashed in the attention of a sliding layer.

`positions_restart_without_cache`: a forward given a populated cache and no positions starts the
new tokens' positions at 0 instead of where the cache ends, so RoPE rotates every reused query and
key wrongly while the cache itself is right (Bamba from 5.4.0, when `cache_position` was removed:
`position_ids = torch.arange(seq_len)`; its siblings add `cache.get_seq_length()`). `generate()`
passes positions and is unaffected; a caller continuing a returned cache, as transformers' docs
teach, is not. Signature: a divergent scenario that agrees with the recompute when its extend is
replayed with explicit `position_ids` (positions.py); never read from the model type's name.

`generate_refeeds_cached_prefix`: `generate()` handed the cache of a prefix of its `input_ids`
feeds the whole `input_ids` through the model again instead of the tokens the cache does not
hold, so the prefix goes through every layer twice. Seen on the models whose cache has no
attention layer (mamba, mamba2, falcon_mamba; Mamba2 from 5.4.0 to 5.24.0, fixed in 5.25.0): generate
reads how many tokens the cache holds from `Cache.get_seq_length()`, which asks the attention
layers only. Signature: a divergent
`generate_continue` scenario whose first generated logits equal a forward of the whole prompt onto
a fresh copy of the prefix's cache (paths.py `refeed_probe`); never read from the model type's name.
"""
from __future__ import annotations

import re
from typing import Any

from kvcheck.fuzz.known import KnownDefect

MULTITOKEN = "recurrent_state_multitoken_extend"
KNOWN = {MULTITOKEN: KnownDefect(
    name=MULTITOKEN, check="reuse_equals_recompute", kind="differential", first="5.0.0", last="5.25.0",
    upstream="transformers#45513 (gated delta net, 5.7.0), #46032/#46084 (Mamba2, 5.13), #46741 (Mamba2 mixers of "
             "hybrids); the Mamba1 mixer (mamba, falcon_mamba, jamba): none found, still in 5.24",
    repro="kvcheck diff --sut transformers --model-type mamba2 (on a release with it)")}

UNCROPPED = "sliding_record_uncropped_forward"
KNOWN[UNCROPPED] = KnownDefect(
    name=UNCROPPED, check="reuse_equals_recompute", kind="differential", first="5.15.0", last="5.17.0",
    upstream="none found (fixed in 5.18.0: DynamicSlidingWindowLayer.update returns only the keys get_mask_sizes "
             "announces while recording)",
    repro="docs/repro/transformers_sliding_record_uncropped.py")

POSITIONS = "positions_restart_without_cache"
KNOWN[POSITIONS] = KnownDefect(
    name=POSITIONS, check="reuse_equals_recompute", kind="differential", first="5.4.0", last="5.25.0",
    upstream="none found (BambaModel.forward: position_ids = torch.arange(seq_len) without the cache's length, "
             "since 5.4.0; Jamba, FalconH1, GraniteMoeHybrid add cache.get_seq_length())",
    repro="docs/repro/transformers_positions_from_zero.py")

REFEED = "generate_refeeds_cached_prefix"
KNOWN[REFEED] = KnownDefect(      # the reproducer on mamba2: 5.3.0 ok, 5.4.0-5.24.0 the defect, 5.25.0 ok
    name=REFEED, check="reuse_equals_recompute", kind="differential", first="5.4.0", last="5.24.0",
    upstream="none found, fixed in 5.25.0 (closest: transformers#38134, closed unmerged; #44950: get_seq_length "
             "asks attention layers only)",
    repro="docs/repro/transformers_generate_refeeds_recurrent_cache.py")

STATE_TYPES = ("linear_attention", "mamba", "mamba2", "conv", "recurrent", "ssm", "hybrid")
STATE_CLASSES = re.compile(r"Linear|Mamba|Conv|Recurrent|SSM", re.I)
STATE_MODULES = re.compile(r"(?:^|\.)(?:mixer|mamba|linear_attn|conv1d|ssm|short_conv)(?:\.|$)")
BAD = ("divergent", "error")
MULTI = ("one_chunk", "chunks")


def _crash_layer(sc: dict[str, Any]) -> tuple[int | None, str]:
    m = re.search(r"crashed in layer (\d+|None), module (\S+?):", str(sc.get("error") or ""))
    if not m:
        return None, ""
    return (int(m.group(1)) if m.group(1).isdigit() else None), m.group(2)


def _said(res: dict[str, Any], layer: int | None) -> tuple[str | None, str | None]:
    """What the run says of `layer`: (the config's layer type, the release's cache layer class)."""
    def at(key: str) -> str | None:
        xs = res.get(key) or []
        return xs[layer] if layer is not None and layer < len(xs) and isinstance(xs[layer], str) else None
    return at("layer_types"), at("cache_layer_classes")


def _state_layer(res: dict[str, Any], layer: int | None, module: str) -> bool:
    """Whether `layer` holds a recurrent/convolution state: by the config's layer type or the
    cache layer class the release made for it; a release that says neither: by the module that
    went wrong (a Mamba mixer, a linear-attention conv)."""
    kind, cls = _said(res, layer)
    if kind is not None:
        return kind in STATE_TYPES
    return bool(STATE_CLASSES.search(cls)) if cls is not None else bool(STATE_MODULES.search(module))


def _sliding(res: dict[str, Any], layer: int | None) -> bool:
    kind, cls = _said(res, layer)
    return "sliding" in kind if kind is not None else cls is not None and "Sliding" in cls


def uncropped(scen: list[dict[str, Any]], res: dict[str, Any]) -> list[dict[str, Any]]:
    """`sliding_record_uncropped_forward`: a crop_continue scenario (past recording on, several
    forwards before the crop) crashed in a sliding layer's attention."""
    out = []
    for s in scen:
        layer, module = _crash_layer(s)
        if s.get("suffix_mode") == "crop_continue" and s.get("verdict") == "error" and module.endswith("self_attn") \
                and _sliding(res, layer):
            out.append(s)
    return out


def recognise(res: dict[str, Any]) -> tuple[dict[str, int], bool]:
    """({"known:NAME": scenarios}, whether every bad scenario is explained) for a run's result."""
    scen = [s for s in res.get("scenarios") or [] if isinstance(s, dict)]
    counts: dict[str, int] = {}
    moved = positions(scen)     # right once given their positions: evidence for the decode path too
    for name, found in ((POSITIONS, moved), (UNCROPPED, uncropped(scen, res)), (REFEED, refeeds(scen))):
        if found:
            counts[f"known:{name}"] = len(found)
            scen = [s for s in scen if s not in found]
    more, explained = _multitoken(scen, res, moved)
    counts.update(more)
    return counts, bool(counts) and (explained or not any(s.get("verdict") in BAD for s in scen))


def refeeds(scen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`generate_refeeds_cached_prefix`: divergent generate_continue scenarios whose first logits are
    the whole prompt fed onto the prefix's cache again."""
    return [s for s in scen if s.get("verdict") == "divergent" and s.get("suffix_mode") == "generate_continue"
            and (s.get("refeed_probe") or {}).get("agrees")]


def positions(scen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`positions_restart_without_cache`: divergent scenarios whose extend, replayed with explicit
    positions, agrees with the recompute."""
    return [s for s in scen if s.get("verdict") == "divergent" and (s.get("positions_probe") or {}).get("agrees")]


def _multitoken(scen: list[dict[str, Any]], res: dict[str, Any],
                moved: list[dict[str, Any]] = ()) -> tuple[dict[str, int], bool]:
    """`moved`: scenarios that agree once given explicit positions (positions_restart_without_cache):
    a token-by-token one among them shows the decode path right, as an agreeing one does."""
    single = [s for s in [*scen, *moved] if s.get("suffix_mode") == "token_by_token"]
    bad = [s for s in scen if s.get("verdict") in BAD]
    if not bad or not single or any(s.get("verdict") in BAD for s in single if s not in moved):
        return {}, False
    op = str(res.get("first_divergent_operation") or "")
    hits = 0
    for s in bad:
        if s.get("verdict") == "error":
            layer, module = _crash_layer(s)
        else:
            layer, module = s.get("first_divergent_layer"), op
        if s.get("suffix_mode") in MULTI and _state_layer(res, layer, module):
            hits += 1
    return ({f"known:{MULTITOKEN}": hits} if hits else {}), hits == len(bad)
