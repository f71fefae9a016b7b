"""Standalone reproducer (transformers and torch only): `generate()` handed a cache returned by a
prefill of a model whose layers are all recurrent (Mamba, Mamba2, FalconMamba: a cache of
LinearAttention layers only) feeds the whole `input_ids` again instead of only the tokens the
cache does not hold, so every recurrent state advances over the prefix twice; the generated
logits differ from `generate()` from scratch (found by `kvcheck diff --sut transformers`, reuse
path `generate_continue`).

    python transformers_generate_refeeds_recurrent_cache.py [--model-type mamba2|mamba|falcon_mamba] [--prefix 7]

Builds a tiny random model (seed 0, float32, eager), prefills `prefix` of 8 tokens with use_cache,
then (a) `generate(input_ids=all 8, <cache>=that cache, max_new_tokens=3)` and (b) the same
`generate()` without a cache, and compares their logits; it also feeds the 8 tokens onto a fresh
7-token cache by hand, which is what (a)'s first step computes. Exit 1: (a) differs from (b) and
equals the double feed (the defect); 0: (a) agrees with (b); 2: the release cannot run it.
Why (transformers 5.24): generate decides how many input tokens the cache already holds from
`Cache.get_seq_length()`, which raises "can only be called on Attention layers" on a cache with
no attention layer, so that cache is treated as holding none. A hybrid with one attention layer
(Jamba, Bamba, Qwen3-Next) reports its length and continues correctly.
"""
import argparse
import inspect
import sys

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

TINY = {  # each model type's default config with every size small (kvcheck's derived configs)
    "mamba": {"num_hidden_layers": 4, "vocab_size": 128, "hidden_size": 64, "state_size": 8, "expand": 2,
              "conv_kernel": 4, "time_step_rank": 8, "intermediate_size": 64},
    "falcon_mamba": {"num_hidden_layers": 4, "vocab_size": 128, "hidden_size": 64, "state_size": 8, "expand": 2,
                     "conv_kernel": 4, "time_step_rank": 8, "intermediate_size": 64},
    "mamba2": {"num_hidden_layers": 4, "num_heads": 4, "head_dim": 32, "vocab_size": 128, "hidden_size": 64,
               "state_size": 8, "expand": 2, "conv_kernel": 4, "n_groups": 1, "time_step_rank": 8, "chunk_size": 8},
}
TOL = 1e-4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-type", default="mamba2", choices=sorted(TINY))
    ap.add_argument("--prefix", type=int, default=7)
    a = ap.parse_args()
    if not 1 <= a.prefix <= 7:
        print("--prefix must be 1..7 (of 8 tokens)")
        return 2
    torch.manual_seed(0)
    try:
        config = AutoConfig.for_model(a.model_type, **TINY[a.model_type])
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    except Exception as e:  # noqa: BLE001
        print(f"transformers {transformers.__version__} cannot build a tiny {a.model_type}: {type(e).__name__}: {e}")
        return 2
    params = inspect.signature(type(model).forward).parameters
    key = next((k for k in ("cache", "past_key_values", "cache_params") if k in params), None)
    if key is None:
        print(f"{type(model).__name__}.forward declares no cache parameter on transformers {transformers.__version__}")
        return 2
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
              output_logits=True, return_dict_in_generate=True, pad_token_id=0)

    positions = "cache_position" in params      # older releases want it beside a cache

    def prefill():
        kw = {"cache_position": torch.arange(a.prefix)} if positions else {}
        out = model(ids[:, :a.prefix], use_cache=True, **kw)
        return getattr(out, key, None)

    def fed_twice():
        kw = {"cache_position": torch.arange(a.prefix, a.prefix + 8)} if positions else {}
        try:
            return model(ids, **{key: prefill()}, use_cache=True, **kw).logits[0, -1]
        except Exception as e:  # noqa: BLE001 - a release whose mixer cannot take 8 tokens onto a cache
            print(f"  (the double feed itself cannot run here: {type(e).__name__}: {str(e)[:120]})")
            return None

    with torch.no_grad():
        full = model(ids).logits[0, -1]
        try:
            cont = model.generate(**kw, **{key: prefill()})
        except Exception as e:  # noqa: BLE001
            print(f"transformers {transformers.__version__}: generate() refused the cache: {type(e).__name__}: {e}")
            return 2
        scratch = model.generate(**kw)
        double = fed_twice()
    diff = max(float((x - y).abs().max()) for x, y in zip(cont.logits, scratch.logits))
    first = float((cont.logits[0][0] - full).abs().max())
    as_double = float((cont.logits[0][0] - double).abs().max()) if double is not None else float("nan")
    print(f"transformers {transformers.__version__}, {a.model_type}, cache passed as {key}=, prefix {a.prefix} of 8")
    print(f"  generate() from the cache vs from scratch: max |dlogit| {diff:.3g} "
          f"(tokens {cont.sequences[0, 8:].tolist()} vs {scratch.sequences[0, 8:].tolist()})")
    print(f"  its first step vs one forward of the 8 tokens: {first:.3g}; vs the 8 tokens fed onto the cache again: "
          f"{as_double:.3g}")
    if diff > TOL and as_double <= TOL:
        print("DEFECT: generate() fed the prefix the cache already holds through the recurrent layers again")
        return 1
    if diff <= TOL:
        print("ok: generate() continued the cache")
        return 0
    print("differs, but not as a double feed: another defect")
    return 2


if __name__ == "__main__":
    sys.exit(main())
