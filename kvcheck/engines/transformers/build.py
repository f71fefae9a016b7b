"""Build a seeded random-weight causal LM from a model type's derived tiny config.

Owns the user's config-file overrides, the dtype names, and the fall-back variants tried when a
model has stricter shape rules; a model none of them builds is reported, never raised raw.
"""

from __future__ import annotations

import json
from typing import Any

from . import models
from . import patterns
from .interface import prefill
from . import ratios, rules
from .models import (ALIASES, MAX_PARAMS, AdapterError, config_mapping, decoder_type, derive_config,
                     import_transformers, one_line)



def load_overrides(config_json: str | None) -> dict[str, Any]:
    if config_json is None:
        return {}
    try:
        with open(config_json, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise AdapterError(f"cannot read config file {config_json!r}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise AdapterError(f"config file {config_json!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise AdapterError(f"config file {config_json!r} must hold a JSON object, got {type(data).__name__}")
    return data


def torch_dtype(name: str):
    import torch

    table = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16}
    if name not in table:
        raise AdapterError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16, float64")
    return table[name]


def derive_fills(mt: str) -> dict[str, Any]:
    """Values for the size/granularity fields ``mt``'s default leaves None, and default RoPE per kind
    where its table is empty: tried when the derived config alone does not build."""
    mapping, _ = config_mapping()
    mt = decoder_type(mt)
    d = mapping[mt]().get_text_config(decoder=True).to_dict()
    p = derive_config(mt)
    fills = {**rules.none_fills(d, models.SIZES, models.GRANULARITY, models.SIZE_PATTERNS), **rules.rope_per_kind(d, p)}
    n = p.get("num_hidden_layers")
    if "layer_types" in d and d["layer_types"] is None and isinstance(n, int):
        # the class leaves the pattern to checkpoints: the kinds its code handles, then full attention
        kinds = [k for k in models.layer_kinds_in_source(mt) if k != "full_attention"] + ["full_attention"]
        fills["layer_types"] = [kinds[i % len(kinds)] for i in range(n)]
    return fills


def _variants(params: dict[str, Any], fills: dict[str, Any]):
    """The derived config, then with the fields its default leaves None filled in, then fall-backs
    for models with stricter shape rules."""
    yield params
    bases = [params] + ([{**params, **fills}] if fills else [])
    if fills:
        yield bases[1]
    for base in bases:
        yield {**base, "num_key_value_heads": base.get("num_attention_heads", 4)}
        yield {k: v for k, v in base.items() if k != "head_dim"}
        yield {**base, "hidden_size": 128, "intermediate_size": 128}


def keep_fp32(model, tdtype):
    """Cast back to float32 what the model's own dtype plan keeps there (``_keep_in_fp32_modules*``:
    routers, score biases), as loading it in ``tdtype`` through transformers would."""
    import re

    import torch

    plan = model._get_dtype_plan(tdtype) if hasattr(model, "_get_dtype_plan") else {}
    if plan:
        rx = re.compile("|".join(f"(?:{k})" for k in plan))
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if rx.search(name) and t.is_floating_point():
                t.data = t.data.to(torch.float32)
    return model


def build_model(model_type: str, config_json: str | None = None, dtype: str = "float32", seed: int = 0,
                pattern: list[str] | None = None, sizes: str = "fixed"):
    """``(model, config, model_type, params)``: a seeded random-weight causal LM in eval mode whose
    4-token forward with cache runs; :class:`AdapterError` (one line) when no variant builds.
    ``pattern``: the layer kinds to have instead of the derived ones, set through the class's own
    fields on every variant and checked on the built model's cache layers (patterns.py).
    ``sizes="ratios"``: the granularities are the default's own, scaled together (ratios.py)."""
    transformers = import_transformers()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    mapping, _ = config_mapping()
    mt = ALIASES.get(model_type, model_type)
    overrides = load_overrides(config_json)
    file_mt = overrides.pop("model_type", None)
    if file_mt is not None and ALIASES.get(file_mt, file_mt) != mt:
        raise AdapterError(f"config file model_type {file_mt!r} does not match --model-type {model_type!r}")
    if mt not in mapping:
        raise AdapterError(f"unknown model_type {model_type!r} for transformers {transformers.__version__}; "
                           "see `kvcheck diff --sut transformers --list-models`")
    mt = decoder_type(mt)
    attn = overrides.pop("attn_implementation", overrides.pop("_attn_implementation", "eager"))
    for k in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        overrides.pop(k, None)
    tdtype = torch_dtype(dtype)
    bases = [derive_config(mt)]
    for periods in (1, 2):
        alt = derive_config(mt, periods=periods)
        if alt not in bases:
            bases.append(alt)
    if sizes == "ratios":
        report = ratios.report_for(mt, bases[0])
        bases = [ratios.apply(b, report) for b in bases]
    fills = derive_fills(mt)
    first, unexpressed = None, False
    for params in (v for base in bases for v in _variants(base, fills)):
        params = {**params, **overrides}
        try:
            if pattern is not None:
                params = patterns.express(mt, params, pattern)
            config = AutoConfig.for_model(mt, **params)
            with torch.device("meta"):
                size = sum(x.numel() for x in AutoModelForCausalLM.from_config(config).parameters())
            if size > MAX_PARAMS:
                raise AdapterError(f"the derived config still has {size:,} parameters (> {MAX_PARAMS:,})")
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
            model = keep_fp32(model.to(tdtype), tdtype).eval()
            with torch.no_grad():
                out, cache = prefill(model, torch.zeros((1, 4), dtype=torch.long))
            if getattr(out, "logits", None) is None:
                raise AdapterError("the model returns no logits")
            if cache is None:
                raise AdapterError(f"{type(model).__name__} returns no cache object with use_cache=True (it keeps "
                                   "its state inside its modules, and its generate() starts with none): reuse cannot be driven "
                                   "through a cache")
            why = patterns.check_built(pattern, cache) if pattern is not None else None
            if why:
                raise patterns.Unexpressible(why)
            return model, model.config, mt, params
        except Exception as exc:  # noqa: BLE001 - any failure to build is reported, never raised
            if first is None:
                unexpressed = isinstance(exc, patterns.Unexpressible)
                first = one_line(exc) if unexpressed else f"{type(exc).__name__}: {one_line(exc)}"
            if overrides and config_json:
                break
    if unexpressed:                     # the pattern, not the model, is what cannot be built
        raise patterns.Unexpressible(first)
    raise AdapterError(f"cannot build a tiny {mt} causal LM from its derived config ({first})")
