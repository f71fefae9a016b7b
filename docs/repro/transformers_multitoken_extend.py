"""Standalone reproducer (transformers and torch only) of `recurrent_state_multitoken_extend`:
a layer with a recurrent / convolution state continues a populated cache right one token at a
time and wrong with several tokens at once (transformers PR #45513 for the gated delta net,
issue #46032 / PR #46084 for Mamba2Mixer; found by `kvcheck diff --sut transformers`).

    python transformers_multitoken_extend.py [--model-type mamba|mamba2|qwen3_next|jamba] [--prefix 6] [--extend 5]

Builds a tiny random model (seed 0, float32, eager), prefills `prefix` tokens with use_cache,
then continues the returned cache (a) with `extend` tokens in one call and (b) one token per call
from a second prefill, and compares the logits with one forward of the whole sequence without a
cache. Exit 1: (a) differs, (b) agrees (the defect); 0: both agree; 2: anything else (b differs
too: another defect; or the release cannot run it). The cache is passed by the keyword the
release's forward declares (`cache` in 5.24, `past_key_values` in 5.16, `cache_params`), with
`cache_position` where declared.
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
    "mamba2": {"num_hidden_layers": 4, "num_heads": 4, "head_dim": 32, "vocab_size": 128, "hidden_size": 64,
               "state_size": 8, "expand": 2, "conv_kernel": 4, "n_groups": 1, "time_step_rank": 8, "chunk_size": 8},
    "qwen3_next": {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                   "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
                   "head_dim": 16, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                   "linear_num_key_heads": 2, "linear_num_value_heads": 4, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32, "num_experts_per_tok": 2, "num_experts": 4,
                   "num_key_value_heads": 2},
    "jamba": {"num_hidden_layers": 4, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
              "num_attention_heads": 4, "num_experts_per_tok": 2, "num_experts": 4, "attn_layer_period": 2,
              "attn_layer_offset": 1, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8,
              "num_key_value_heads": 2, "use_mamba_kernels": False},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-type", default="mamba", choices=sorted(TINY))
    ap.add_argument("--prefix", type=int, default=6)
    ap.add_argument("--extend", type=int, default=5)
    a = ap.parse_args()
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
    n, p = a.prefix + a.extend, a.prefix
    ids = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))

    def call(tokens, cache=None, start=0):
        kw = {"input_ids": tokens, "use_cache": True}
        if cache is not None:
            kw[key] = cache
            if "cache_position" in params:
                kw["cache_position"] = torch.arange(start, start + tokens.shape[1])
        out = model(**kw)
        got = next((getattr(out, f, None) for f in (key, "cache", "past_key_values", "cache_params")
                    if getattr(out, f, None) is not None), None)
        return out.logits[0], got

    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[0]
        _, cache = call(ids[:, :p])
        if cache is None:
            print(f"{type(model).__name__} returned no cache on transformers {transformers.__version__}")
            return 2
        try:
            many, _ = call(ids[:, p:], cache, p)
            d_many = float((many - full[p:]).abs().max())
        except Exception as e:  # noqa: BLE001 - a crash on the multi-token extend is the defect too
            d_many, many = float("inf"), f"{type(e).__name__}: {e}"
        _, cache = call(ids[:, :p])
        ones = []
        for i in range(p, n):
            lg, cache = call(ids[:, i:i + 1], cache, i)
            ones.append(lg)
        d_one = float((torch.cat(ones) - full[p:]).abs().max())
    tol = 1e-4
    print(f"transformers {transformers.__version__}, {a.model_type}: prefix {p}, extend {a.extend} tokens; "
          f"max |logit difference| vs the full forward: {a.extend} at once {d_many:.3g}"
          + (f" (crashed: {many})" if isinstance(many, str) else "") + f", one at a time {d_one:.3g}")
    if d_one > tol:
        print("one token at a time differs too: not this defect")
        return 2
    if d_many > tol:
        print("DEFECT: the multi-token extend of a populated cache is wrong; one token at a time is right")
        return 1
    print("no defect: both agree with the full forward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
