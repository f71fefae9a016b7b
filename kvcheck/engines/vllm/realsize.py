"""Layouts at real model sizes, derived by vLLM's own rules from the model's own config.

The config is the model type's default config in transformers (it mirrors a released
checkpoint; where it does not, the override below says which checkpoint's numbers it takes),
written with its real architecture into a local directory: nothing is downloaded. The rules are
the installed release's own code, run as ``EngineCore`` runs them on CUDA:

- ``ModelConfig`` reads the directory (the architecture's hybrid and MLA flags, its model class);
- ``Platform._preferred_block_size_for_backends``: the block the CUDA backend prefers
  (FlashAttention 16, FlashMLA 64);
- ``Platform._align_hybrid_block_size`` with the FlashAttention backend class: the attention
  block that makes one attention page hold a Mamba state (Mamba align mode: it is the Mamba
  block too), the Mamba page padded to it;
- the Mamba state's shapes and dtypes from the model class's own
  ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``;
- ``VllmConfig`` decides whether the hybrid manager runs (off for chunked-local attention under
  ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0``, the default before 0.33: "-unified",
  one group); the platform's
  ``support_hybrid_kv_cache()`` answers as CUDA's does (True) while it decides;
- ``kv_cache_planning.get_kv_cache_groups`` groups the layers (page sizes unified, groups of
  equal layer count, vLLM's group order: the first layer's type first);
- ``resolve_kv_cache_block_sizes``: the scheduler and hash block.

What kvcheck writes itself is the per-layer attention spec (kind, KV heads, head size, window
or chunk, bf16; an MLA latent) read off the config's layer types, as each model's attention
layer builds it, and a draft layer of the target's shape for a drafter variant.
Derivation costs 15-30 s per model (``ModelConfig`` inspects the model class), so the results
are kept in ``realsize.json``; ``python -m kvcheck.engines.vllm.realsize`` re-derives them on
the installed release and says what changed (tests/adapters/test_vllm_realsize.py does it too).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

TABLE = Path(__file__).with_name("realsize.json")
_ALLOW_CHUNKED = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"
# Nemotron-H: transformers' default config is a 4-layer toy; Nemotron-H-8B's published config
# has 52 layers: 24 Mamba-2, 4 attention, 24 MLP (the MLP layers cache nothing).
_NEMOTRON_8B = (["linear_attention", "mlp"] * 3 + ["linear_attention", "full_attention", "mlp"]) * 4 \
    + ["linear_attention", "mlp"] * 8

# name -> (transformers config class, architecture, overrides, env, drafter variant: "+eagle", "+mtp")
MODELS: dict[str, tuple[str, str, dict, dict, bool]] = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}, {}, "+eagle"),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", {}, {}, "+eagle"),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {}, {}, None),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", {}, {}, None),
    "llama4-unified": ("Llama4TextConfig", "Llama4ForCausalLM", {}, {_ALLOW_CHUNKED: "0"}, None),
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {}, {}, None),
    "jamba": ("JambaConfig", "JambaForCausalLM", {}, {}, None),
    "nemotron-h": ("NemotronHConfig", "NemotronHForCausalLM",
                   {"layers_block_type": _NEMOTRON_8B, "num_hidden_layers": len(_NEMOTRON_8B)}, {}, None),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {}, {}, "+mtp"),
}
# (Mamba hybrids' MTP variants are not derived: the drafter's tokens enlarge the Mamba state (the
# model class reads speculative_config), which needs the draft model's own config here.)


def names() -> list[str]:
    """Every derived layout: each model, and its drafter variant where it has one."""
    return [n for m, v in MODELS.items() for n in ([m, m + v[4]] if v[4] else [m])]
_KIND = {"full_attention": "full", "sliding_attention": "swa", "chunked_attention": "chunked_local",
         "linear_attention": "mamba", "mamba": "mamba", "attention": "full"}


def layer_kinds(cfg: Any) -> list[str]:
    """Each layer's cache kind (full, swa, chunked_local, mamba, or '' for none) from the config."""
    types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None)
    if types is None and hasattr(cfg, "attn_layer_period"):          # Jamba
        types = ["attention" if i % cfg.attn_layer_period == cfg.attn_layer_offset else "mamba"
                 for i in range(cfg.num_hidden_layers)]
    if types is None:
        types = ["full_attention"] * cfg.num_hidden_layers
    return [_KIND.get(t, "") for t in types]


def _config(model: str) -> Any:
    import transformers
    cls_name, arch, over, _, _ = MODELS[model]
    return getattr(transformers, cls_name)(architectures=[arch], **over)


def _specs(cfg: Any, cc: Any, vc: Any, model_cls: Any, drafter: bool, mla: bool) -> dict[str, Any]:
    import torch
    from vllm.v1 import kv_cache_interface as K
    heads = cfg.num_key_value_heads
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    common = dict(block_size=cc.block_size, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16)
    if mla:           # MLA caches one latent per token: kv_lora_rank + the rope part, one "head"
        mla_spec = K.MLAAttentionSpec(block_size=cc.block_size, num_kv_heads=1, dtype=torch.bfloat16,
                                      head_size=cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        n = cfg.num_hidden_layers + drafter
        return {f"model.layers.{i}.attn" if i < cfg.num_hidden_layers else "drafter.layers.0.attn": mla_spec
                for i in range(n)}
    out: dict[str, Any] = {}
    for i, kind in enumerate(layer_kinds(cfg)):
        name = f"model.layers.{i}.attn"
        if kind == "full":
            out[name] = K.FullAttentionSpec(**common)
        elif kind == "swa":
            out[name] = K.SlidingWindowSpec(**common, sliding_window=cfg.sliding_window)
        elif kind == "chunked_local":
            out[name] = K.ChunkedLocalAttentionSpec(**common, attention_chunk_size=cfg.attention_chunk_size)
        elif kind == "mamba":
            out[name] = K.MambaSpec(block_size=cc.mamba_block_size or cc.block_size,
                                    shapes=model_cls.get_mamba_state_shape_from_config(vc),
                                    dtypes=model_cls.get_mamba_state_dtype_from_config(vc),
                                    page_size_padded=cc.mamba_page_size_padded, mamba_cache_mode="align")
    if drafter:                # EAGLE-3: one full-attention draft layer of the target's shape
        out["drafter.layers.0.attn"] = K.FullAttentionSpec(**common)
    return out


def derive(name: str) -> dict:
    """The layout vLLM builds for `name` (a model, or model+eagle) on the installed release.
    Not in a process whose vLLM platform is the CPU one (kvcheck's drives set it): its config
    updates change the dtypes (a float32 Mamba state doubles Qwen3-Next's block to 1056);
    `derive_clean` runs this in a fresh process, where no platform's updates apply."""
    if name not in names():
        raise ValueError(f"realsize: unknown model {name!r}; known: {', '.join(names())}")
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        raise ValueError("realsize: this process runs vLLM's CPU platform, whose config updates change the "
                         "dtypes: derive with derive_clean (python -m kvcheck.engines.vllm.realsize)")
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.core import kv_cache_utils as ku
    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    except ImportError:                   # (before 0.30 the planner lived in kv_cache_utils)
        get_kv_cache_groups = ku.get_kv_cache_groups
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from .runtime import vllm_version
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = name.split("+")[0]
    drafter = model != name
    env = MODELS[model][3]
    cfg = _config(model)
    with tempfile.TemporaryDirectory(prefix="kvcheck-real-") as d, mock.patch.dict(os.environ, env), \
            mock.patch.object(type(current_platform), "support_hybrid_kv_cache", classmethod(lambda c: True)), \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        cfg.save_pretrained(d)
        mc = ModelConfig(model=d, skip_tokenizer_init=True, dtype="bfloat16")
        cc = CacheConfig(block_size=16, enable_prefix_caching=True,
                         **({"mamba_cache_mode": "align"} if mc.is_hybrid else {}))
        vc = VllmConfig(model_config=mc, cache_config=cc, device_config=DeviceConfig(device="cpu"))
        if hasattr(cc, "kv_cache_layout"):
            cc.kv_cache_layout = cc.kv_cache_layout or "NHD"     # (EngineCore resolves it; any will do)
        model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
        backend = FlashMLABackend if mc.use_mla else FlashAttentionBackend
        pick = getattr(Platform, "_preferred_block_size_for_backends", None)
        if pick is not None:             # the backend's preferred block (FlashMLA: 64)
            cc.block_size = pick([backend], cc.block_size, vc)
        elif mc.use_mla:
            raise ValueError(f"realsize: vLLM {vllm_version()} picks the MLA block elsewhere: derive on 0.33")
        if mc.is_hybrid:
            align = getattr(Platform, "_align_hybrid_block_size", None)
            if align is None:
                raise ValueError(f"realsize: vLLM {vllm_version()} aligns hybrid block sizes elsewhere "
                                 "(no Platform._align_hybrid_block_size): derive on 0.33")
            align(vc, backend)
        specs = _specs(cfg, cc, vc, model_cls, drafter, mc.use_mla)
        hma = not vc.scheduler_config.disable_hybrid_kv_cache_manager
        groups = get_kv_cache_groups(vc, dict(specs))
        kcfg = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=groups)
        resolve = getattr(ku, "resolve_kv_cache_block_sizes", None)
        sched, hashb = resolve(kcfg, vc) if resolve else (cc.block_size, cc.block_size)
    out = [_group(g.kv_cache_spec) for g in groups]
    eagle = [i for i, g in enumerate(groups) if any(n.startswith("drafter.") for n in g.layer_names)]
    units = [p or bs for _, bs, p in out] + [sched]
    return {"model": name, "config": MODELS[model][0], "hybrid_manager": hma, "env": env,
            "layers": len(specs) - drafter, "groups": out, "eagle_groups": eagle if drafter else None,
            "scheduler_block": sched, "hash_block": hashb,
            "max_model_len": min(1 << 15, max(4096, 3 * max(units)))}


def _group(spec: Any) -> list:
    from vllm.v1 import kv_cache_interface as K
    if isinstance(spec, K.MambaSpec):
        return ["mamba", spec.block_size, None]
    if isinstance(spec, K.SlidingWindowSpec):
        return ["swa", spec.block_size, spec.sliding_window]
    if isinstance(spec, K.ChunkedLocalAttentionSpec):
        return ["chunked_local", spec.block_size, spec.attention_chunk_size]
    if isinstance(spec, K.MLAAttentionSpec):
        return ["mla", spec.block_size, None]
    if isinstance(spec, K.FullAttentionSpec):
        return ["full", spec.block_size, None]
    raise ValueError(f"realsize: no kvcheck group kind for vLLM's {type(spec).__name__}")


def derive_clean(names: list[str]) -> list[dict]:
    """`derive` each name in a fresh Python process without VLLM_TARGET_DEVICE (vLLM's platform
    left unresolved, as no CUDA machine's dtype choices are changed by it)."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    code = ("import json, sys\nfrom kvcheck.engines.vllm.realsize import derive\n"
            "print(json.dumps([derive(n) for n in sys.argv[1:]]))")
    p = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise ValueError(f"realsize: deriving {', '.join(names)} failed: "
                         f"{(p.stderr.strip().splitlines() or ['(no output)'])[-1]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def table() -> dict[str, dict]:
    """The derived layouts kept in realsize.json (model -> derivation, plus the release)."""
    return json.loads(TABLE.read_text())


def main(argv: list[str] | None = None) -> int:
    """Re-derive every model on the installed release; --write keeps the result."""
    import argparse

    import vllm
    p = argparse.ArgumentParser(prog="python -m kvcheck.engines.vllm.realsize", description=main.__doc__)
    p.add_argument("--write", action="store_true", help=f"write {TABLE.name}")
    p.add_argument("models", nargs="*", default=names(), help="models (default: all)")
    a = p.parse_args(argv)
    kept = table() if TABLE.exists() else {"vllm": vllm.__version__, "models": {}}
    changed = 0
    unknown = [m for m in a.models if m not in names()]
    if unknown:
        p.error(f"unknown model {unknown[0]!r}; known: {', '.join(names())}")
    for m, got in zip(a.models, derive_clean(a.models)):
        if kept["models"].get(m) != got:
            changed += 1
            print(json.dumps({"model": m, "kept": kept["models"].get(m), "derived": got}))
        kept["models"][m] = got
    kept["vllm"] = vllm.__version__
    if a.write:
        TABLE.write_text(json.dumps(kept, indent=1) + "\n")
    print(f"{changed} of {len(a.models)} derivations differ from {TABLE.name}")
    return 1 if changed and not a.write else 0


if __name__ == "__main__":
    raise SystemExit(main())
