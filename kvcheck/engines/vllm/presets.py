"""Presets: the KV cache groups vLLM 0.33 builds for real models, at a scale the fuzzer can drive.

vLLM groups layers by spec and splits every type into groups of equal layer count
(kv_cache_planning._get_kv_cache_groups_uniform_page_size: the group size is the smallest
type's layer count, or the largest when within 1.5x of it). So Gemma 3's 5 SWA : 1 global
pattern becomes one full group + five identical SWA groups, Llama 4's 3 chunked : 1 full
becomes one full + three chunked groups, gpt-oss's 1:1 alternation two groups. An EAGLE/MTP
drafter's layers join the group whose spec they share (the full / MLA group) and that group
is flagged `is_eagle_group` (KVCacheManager(use_eagle=True)). Windows and chunks are scaled
down (stated in each description) so prompts of a few hundred tokens cross every window,
chunk and alignment unit; block sizes are the ones vLLM uses (16, 64 for FlashMLA).
"""
from __future__ import annotations

Group = tuple[str, int, "int | None"]

# name -> (description, groups, scheduler block, hash block, max_model_len, eagle groups or None)
_P: dict[str, tuple[str, list, int, int, int, tuple[int, ...] | None]] = {
    "gemma3": ("Gemma 3 (5 local : 1 global): full + 5 identical SWA groups, block 16; window 1024 "
               "scaled to 40 (max_model_len 256)",
               [("full", 16, None)] + [("swa", 16, 40)] * 5, 16, 16, 256, None),
    "gpt-oss": ("gpt-oss (alternating full / SWA window 128): 2 groups, block 16, window 128 "
                "unscaled (max_model_len 256)",
                [("full", 16, None), ("swa", 16, 128)], 16, 16, 256, None),
    "llama4": ("Llama 4 (3 chunked local : 1 full): full + 3 identical chunked-local groups, block 16; "
               "chunk 8192 scaled to 64 (max_model_len 256)",
               [("full", 16, None)] + [("chunked_local", 16, 64)] * 3, 16, 16, 256, None),
    "deepseek-v3": ("DeepSeek-V3 (MLA only): one MLAAttentionSpec group, block 64 (FlashMLA), "
                    "max_model_len 384", [("mla", 64, None)], 64, 64, 384, None),
    "deepseek-v3.2": ("DeepSeek-V3.2 (MLA + lightning indexer): MLA group + indexer MLA group "
                      "(cache_role=INDEXER, own page size), block 64, max_model_len 384",
                      [("mla", 64, None), ("mla_indexer", 64, None)], 64, 64, 384, None),
}
# The drafter variants: EAGLE-3 for Gemma 3 / gpt-oss / Llama 4 (a full-attention draft layer,
# joins the full group 0), MTP for DeepSeek (an MLA layer, joins the MLA group 0).
for _n in list(_P):
    _d, _g, _s, _h, _m, _ = _P[_n]
    _kind = "MTP" if _n.startswith("deepseek") else "EAGLE-3"
    _P[f"{_n}+{_kind.lower().split('-')[0]}"] = (
        f"{_d}; with an {_kind} drafter (its layer joins group 0, is_eagle_group; use_eagle=True)",
        _g, _s, _h, _m, (0,))
_DSV4_MTP = ("dsv4+mtp", "as dsv4, with an MTP drafter (an SWA-MLA layer: joins group 0; use_eagle=True)")

# Mamba / linear-attention hybrids (MambaSpec groups in align mode). vLLM's grouping rule gives
# Qwen3-Next-80B (48 layers, gated DeltaNet : full 3:1, 36 + 12) one full group + 3 MambaSpec
# groups of 12 layers, and Nemotron-H-8B (52 layers: 24 Mamba2, 4 attention, 24 MLP without
# cache) one full group + 6 MambaSpec groups of 4. In align mode vLLM makes the attention block
# the Mamba block (sized from the Mamba state's page, hundreds of tokens for these models):
# scaled to 64 here, the hash and scheduler block too, so prompts of a few hundred tokens cross
# several state boundaries. "-fine": CacheConfig.prefix_match_unit = 16 (hits every 16 tokens
# inside the 64-token Mamba block: vLLM 0.33's fine-grained hits and copy-on-write). "+mtp": the
# MTP drafter (qwen3_next_mtp.py: a full-attention layer; nemotron_h_mtp.py: attention + MoE
# layers, no Mamba layer) joins the full group 0 (is_eagle_group, use_eagle), and every MambaSpec
# reserves num_speculative_blocks = num_speculative_tokens (2) speculative state blocks.
_QWEN = [("full", 64, None)] + [("mamba", 64, None)] * 3
_NEMO = [("full", 64, None)] + [("mamba", 64, None)] * 6
_MTP = "; with an MTP drafter (a full-attention draft layer joins group 0, is_eagle_group; MambaSpec " \
       "num_speculative_blocks=2; use_eagle=True)"
_P.update({
    "qwen3-next": ("Qwen3-Next (gated DeltaNet linear attention : full 3:1): full + 3 MambaSpec groups "
                   "(align mode), block 64 (vLLM sizes it from the state page; scaled), max_model_len 512",
                   _QWEN, 64, 64, 512, None),
    "nemotron-h": ("Nemotron-H (Mamba2 : attention 6:1, MLP layers cache nothing): full + 6 MambaSpec "
                   "groups (align mode), block 64 (scaled), max_model_len 512", _NEMO, 64, 64, 512, None),
    "qwen3-next-fine": ("Qwen3-Next with prefix_match_unit=16: full + 3 MambaSpec groups, block 64, hash "
                        "block 16 (hits inside a Mamba block, copy-on-write; vLLM 0.33), max_model_len 512",
                        _QWEN, 64, 16, 512, None),
})
for _n in ("qwen3-next", "nemotron-h", "qwen3-next-fine"):
    _d, _g, _s, _h, _m, _ = _P[_n]
    _P[f"{_n}+mtp"] = (_d + _MTP + ("; shared-prefix checkpoints on (vLLM 0.33)" if _h < _s else ""),
                       _g, _s, _h, _m, (0,))
REFUSED: dict[str, tuple[str, str]] = {}    # name -> (description, why): listed, never built


def _real() -> dict[str, tuple[str, list, int, int, int, tuple[int, ...] | None]]:
    """The layouts at real size ("NAME@real"): vLLM's own rules on the model's own config
    (realsize.py derives them; realsize.json keeps them with the release that derived them)."""
    import json
    from pathlib import Path
    t = json.loads(Path(__file__).with_name("realsize.json").read_text())
    out = {}
    for name, d in t["models"].items():
        groups = [tuple(g) for g in d["groups"]]
        shape = ", ".join(f"{sum(1 for x in groups if x == g)} x {g[0]}" + (f" {g[2]}" if g[2] else "") + f" block {g[1]}"
                          for g in dict.fromkeys(groups))
        out[f"{name}@real"] = (
            f"{name} at real size: vLLM {t['vllm']}'s own rules on transformers' {d['config']} "
            f"({d['layers']} layers{', ' + ', '.join(f'{k}={v}' for k, v in d['env'].items()) if d['env'] else ''}"
            f"{'' if d['hybrid_manager'] else ', hybrid manager off'}): {shape}, in vLLM's group order; "
            f"hash block {d['hash_block']}, max_model_len {d['max_model_len']}",
            groups, d["scheduler_block"], d["hash_block"], d["max_model_len"],
            tuple(d["eagle_groups"]) if d["eagle_groups"] else None)
        f = _ratio_scale(groups, d["hash_block"], d["max_model_len"])
        if f > 1:
            out[f"{name}@ratios"] = (
                f"{name}@real with every size divided by {f} (every ratio kept: hash block : block : window "
                f": Mamba block : max_model_len)",
                [(k, bs // f, p and p // f) for k, bs, p in groups], d["scheduler_block"] // f,
                d["hash_block"] // f, d["max_model_len"] // f, out[f"{name}@real"][5])
    return out


def _ratio_scale(groups: list, hash_block: int, max_len: int) -> int:
    """The largest power of two dividing every size that leaves each block at least 4 tokens."""
    import math
    sizes = [bs for _, bs, _ in groups] + [p for _, _, p in groups if p] + [hash_block, max_len]
    g, f = math.gcd(*sizes), 1
    while g % (2 * f) == 0 and min(bs for _, bs, _ in groups) // (2 * f) >= 4:
        f *= 2
    return f


_REAL = _real()               # (realsize.json read once)
REAL = tuple(_REAL)


def install_presets(layouts: dict, scale: dict, eagle: dict, refused: dict) -> None:
    """Add the presets to the layout tables of layouts.py."""
    _P.update(_REAL)
    for name, (desc, groups, sched, hb, max_len, eg) in _P.items():
        layouts[name] = (desc, list(groups), sched)
        scale[name] = (hb, max_len)
        if eg is not None:
            eagle[name] = eg
    name, desc = _DSV4_MTP
    layouts[name] = (desc, list(layouts["dsv4"][1]), layouts["dsv4"][2])
    eagle[name] = (0,)
    for name, (desc, why) in REFUSED.items():
        layouts[name] = (desc, [("full", 16, None)], 16)
        refused[name] = why


PRESETS = tuple(_P) + REAL + (_DSV4_MTP[0], "dsv4")
