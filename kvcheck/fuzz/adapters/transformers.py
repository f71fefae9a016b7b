"""Differential reuse-vs-recompute oracle for Hugging Face ``transformers`` causal LMs.

For a tiny random-weight model built from a transformers config, every scenario

1. prefills a prefix into the model's own cache object and snapshots it (deep copy) at the
   prefix boundary,
2. restores the snapshot (optionally through a fault wrapper that corrupts it) and continues
   with a suffix (one chunk, token by token, or several chunks), then greedy-generates a few
   tokens from the reused cache,
3. compares the logits with one full forward without cache (and greedy generation without
   cache), against a tolerance calibrated from the run's own float noise,
4. when divergent, localizes the first decoder layer whose output differs (forward hooks) and
   the cache objects of that layer (SWA window, keys/values, compressed entries, tail,
   indexer keys, recurrent/conv state) that explain it.

``transformers`` is imported lazily: importing this module works without it.
Entry point: :func:`run_diff`.
"""

from __future__ import annotations

import copy
import json
import math
import random
from typing import Any

__all__ = ["AdapterError", "run_diff", "SUPPORTED_MODEL_TYPES", "FAULTS", "default_config"]

INSTALL_HINT = "pip install -r requirements-transformers.txt"


class AdapterError(Exception):
    """Usage error of the transformers adapter (unknown model type, bad config, missing package).

    The message is one line; the CLI maps this exception to exit code 2.
    """


# Small defaults per model type: a few layers of width 64, vocab 128, windows/compression
# granularities small enough that short sequences cross their boundaries.
_COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, max_position_embeddings=512)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": dict(_COMMON, intermediate_size=128, num_hidden_layers=4, num_key_value_heads=2,
                    head_dim=16, sliding_window=8),
    "gemma3_text": dict(_COMMON, intermediate_size=128, num_hidden_layers=6, num_key_value_heads=2,
                        head_dim=16, query_pre_attn_scalar=16, sliding_window=8),
    "gpt_oss": dict(_COMMON, intermediate_size=64, num_hidden_layers=4, num_key_value_heads=2,
                    head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    max_position_embeddings=131072),  # = YaRN factor 32 x original 4096 (no warning)
    "deepseek_v3": dict(_COMMON, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
                        q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                        n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1),
    "qwen3_next": dict(_COMMON, intermediate_size=128, num_hidden_layers=4, num_key_value_heads=2,
                       head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2),
    # Extra (not in the required set): DeepSeek-V4 hybrid with SWA + CSA (indexer) + HCA layers.
    "deepseek_v4": dict(_COMMON, moe_intermediate_size=32, num_hidden_layers=4, num_key_value_heads=1,
                        head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8,
                        n_shared_experts=1, sliding_window=8, o_groups=2, o_lora_rank=16,
                        index_n_heads=2, index_head_dim=16, index_topk=2, hc_mult=2,
                        layer_types=["sliding_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention", "compressed_sparse_attention"],
                        compress_rates={"compressed_sparse_attention": 4,
                                        "heavily_compressed_attention": 8}),
}
# Generic tiny defaults for model types without an entry above (tried, not guaranteed).
_GENERIC = dict(_COMMON, intermediate_size=128, num_hidden_layers=4, num_key_value_heads=2, head_dim=16)
_ALIASES = {"gemma3": "gemma3_text", "gpt-oss": "gpt_oss", "qwen3-next": "qwen3_next"}

SUPPORTED_MODEL_TYPES = tuple(_DEFAULTS)  # tested: all of these
FAULTS = ("drop_window_position", "perturb_key")
SUFFIX_MODES = ("one_chunk", "token_by_token", "chunks")
VERDICT_ORDER = ("exact", "within-tolerance", "divergent")

# Safety factor over the observed float noise, and the floor in units of the dtype's epsilon
# (relative to the magnitude of the compared tensor).
NOISE_FACTOR = 8.0
EPS_FLOOR = 16.0
GEN_TOKENS = 3
LINEAR_CHUNK = 64


def default_config(model_type: str) -> dict[str, Any]:
    """The default tiny config (a copy) for ``model_type`` (aliases accepted)."""
    mt = _ALIASES.get(model_type, model_type)
    return copy.deepcopy(_DEFAULTS.get(mt, _GENERIC))


# --------------------------------------------------------------------------------------------
# building


def _import():
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise AdapterError(f"transformers is not installed ({exc}); install it with: {INSTALL_HINT}") from None
    return transformers


def _load_overrides(config_json: str | None) -> dict[str, Any]:
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


def _dtype(name: str):
    import torch

    table = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16}
    if name not in table:
        raise AdapterError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16, float64")
    return table[name]


def build_model(model_type: str, config_json: str | None = None, dtype: str = "float32", seed: int = 0):
    """Build ``(model, config, resolved_model_type)``: a seeded random-weight causal LM in eval mode."""
    transformers = _import()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    mt = _ALIASES.get(model_type, model_type)
    overrides = _load_overrides(config_json)
    file_mt = overrides.pop("model_type", None)
    if file_mt is not None and _ALIASES.get(file_mt, file_mt) != mt:
        raise AdapterError(f"config file model_type {file_mt!r} does not match --model-type {model_type!r}")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if mt not in CONFIG_MAPPING:
        raise AdapterError(f"unknown model_type {model_type!r} for transformers {transformers.__version__}; "
                           f"tested: {', '.join(SUPPORTED_MODEL_TYPES)}")
    attn = overrides.pop("attn_implementation", overrides.pop("_attn_implementation", "eager"))
    for k in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        overrides.pop(k, None)
    params = default_config(mt)
    params.update(overrides)
    tdtype = _dtype(dtype)
    try:
        config = AutoConfig.for_model(mt, **params)
    except Exception as exc:  # noqa: BLE001 - any config error is a usage error here
        raise AdapterError(f"cannot build a {mt} config: {type(exc).__name__}: {_one_line(exc)}") from None
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    except ValueError as exc:
        raise AdapterError(f"{mt} has no causal-LM model in transformers {transformers.__version__} "
                           f"or the config is unusable: {_one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001
        raise AdapterError(f"cannot build {mt} from its config: {type(exc).__name__}: {_one_line(exc)}") from None
    model = model.to(tdtype).eval()
    return model, model.config, mt


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300]


def _decoder_layers(model):
    """The decoder-layer ModuleList (the longest ``*.layers`` list matching num_hidden_layers)."""
    import torch

    n = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.split(".")[-1] == "layers":
            if n is None or len(mod) == n:
                if best is None or len(mod) > len(best):
                    best = mod
    if best is None:
        raise AdapterError(f"cannot find the decoder layers of {type(model).__name__}")
    return list(best)


# --------------------------------------------------------------------------------------------
# cache introspection (generic over transformers' per-layer cache classes)

_COUNTERS = ("cumulative_length", "entry_count")


def _kind(layer, attr: str, key: Any) -> str:
    """Map a cache attribute onto kvcheck's cache-object vocabulary."""
    if attr in ("keys", "values"):
        return "swa_window" if getattr(layer, "is_sliding", False) else "kv"
    if attr == "compressed_kv":
        return "indexer_keys" if key == "indexer" else "compressed_entries"
    if attr in ("buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate"):
        return "indexer_tail" if key == "indexer" else "uncompressed_tail"
    if attr.startswith("indexer"):
        return "indexer_keys"
    if attr == "conv_states":
        return "conv_state"
    if attr == "recurrent_states":
        return "recurrent_state"
    if attr in _COUNTERS:
        return "counter"
    return "other"


def _objects(layer) -> dict[str, tuple[str, Any]]:
    """``name -> (kind, tensor|int)`` for every cached state object of one cache layer."""
    import torch

    out: dict[str, tuple[str, Any]] = {}
    for attr, val in vars(layer).items():
        if attr.startswith("_"):
            continue
        if torch.is_tensor(val) and val.dim() > 0:
            out[attr] = (_kind(layer, attr, None), val)
        elif isinstance(val, dict):
            for k, v in val.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    out[f"{attr}[{k}]"] = (_kind(layer, attr, k), v)
                elif attr in _COUNTERS and isinstance(v, int):
                    out[f"{attr}[{k}]"] = ("counter", v)
        elif attr in _COUNTERS and isinstance(val, int) and not isinstance(val, bool):
            out[attr] = ("counter", val)
    return out


def _cache_layers(cache) -> list:
    return list(getattr(cache, "layers", []))


def _diff_tensors(a, b) -> tuple[float, float, bool]:
    """(max |a-b|, max |b|, shape_mismatch) aligning on the trailing part of one differing dim."""
    a = a.detach().double()
    b = b.detach().double()
    mismatch = tuple(a.shape) != tuple(b.shape)
    if mismatch:
        if a.dim() != b.dim():
            return math.inf, float(b.abs().max()) if b.numel() else 0.0, True
        for d in range(a.dim()):
            n = min(a.shape[d], b.shape[d])
            a = a.narrow(d, a.shape[d] - n, n)
            b = b.narrow(d, b.shape[d] - n, n)
    if a.numel() == 0:
        return (math.inf if mismatch else 0.0), 0.0, mismatch
    return float((a - b).abs().max()), float(b.abs().max()), mismatch


def _compare_caches(got, ref) -> list[dict[str, Any]]:
    """Per layer and object: max abs diff of ``got`` against ``ref`` (both transformers caches)."""
    rows = []
    gl, rl = _cache_layers(got), _cache_layers(ref)
    for i in range(max(len(gl), len(rl))):
        go = _objects(gl[i]) if i < len(gl) else {}
        ro = _objects(rl[i]) if i < len(rl) else {}
        for name in sorted(set(go) | set(ro)):
            if name not in go or name not in ro:
                kind = (go.get(name) or ro.get(name))[0]
                rows.append(dict(layer=i, object=name, kind=kind, max_abs_diff=math.inf, scale=0.0,
                                 shape_mismatch=True, missing="reused" if name not in go else "recomputed"))
                continue
            kind, gv = go[name]
            _, rv = ro[name]
            if kind == "counter":
                d = float(abs(gv - rv))
                rows.append(dict(layer=i, object=name, kind=kind, max_abs_diff=d, scale=1.0, shape_mismatch=False))
                continue
            d, s, mm = _diff_tensors(gv, rv)
            rows.append(dict(layer=i, object=name, kind=kind, max_abs_diff=d, scale=s, shape_mismatch=mm))
    return rows


# --------------------------------------------------------------------------------------------
# faults (a wrapper applied when the snapshot is restored)


class CacheFault:
    """Corrupts a restored cache snapshot: the planted bug of a reuse path.

    ``drop_window_position``: one position inside a sliding-window layer's cached window is
    dropped; the older positions shift up by one and the oldest slot repeats, so the tensor keeps
    the shape the attention mask expects (what a lost/misplaced window page looks like).
    ``perturb_key``: one cached key (one position, all heads) of one layer is perturbed.
    """

    def __init__(self, name: str, layer: int, rng: random.Random):
        self.name, self.layer, self.rng = name, layer, rng

    @staticmethod
    def eligible(name: str, cache) -> list[int]:
        out = []
        for i, layer in enumerate(_cache_layers(cache)):
            keys = getattr(layer, "keys", None)
            if keys is None or not hasattr(keys, "shape") or keys.dim() < 2:
                continue
            if name == "drop_window_position" and not getattr(layer, "is_sliding", False):
                continue
            out.append(i)
        return out

    def apply(self, cache) -> dict[str, Any]:
        import torch

        layer = _cache_layers(cache)[self.layer]
        keys, values = layer.keys, layer.values
        n = keys.shape[-2]
        shared = values is keys
        if self.name == "drop_window_position":
            if n < 2:
                return dict(applied=False, reason=f"window holds {n} position(s)")
            j = self.rng.randrange(1, n)
            idx = torch.tensor([0] + list(range(j)) + list(range(j + 1, n)), device=keys.device)
            layer.keys = keys.index_select(-2, idx)
            layer.values = layer.keys if shared else values.index_select(-2, idx)
            first = getattr(layer, "cumulative_length", n) - n
            return dict(applied=True, position=int(first + j), slot=j)
        if self.name == "perturb_key":
            if n < 1:
                return dict(applied=False, reason="no cached key")
            j = self.rng.randrange(n)
            new = keys.clone()
            scale = float(keys.detach().float().abs().max()) or 1.0
            g = torch.Generator().manual_seed(self.rng.randrange(2**31))
            noise = torch.randn(new[..., j, :].shape, generator=g).to(new.dtype)
            new[..., j, :] = new[..., j, :] + 2.0 * scale * noise
            layer.keys = new
            if shared:
                layer.values = new
            first = getattr(layer, "cumulative_length", n) - n
            return dict(applied=True, position=int(first + j), slot=j)
        raise AdapterError(f"unknown fault {self.name!r}; known: {', '.join(FAULTS)}")


# --------------------------------------------------------------------------------------------
# the runner


class _Recorder:
    """Forward hooks on the decoder layers, recording each layer's output hidden states."""

    def __init__(self, layers):
        self.on = False
        self.calls: list[list] = [[] for _ in layers]
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(layers)]

    def _hook(self, i):
        def hook(_mod, _inp, out):
            if self.on:
                h = out[0] if isinstance(out, (tuple, list)) else out
                if hasattr(h, "last_hidden_state"):
                    h = h.last_hidden_state
                self.calls[i].append(h.detach())
        return hook

    def start(self):
        self.calls = [[] for _ in self.calls]
        self.on = True

    def stop(self):
        """Per layer: the recorded outputs concatenated along the sequence dim (dim 1)."""
        import torch

        self.on = False
        return [torch.cat(c, dim=1) if c else None for c in self.calls]

    def close(self):
        for h in self.handles:
            h.remove()


class _Runner:
    def __init__(self, model, config, model_type: str, dtype: str, seed: int):
        import torch

        self.torch = torch
        self.model, self.config, self.model_type = model, config, model_type
        self.dtype_name, self.seed = dtype, seed
        self.vocab = int(config.get_text_config(decoder=True).vocab_size)
        self.layers = _decoder_layers(model)
        self.rec = _Recorder(self.layers)
        self.eps = float(torch.finfo(next(model.parameters()).dtype).eps)

    # -- model calls ---------------------------------------------------------------------
    def full(self, ids, record=False):
        if record:
            self.rec.start()
        with self.torch.no_grad():
            out = self.model(input_ids=ids, use_cache=False)
        hs = self.rec.stop() if record else None
        return out.logits[0].double(), hs

    def prefill(self, ids):
        with self.torch.no_grad():
            out = self.model(input_ids=ids, use_cache=True)
        return out.logits[0].double(), out.cache

    def step(self, ids, cache):
        with self.torch.no_grad():
            out = self.model(input_ids=ids, cache=cache, use_cache=True)
        return out.logits[0].double(), out.cache

    def tokens(self, gen: torch.Generator, n: int, batch: int = 1):  # noqa: F821
        return self.torch.randint(0, self.vocab, (batch, n), generator=gen)

    # -- boundaries ----------------------------------------------------------------------
    def boundaries(self) -> dict[str, int]:
        """Granularities the cache works in: windows, compression rates, conv kernels."""
        cfg = self.config.get_text_config(decoder=True)
        found: dict[str, int] = {}
        sw = getattr(cfg, "sliding_window", None)
        if isinstance(sw, int) and sw > 0:
            found["window"] = sw
        cs = getattr(cfg, "attention_chunk_size", None)
        if isinstance(cs, int) and cs > 0:
            found["attention_chunk"] = cs
        rates = getattr(cfg, "compress_rates", None)
        if isinstance(rates, dict):
            for k, v in rates.items():
                if isinstance(v, int) and v > 0 and k in (getattr(cfg, "layer_types", None) or [k]):
                    found[f"compress[{k}]"] = v
        kd = getattr(cfg, "linear_conv_kernel_dim", None) or getattr(cfg, "conv_kernel", None)
        if isinstance(kd, int) and kd > 0:
            found["conv_kernel"] = kd
        # and whatever the live cache reports (covers models that only expose it there)
        _, cache = self.prefill(self.torch.zeros((1, 2), dtype=self.torch.long))
        for layer in _cache_layers(cache):
            w = getattr(layer, "sliding_window", None)
            if isinstance(w, int) and w > 0 and w not in found.values():
                found[f"window[{type(layer).__name__}]"] = w
            m = getattr(layer, "compress_rate", None)
            if isinstance(m, int) and m > 0 and m not in found.values():
                found[f"compress[{type(layer).__name__}]"] = m
            if hasattr(layer, "recurrent_states") and "linear_chunk" not in found:
                # the PyTorch fallback of the gated delta rule works in chunks of 64 tokens
                found["linear_chunk"] = LINEAR_CHUNK
            ck = getattr(layer, "conv_kernel_size", None)
            if isinstance(ck, dict):
                for v in ck.values():
                    if isinstance(v, int) and v > 0 and v not in found.values():
                        found["conv_kernel"] = v
        self.cache_layer_classes = [type(x).__name__ for x in _cache_layers(cache)]
        return found

    def prefix_candidates(self, bounds: dict[str, int], min_len: int) -> list[tuple[int, str]]:
        cand: dict[int, str] = {}

        def add(n: int, tag: str):
            if n >= min_len and n not in cand:
                cand[n] = tag

        for name, b in sorted(bounds.items(), key=lambda kv: kv[1]):
            add(b, f"on:{name}")
            add(b - 1, f"off:{name}-1")
            add(b + 1, f"off:{name}+1")
            add(2 * b, f"on:2*{name}")
            add(2 * b + 1, f"off:2*{name}+1")
        if len(bounds) > 1:
            lcm = 1
            for b in bounds.values():
                lcm = lcm * b // math.gcd(lcm, b)
            if lcm <= 64:
                add(lcm, "on:lcm(all)")
                add(lcm + 1, "off:lcm(all)+1")
        for n in (1, 2, 3, 5):
            add(n, "off:small")
        return sorted(cand.items())

    # -- calibration ---------------------------------------------------------------------
    def calibrate(self, length: int, gen) -> dict[str, Any]:
        """Float noise of the implementation when nothing but the GEMM shapes change.

        The same sequence is run alone and as row 1 of a batch of 3 with other random rows; the
        largest logit (and per-layer hidden-state, and per-cache-object) difference is the noise.
        Separately, a causality check appends 5 random tokens: earlier logits must not move
        beyond the tolerance (a recompute reference that depends on future tokens is reported).
        """
        torch = self.torch
        noise = 0.0
        scale = 0.0
        n_layers = len(self.layers)
        layer_noise = [0.0] * n_layers
        layer_scale = [0.0] * n_layers
        obj_noise: dict[tuple[int, str], float] = {}
        ext_runs = []
        for _ in range(2):
            ids = self.tokens(gen, length)
            self.rec.start()
            with torch.no_grad():
                out = self.model(input_ids=ids, use_cache=True)
            hs = self.rec.stop()
            ref = out.logits[0].double()
            ref_cache = out.cache
            scale = max(scale, float(ref.abs().max()))
            batch = self.tokens(gen, length, batch=3)
            batch[1] = ids[0]
            self.rec.start()
            with torch.no_grad():
                outb = self.model(input_ids=batch, use_cache=True)
            hsb = self.rec.stop()
            noise = max(noise, float((outb.logits[1].double() - ref).abs().max()))
            row_cache = _select_row(outb.cache, 1)
            if row_cache is not None:
                for r in _compare_caches(row_cache, ref_cache):
                    if math.isfinite(r["max_abs_diff"]):
                        key = (r["layer"], r["object"])
                        obj_noise[key] = max(obj_noise.get(key, 0.0), r["max_abs_diff"])
            for i, h in enumerate(hs):
                if h is None:
                    continue
                hd = h[0].double()
                layer_scale[i] = max(layer_scale[i], float(hd.abs().max()))
                if hsb[i] is not None:
                    layer_noise[i] = max(layer_noise[i], float((hsb[i][1].double() - hd).abs().max()))
            ext = torch.cat([ids, self.tokens(gen, 5)], dim=1)
            lx, hsx = self.full(ext, record=True)
            ext_runs.append((ref, hs, lx[:length], hsx))
        tol = max(NOISE_FACTOR * noise, EPS_FLOOR * self.eps * max(scale, 1e-6))
        layer_tol = [max(NOISE_FACTOR * n, EPS_FLOOR * self.eps * max(s, 1e-6))
                     for n, s in zip(layer_noise, layer_scale)]
        # causality of the recompute reference itself
        c_max, c_pos, c_layer = 0.0, None, None
        for ref, hs, lx, hsx in ext_runs:
            per_pos = (lx - ref).abs().max(dim=-1).values
            c_max = max(c_max, float(per_pos.max()))
            bad = (per_pos > tol).nonzero()
            if bad.numel():
                p = int(bad[0, 0])
                c_pos = p if c_pos is None else min(c_pos, p)
                for i in range(n_layers):
                    if hs[i] is None or hsx[i] is None:
                        continue
                    d = float((hsx[i][0, :length].double() - hs[i][0].double()).abs().max())
                    if d > layer_tol[i]:
                        c_layer = i if c_layer is None else min(c_layer, i)
                        break
        causality = dict(causal=c_pos is None, max_abs_diff=c_max, first_position=c_pos,
                         first_layer=c_layer, sequence_len=length, appended_tokens=5)
        return dict(noise=noise, scale=scale, tolerance=tol, layer_tolerance=layer_tol, obj_noise=obj_noise,
                    causality=causality)

    # -- one scenario --------------------------------------------------------------------
    def scenario(self, idx: int, prefix_len: int, tag: str, suffix_len: int, mode: str,
                 chunks: list[int], gen, cal: dict[str, Any], fault: CacheFault | None,
                 n_gen: int) -> dict[str, Any]:
        torch = self.torch
        tol = cal["tolerance"]
        ids = self.tokens(gen, prefix_len + suffix_len)
        P = prefix_len
        # recompute: one full forward without cache
        full_logits, full_hs = self.full(ids, record=True)
        # reuse: prefill the prefix, snapshot at the boundary, restore (through the fault wrapper)
        _, cache = self.prefill(ids[:, :P])
        snapshot = copy.deepcopy(cache)
        del cache
        restored = copy.deepcopy(snapshot)
        fault_info = fault.apply(restored) if fault is not None else None
        restored_rows = _compare_caches(restored, snapshot)
        pieces: list[Any] = []
        self.rec.start()
        c = restored
        if mode == "one_chunk":
            lg, c = self.step(ids[:, P:], c)
            pieces.append(lg)
        elif mode == "token_by_token":
            for t in range(P, P + suffix_len):
                lg, c = self.step(ids[:, t:t + 1], c)
                pieces.append(lg)
        else:
            start = P
            for n in chunks:
                lg, c = self.step(ids[:, start:start + n], c)
                pieces.append(lg)
                start += n
        reuse_hs = self.rec.stop()
        reuse_logits = torch.cat(pieces, dim=0)
        ref = full_logits[P:]
        delta = (reuse_logits - ref).abs()
        per_pos = delta.max(dim=-1).values
        max_abs = float(per_pos.max())
        bad = (per_pos > tol).nonzero()
        first_pos = int(bad[0, 0]) + P if bad.numel() else None
        flips = int((reuse_logits.argmax(-1) != ref.argmax(-1)).sum())
        # cache state after the suffix vs a one-shot prefill of prefix+suffix
        _, oneshot = self.prefill(ids)
        after_rows = _compare_caches(c, oneshot)
        # greedy generation, with the reused cache vs without cache
        gen_res = self._generate(ids, reuse_logits[-1], c, n_gen, tol)
        max_abs = max(max_abs, gen_res["max_abs_diff"])
        # verdict
        if max_abs == 0.0 and flips == 0 and gen_res["match"]:
            verdict = "exact"
        elif max_abs <= tol and gen_res["match"]:
            verdict = "within-tolerance"
        elif max_abs <= tol and gen_res.get("tie_flip"):
            verdict = "within-tolerance"
        else:
            verdict = "divergent"
        # per-layer localization
        layer_diff = []
        first_layer = None
        for i, (rh, fh) in enumerate(zip(reuse_hs, full_hs)):
            if rh is None or fh is None:
                layer_diff.append(None)
                continue
            d = float((rh[0].double() - fh[0, P:].double()).abs().max())
            layer_diff.append(d)
            if first_layer is None and d > cal["layer_tolerance"][i]:
                first_layer = i
        res: dict[str, Any] = dict(
            index=idx, prefix_len=P, prefix_boundary=tag, suffix_len=suffix_len, suffix_mode=mode,
            chunks=chunks if mode == "chunks" else None,
            max_abs_diff=max_abs, first_divergent_position=first_pos, argmax_flips=flips,
            generation=gen_res, verdict=verdict,
            first_divergent_layer=first_layer if verdict == "divergent" else None,
            layer_max_abs_diff=layer_diff,
        )
        if fault is not None:
            res["fault"] = dict(name=fault.name, layer=fault.layer, **(fault_info or {}))
            res["fault_layer"] = fault.layer
        if verdict == "divergent":
            res["cache_diff"] = self._explain(restored_rows, after_rows, cal, first_layer)
            res["explained_by"] = _explanation(res["cache_diff"], first_layer)
        return res

    def _generate(self, ids, last_logits, cache, n_gen: int, tol: float) -> dict[str, Any]:
        torch = self.torch
        seq = ids
        with_cache: list[int] = []
        without: list[int] = []
        max_abs = 0.0
        mismatch = None
        tie_flip = False
        lg_c = last_logits
        for step in range(n_gen):
            lg_f, _ = self.full(seq)
            lg_f = lg_f[-1]
            max_abs = max(max_abs, float((lg_c - lg_f).abs().max()))
            tc, tf = int(lg_c.argmax()), int(lg_f.argmax())
            with_cache.append(tc)
            without.append(tf)
            if tc != tf:
                mismatch = step
                top2 = lg_f.topk(2).values
                tie_flip = float(top2[0] - top2[1]) <= 2 * tol
                break
            nxt = torch.tensor([[tc]], dtype=seq.dtype)
            seq = torch.cat([seq, nxt], dim=1)
            if step + 1 < n_gen:
                lg, cache = self.step(nxt, cache)
                lg_c = lg[-1]
        return dict(tokens_with_cache=with_cache, tokens_without_cache=without, match=mismatch is None,
                    first_mismatch_step=mismatch, tie_flip=tie_flip, max_abs_diff=max_abs)

    def _explain(self, restored_rows, after_rows, cal, first_layer) -> list[dict[str, Any]]:
        out = []
        for stage, rows, exact in (("restored_snapshot", restored_rows, True),
                                   ("after_suffix", after_rows, False)):
            for r in rows:
                d = r["max_abs_diff"]
                if exact:
                    thr = 0.0
                elif r["kind"] == "counter":
                    thr = 0.0
                else:
                    n = cal["obj_noise"].get((r["layer"], r["object"]), 0.0)
                    thr = max(NOISE_FACTOR * n, EPS_FLOOR * self.eps * max(r["scale"], 1e-6))
                if d > thr or r["shape_mismatch"]:
                    row = dict(stage=stage, **r, threshold=thr)
                    out.append(row)
        out.sort(key=lambda r: (r["stage"] != "restored_snapshot", r["layer"], -_finite(r["max_abs_diff"])))
        return out

    # -- whole run -----------------------------------------------------------------------
    def run(self, scenarios: int, fault_name: str | None) -> dict[str, Any]:
        torch = self.torch
        rng = random.Random(self.seed)
        gen = torch.Generator().manual_seed(self.seed)
        bounds = self.boundaries()
        fault = None
        min_prefix = 1
        if fault_name is not None:
            name, _, at = fault_name.partition("@")
            if name not in FAULTS:
                raise AdapterError(f"unknown fault {fault_name!r}; known: {', '.join(FAULTS)} (optionally NAME@LAYER)")
            _, probe = self.prefill(torch.zeros((1, 4), dtype=torch.long))
            eligible = CacheFault.eligible(name, probe)
            if not eligible:
                raise AdapterError(f"fault {name} needs a layer with cached keys"
                                   f"{' in a sliding window' if name == 'drop_window_position' else ''};"
                                   f" {self.model_type} has none")
            if at:
                try:
                    layer = int(at)
                except ValueError:
                    raise AdapterError(f"bad fault layer {at!r} in {fault_name!r}") from None
                if layer not in eligible:
                    raise AdapterError(f"layer {layer} is not eligible for {name}; eligible: {eligible}")
            else:
                layer = rng.choice(eligible)
            fault = CacheFault(name, layer, random.Random(rng.randrange(2**31)))
            min_prefix = 3
        cands = self.prefix_candidates(bounds, min_prefix)
        order = cands[:]
        rng.shuffle(order)
        max_b = max(bounds.values()) if bounds else 8
        plan = []
        for i in range(scenarios):
            if i < len(order):
                P, tag = order[i]
            else:
                P = rng.randrange(min_prefix, 2 * max_b + 3)
                tag = next((t for n, t in cands if n == P), "random")
            mode = SUFFIX_MODES[(i + rng.randrange(3)) % 3] if i >= 3 else SUFFIX_MODES[i]
            S = rng.randrange(2, max(4, min(max_b, 8)) + 1)
            chunks: list[int] = []
            if mode == "chunks":
                k = rng.randrange(2, min(3, S) + 1)
                cuts = sorted(rng.sample(range(1, S), k - 1))
                chunks = [b - a for a, b in zip([0] + cuts, cuts + [S])]
            plan.append((P, tag, S, mode, chunks))
        max_len = max((p[0] + p[2] + GEN_TOKENS for p in plan), default=8)
        cal = self.calibrate(max_len, gen)
        results = []
        for i, (P, tag, S, mode, chunks) in enumerate(plan):
            results.append(self.scenario(i, P, tag, S, mode, chunks, gen, cal, fault, GEN_TOKENS))
        counts = {v: sum(1 for r in results if r["verdict"] == v) for v in VERDICT_ORDER}
        worst = max((r["verdict"] for r in results), key=VERDICT_ORDER.index, default="exact")
        divergent = [r for r in results if r["verdict"] == "divergent"]
        cfg = self.config.get_text_config(decoder=True)
        out: dict[str, Any] = dict(
            transformers_version=_import().__version__,
            torch_version=torch.__version__,
            model_type=self.model_type,
            model_class=type(self.model).__name__,
            dtype=self.dtype_name,
            seed=self.seed,
            attn_implementation=getattr(self.config, "_attn_implementation", None),
            layer_types=list(getattr(cfg, "layer_types", None) or []) or None,
            cache_layer_classes=self.cache_layer_classes,
            boundaries=bounds,
            tolerance=cal["tolerance"],
            tolerance_method=(f"max({NOISE_FACTOR:g} x observed float noise, {EPS_FLOOR:g} x eps(dtype) x max|logit|);"
                              " noise = max |logit difference| of the full forward of the same sequence"
                              " run alone vs. as one row of a batch of 3 (two random sequences)"),
            observed_noise=cal["noise"],
            logit_scale=cal["scale"],
            layer_tolerance=cal["layer_tolerance"],
            recompute_causality=cal["causality"],
            fault=fault_name,
            fault_layer=fault.layer if fault is not None else None,
            first_divergent_layer=(min((r["first_divergent_layer"] for r in divergent
                                        if r["first_divergent_layer"] is not None), default=None)),
            max_abs_diff=max((r["max_abs_diff"] for r in results), default=0.0),
            verdict=worst,
            counts=counts,
            scenarios=results,
        )
        return _jsonable(out)


def _select_row(cache, row: int):
    """A copy of ``cache`` restricted to batch row ``row`` (None if the API does not allow it)."""
    try:
        import torch

        c = copy.deepcopy(cache)
        idx = torch.tensor([row])
        for layer in _cache_layers(c):
            for attr, val in list(vars(layer).items()):
                if torch.is_tensor(val) and val.dim() > 0 and val.shape[0] == 3:
                    setattr(layer, attr, val.index_select(0, idx))
                elif isinstance(val, dict):
                    for k, v in val.items():
                        if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == 3:
                            val[k] = v.index_select(0, idx)
        return c
    except Exception:  # noqa: BLE001 - calibration of cache objects is best effort
        return None


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 1e300


def _explanation(rows: list[dict[str, Any]], first_layer: int | None) -> dict[str, Any] | None:
    """The cache object that best explains the divergence: a corrupted restored object first,
    else the first-divergent layer's object with the largest difference after the suffix."""
    restored = [r for r in rows if r["stage"] == "restored_snapshot"]
    pool = restored or rows
    if first_layer is not None and not any(r["layer"] <= first_layer for r in pool):
        return dict(stage=None, layer=first_layer, object=None, kind="computation",
                    max_abs_diff=None,
                    note="every cache object of this layer matches a one-shot prefill: the difference "
                         "arises in the layer's computation on the reused state, not in the stored state")
    if not pool:
        return None
    if first_layer is not None and any(r["layer"] == first_layer for r in pool):
        pool = [r for r in pool if r["layer"] == first_layer]
    else:
        lay = min(r["layer"] for r in pool)
        pool = [r for r in pool if r["layer"] == lay]
    best = max(pool, key=lambda r: (r["kind"] != "counter", _finite(r["max_abs_diff"]) / max(r["scale"], 1e-30)))
    return dict(stage=best["stage"], layer=best["layer"], object=best["object"], kind=best["kind"],
                max_abs_diff=best["max_abs_diff"])


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)


def run_diff(model_type: str, config_json: str | None = None, dtype: str = "float32", scenarios: int = 20,
             seed: int = 0, fault: str | None = None) -> dict:
    """Differential reuse-vs-recompute for a tiny random-weight transformers model.

    Returns a JSON-serialisable dict (see docs/adapters-transformers.md). Raises
    :class:`AdapterError` (one-line message) for an unknown model type, a bad config file, an
    unknown dtype or fault, or when transformers is not installed.
    """
    if not isinstance(scenarios, int) or scenarios < 1:
        raise AdapterError(f"scenarios must be a positive integer, got {scenarios!r}")
    model, config, mt = build_model(model_type, config_json, dtype, seed)
    runner = _Runner(model, config, mt, dtype, seed)
    try:
        return runner.run(scenarios, fault)
    except AdapterError:
        raise
    finally:
        runner.rec.close()
