"""Which transformers model types are hybrid, and a tiny config for any of them.

Owns discovery (from the installed library: config classes, their layer types and granularity
fields, the cache layer classes the modeling code uses), the derivation of a tiny config whose
every granularity is small enough for sequences of a few dozen tokens to cross it several times,
(building the model from it: transformers_build). ``transformers`` is imported lazily.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from typing import Any

from . import rules

INSTALL_HINT = "pip install -r requirements-transformers.txt"


class AdapterError(Exception):
    """Usage error of the transformers adapter (unknown model type, bad config, missing package);
    the message is one line and the CLI maps it to exit code 2."""


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def import_transformers():
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise AdapterError(f"transformers is not installed ({exc}); install it with: {INSTALL_HINT}") from None
    if not hasattr(transformers, "AutoConfig"):
        raise AdapterError(f"the module named transformers at {getattr(transformers, '__file__', '?')} is not "
                           f"the Hugging Face library (it shadows it); install it with: {INSTALL_HINT}")
    transformers.logging.set_verbosity_error()
    return transformers


ALIASES = {"gemma3": "gemma3_text", "gpt-oss": "gpt_oss", "qwen3-next": "qwen3_next"}

# Granularity fields: the sizes a cache works in. Value = the tiny size we give it; windows,
# chunks and compression rates differ so that their boundaries do not all coincide.
WINDOW_FIELDS = ("sliding_window", "window_size", "attention_window_size", "sliding_window_size",
                 "local_attention", "local_attention_window_len", "keep_window_size")
GRANULARITY = {
    **{f: 8 for f in WINDOW_FIELDS},
    "attention_chunk_size": 6, "block_size": 8, "chunk_size": 8, "mamba_chunk_size": 8,
    "index_block_size": 4, "index_topk_blocks": 2, "index_local_blocks": 1, "index_topk": 3,
    "indexer_compress_ratio": 4, "indexer_budget": 8, "conv_kernel": 4, "linear_conv_kernel_dim": 4, "mamba_d_conv": 4,
    "conv1d_width": 4, "conv_kernel_size": 4, "short_conv_kernel_size": 4, "conv_L_cache": 3,
    "ple_conv_kernel_size": 4,
}
COMPRESS_RATES = (4, 16)  # compress_rates dict values, in the order the config lists them
# Dimension fields (exact names), set small and consistent.
SIZES = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
    "head_dim": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "kv_lora_rank": 32,
    "q_lora_rank": 32, "o_lora_rank": 16, "o_groups": 2, "index_head_dim": 16, "index_n_heads": 2,
    "n_routed_experts": 4, "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "num_experts_per_token": 2,
    "moe_topk": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_head_dim": 16, "linear_num_heads": 4, "lru_width": 64,
    "mamba_n_heads": 4, "mamba_num_heads": 4, "n_mamba_heads": 4, "mamba_n_groups": 1, "n_groups": 1,
    "mamba_ngroups": 1, "mamba_d_state": 8, "ssm_state_size": 8, "state_size": 8, "mamba_d_head": 32,
    "mamba_head_dim": 32, "mamba_d_ssm": 128, "mamba_expand": 2, "expand": 2, "mamba_dt_rank": 8,
    "time_step_rank": 8, "hc_mult": 2, "num_nextn_predict_layers": 0, "swa_head_dim": 16,
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "attention_hidden_size": 64,
    "num_mem_blocks": 1, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 128,
    "laurel_rank": 8, "altup_num_inputs": 2, "global_head_dim": 16, "moe_latent_size": None,
    "sliding_window_pattern": 2, "max_window_layers": 1, "interleave_moe_layer_step": 1,
    "num_kv_shared_layers": 0, "qk_head_dim": 24,
}
# Dimension fields by pattern (when not named above), applied only to values above the cap.
SIZE_PATTERNS = ((re.compile(r"intermediate_size|ffn_dim|ff_dim|ffn_hidden"), 32), (re.compile(r"vocab"), 128),
                 (re.compile(r"lora_rank$"), 32), (re.compile(r"head_dim$"), 16),
                 (re.compile(r"(^|_)n_heads$|^num_\w*heads$"), 4))
SIZE_CAPS = {16: 64, 32: 64, 128: 128, 4: 8}  # pattern value -> only shrink values above this
MAX_LAYERS = 6
MAX_PARAMS = 4_000_000  # a tiny model; a bigger one means a sub-config was not shrunk
# Hybrid evidence in a config's field names (besides layer types other than full attention).
EVIDENCE = re.compile(r"^(sliding_window|window_size|attention_window_size|sliding_window_size|local_attention"
                      r"|local_attention_window_len|attention_chunk_size|compress_rates|index_topk"
                      r"|index_topk_blocks|indexer_compress_ratio|block_types|layers_block_type|attention_types"
                      r"|attn_layer_period|mamba_\w+|ssm_state_size|state_size|conv_kernel|linear_\w+_dim"
                      r"|conv_L_cache|conv1d_width|lru_width|short_conv_kernel_size|conv_kernel_size)$")
PATTERN_LISTS = ("layer_types", "layers_block_type", "block_types", "mlp_layer_types")


def config_mapping():
    import_transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def modeling_source(mt: str) -> str:
    """The text of the model's modeling file ('' when there is none); read, not imported."""
    import importlib.util
    import os

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    mod = model_type_to_module_name(mt)
    spec = importlib.util.find_spec("transformers")
    path = os.path.join(os.path.dirname(spec.origin), "models", *mod.split("."), f"modeling_{mod.split('.')[-1]}.py")
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return ""


def layer_kinds_in_source(mt: str) -> list[str]:
    """Layer kinds the modeling code compares ``layer_types`` entries with (``!= "conv"``)."""
    found = re.findall(r"layer_types?\b(?:\[[^\]]*\])?\s*(?:==|!=)\s*[\"'](\w+)[\"']", modeling_source(mt))
    return list(dict.fromkeys(found))


def _cache_classes_in_source(mt: str) -> list[str]:
    """Cache layer classes the model's modeling file defines or names (read as text, not imported)."""
    src = modeling_source(mt)
    if not src:
        return []
    from transformers import cache_utils

    known = [n for n in dir(cache_utils) if n.endswith("Layer") and n not in ("DynamicLayer", "StaticLayer",
                                                                            "DummyLayer", "CacheLayerMixin")]
    found = sorted({n for n in known if re.search(rf"\b{n}\b", src)})
    found += sorted(set(re.findall(r"class (\w+)\((?:\w+\.)?(?:CacheLayerMixin|DynamicLayer|"
                                   r"LinearAttentionCacheLayerMixin|Cache)\)", src)))
    return found


def describe(mt: str) -> dict[str, Any] | None:
    """What makes ``mt`` hybrid, from its default config and modeling source; None if uniform full attention."""
    mapping, _ = config_mapping()
    try:
        cfg = mapping[mt]()
        cfg = cfg.get_text_config(decoder=True)
        d = cfg.to_dict()
    except Exception as exc:  # noqa: BLE001 - a config class that cannot even default-construct
        return dict(model_type=mt, layer_kinds=[], fields={}, cache_classes=[], note=f"default config: {one_line(exc)}")
    kinds: list[str] = []
    for key in PATTERN_LISTS[:3] + ("attention_types",):
        val = d.get(key)
        if isinstance(val, list):
            for x in _flatten(val):
                if isinstance(x, str) and x not in kinds:
                    kinds.append(x)
    fields = {k: v for k, v in d.items() if EVIDENCE.match(k) and v not in (None, False, 0)
              and not isinstance(v, (bool,))}
    if d.get("use_sliding_window") is False:
        fields = {k: v for k, v in fields.items() if k != "sliding_window"} | {"sliding_window": "optional"}
    classes = _cache_classes_in_source(mt)
    non_full = [k for k in kinds if k not in ("full_attention", "attention", "global", "mlp", "moe", "dense")]
    if not (non_full or fields or classes):
        return None
    return dict(model_type=mt, layer_kinds=kinds, fields=_jsonable_fields(fields), cache_classes=classes)


def _flatten(x):
    for v in x:
        if isinstance(v, list):
            yield from _flatten(v)
        else:
            yield v


def _jsonable_fields(f: dict) -> dict:
    return json.loads(json.dumps(f, default=str))


def list_model_types() -> list[dict[str, Any]]:
    """Every causal-LM model type of the installed transformers whose cache is not uniform full attention."""
    return copy.deepcopy(_discover())


@functools.lru_cache(maxsize=1)
def _discover() -> list[dict[str, Any]]:
    _, causal = config_mapping()
    out = []
    for mt in sorted(causal):
        info = describe(mt)
        if info is not None:
            runs = decoder_type(mt)
            if runs != mt:
                info["runs_as"] = runs
            out.append(info)
    return out


# --------------------------------------------------------------------------------------------
# the tiny config


def _choose_layers(d: dict[str, Any], periods: int = 0) -> list[int]:
    """Indices of the default layers to keep: the shortest prefix showing every layer kind, or one
    layer of each kind (in order) when that prefix is longer than MAX_LAYERS."""
    n = d.get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        return []
    pats = [d[k] for k in PATTERN_LISTS if isinstance(d.get(k), list) and len(d[k]) == n]
    if not pats:
        return list(range(min(n, 4)))
    rows = list(zip(*[[json.dumps(x) for x in p] for p in pats]))
    seen, k = set(), 0
    for i, r in enumerate(rows):
        if r not in seen:
            seen.add(r)
            k = i + 1
    per = rules.period(rows)
    if periods and k <= per * periods <= 2 * MAX_LAYERS and per * periods <= n and len(set(rows)) > 1:
        return list(range(per * periods))  # whole periods: every kind, and pairs the config folds stay whole
    if periods > 1 and per == n:  # no period: the shortest prefix with every kind ``periods`` times
        count: dict = {}
        for i, r in enumerate(rows[:2 * MAX_LAYERS]):
            count[r] = count.get(r, 0) + 1
            if len(count) == len(set(rows)) and min(count.values()) >= periods:
                return list(range(i + 1))
    if k <= MAX_LAYERS:
        return list(range(max(k, min(n, 2))))
    first = {}
    for i, r in enumerate(rows):
        first.setdefault(r, i)
    return sorted(first.values())[:MAX_LAYERS * 2]


def decoder_type(mt: str) -> str:
    """The model type that is run for ``mt``: its text decoder's type for a composite (e.g.
    vision-language) config, else ``mt`` itself."""
    mapping, _ = config_mapping()
    mt = ALIASES.get(mt, mt)
    if mt not in mapping:
        return mt
    try:
        cfg = mapping[mt]()
        text = cfg.get_text_config(decoder=True)
    except Exception:  # noqa: BLE001 - reported when the config is built
        return mt
    sub = getattr(text, "model_type", mt)
    return sub if text is not cfg and sub in mapping else mt


def derive_config(mt: str, periods: int = 0) -> dict[str, Any]:
    """Tiny overrides for ``mt``: every dimension small, every granularity small and consistent;
    ``periods`` > 0 keeps that many whole periods of the layer pattern (for configs that fold pairs of
    pattern entries into one layer, or tie one kind's weights across its layers), tried when the
    shortest prefix does not build."""
    mapping, _ = config_mapping()
    mt = decoder_type(mt)
    if mt not in mapping:
        raise AdapterError(f"unknown model_type {mt!r} for this transformers; see --list-models")
    try:
        full = mapping[mt]()
        text = full.get_text_config(decoder=True)
        d = text.to_dict()
    except Exception as exc:  # noqa: BLE001
        raise AdapterError(f"cannot build a default {mt} config: {type(exc).__name__}: {one_line(exc)}") from None
    keep = _choose_layers(d, periods)
    n_old = d.get("num_hidden_layers")
    p: dict[str, Any] = {}
    if keep:
        p["num_hidden_layers"] = len(keep)
        pos = {old: new for new, old in enumerate(keep)}
        for k, v in d.items():
            if isinstance(v, list) and len(v) == n_old and k not in ("time_step_limit",):
                p[k] = [v[i] for i in keep]
            elif isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v) \
                    and k.endswith(("_layers", "_idxs", "_ids", "_indices")) and max(v) < n_old:
                # layer index lists: keep those that survive; one that loses all keeps its last layer
                p[k] = [pos[i] for i in v if i in pos] or [len(keep) - 1]
    p.update(_shrink(d))
    if keep:
        p.update(rules.scale_layer_counts(d, n_old, len(keep), fixed=p))
        p.update(rules.attention_kept(d, p, len(keep)))
    p.update(rules.relations(d, p))
    p.update(rules.cpu_paths(d))
    if keep:
        p.update(rules.per_layer_tables(d, keep, _shrink, p))
    lt = p.get("layer_types")
    if isinstance(lt, list) and set(lt) == {"full_attention"} and any(k in d for k in WINDOW_FIELDS):
        # the config can slide but its default does not: make it a sliding/full hybrid
        p["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(lt))]
    kv = d.get("num_key_value_heads")
    if isinstance(kv, int):
        heads = d.get("num_attention_heads")
        p["num_key_value_heads"] = 4 if kv == heads else (1 if kv == 1 else 2)
    if isinstance(d.get("compress_rates"), dict):
        rates = {}
        for i, k in enumerate(d["compress_rates"]):
            rates[k] = COMPRESS_RATES[min(i, len(COMPRESS_RATES) - 1)]
        p["compress_rates"] = rates
    if "use_sliding_window" in d:
        p["use_sliding_window"] = True
    if isinstance(d.get("max_position_embeddings"), int):
        p["max_position_embeddings"] = max(512, min(d["max_position_embeddings"], 131072))
    if "mamba_d_ssm" in d and d.get("mamba_d_ssm") is not None:
        p["mamba_d_ssm"] = p.get("mamba_expand", 2) * p.get("hidden_size", 64)
    return p



COUNTS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "n_shared_experts", "n_group", "topk_group",
          "first_k_dense_replace", "num_mem_blocks", "altup_num_inputs")
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _shrink(d: dict[str, Any]) -> dict[str, Any]:
    """Small dimensions and granularities for the fields of one (sub-)config dict."""
    p: dict[str, Any] = {}
    vocab = SIZES["vocab_size"]
    for k, v in d.items():
        if k in SIZES and (v is not None or SIZES[k] is None) and not isinstance(v, (list, dict)):
            p[k] = SIZES[k] if v is not None else None
            if k in COUNTS and isinstance(v, int) and 0 <= v < (SIZES[k] or 0):
                p[k] = v
        elif k in GRANULARITY and isinstance(v, int) and not isinstance(v, bool) and v > 0:
            p[k] = min(v, GRANULARITY[k]) if k == "conv_L_cache" else GRANULARITY[k]
        elif k == "sliding_window" and v in (None, 0):
            p[k] = GRANULARITY[k]
        elif isinstance(v, int) and not isinstance(v, bool) and re.search(r"layer_period$", k) and v > 2:
            p[k] = 2
        elif isinstance(v, int) and not isinstance(v, bool) and re.search(r"layer_offset$", k) and v > 1:
            p[k] = 1
        elif isinstance(v, int) and not isinstance(v, bool) and any(rx.search(k) for rx, _ in SIZE_PATTERNS):
            small = next(s for rx, s in SIZE_PATTERNS if rx.search(k))
            if v > SIZE_CAPS.get(small, 64):
                p[k] = small
        elif k in TOKEN_IDS:
            if isinstance(v, int) and v >= vocab:
                p[k] = TOKEN_IDS.index(k)
            elif isinstance(v, list):
                p[k] = [x if isinstance(x, int) and x < vocab else TOKEN_IDS.index(k) for x in v]
        elif isinstance(v, dict) and ("hidden_size" in v or "vocab_size" in v):
            sub = dict(v)
            sub.update(_shrink(v))
            if isinstance(sub.get("num_hidden_layers"), int):
                sub["num_hidden_layers"] = min(sub["num_hidden_layers"], 2)
            p[k] = sub
    hidden = p.get("hidden_size", d.get("hidden_size"))
    expand = p.get("mamba_expand", p.get("expand", d.get("mamba_expand", d.get("expand"))))
    if isinstance(hidden, int) and isinstance(expand, int) and "num_attention_heads" not in d:
        for hf, df in (("num_heads", "head_dim"),):
            if isinstance(d.get(hf), int) and isinstance(d.get(df), int):
                p[hf] = 4
                p[df] = expand * hidden // 4
    if isinstance(hidden, int) and isinstance(expand, int):
        for hf, df in MAMBA_HEADS:
            if hf in d and df in d and d[hf] is not None:
                p[hf] = 4
                p[df] = expand * hidden // 4
    return p


MAMBA_HEADS = (("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim"),
               ("n_mamba_heads", "mamba_headdim"))


def boundaries_of(cfg) -> dict[str, int]:
    """The granularities a built config declares (name -> tokens), read from the config itself."""
    found: dict[str, int] = {}
    d = cfg.to_dict()
    for k, v in d.items():
        if k in GRANULARITY and isinstance(v, int) and not isinstance(v, bool) and v > 1:
            if k in ("index_topk_blocks", "index_local_blocks"):
                continue  # counts of selected blocks, not token boundaries (index_topk is: past it
                # the indexer starts to drop keys)
            if k in WINDOW_FIELDS and d.get("use_sliding_window") is False:
                continue
            found[k] = v
    if isinstance(d.get("compress_rates"), dict):
        for k, v in d["compress_rates"].items():
            if isinstance(v, int) and v > 0 and k in (d.get("layer_types") or [k]):
                found[f"compress_rates[{k}]"] = v
    return found


def finite(x: float) -> float:
    return x if math.isfinite(x) else 1e300


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)
