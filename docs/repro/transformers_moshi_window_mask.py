"""Standalone reproducer (transformers and torch only): Moshi's cache keeps a sliding window that its
own attention mask does not apply. `MoshiConfig.sliding_window` (3000 by default) makes the cache
a `DynamicSlidingWindowLayer` per layer, which keeps only the last `sliding_window - 1` keys, but
`MoshiModel` builds its mask with `create_causal_mask` (full causal, no window) — so a full
forward attends every earlier token while a forward continuing the cache sees only the window.
Past the window, continuing a cache and recomputing disagree (found by `kvcheck diff --sut
transformers --model-type moshi`, traced to `layers.0.self_attn.attention.weights`: "output
differs while its inputs agree"). Which side is right is Moshi's to say (its temporal
transformer's context is 3000 tokens, which the cache follows); they cannot both be.

    python transformers_moshi_window_mask.py [--window 8]

Exit 1: the next token's logits after a cached prefix of `window` tokens or more differ from the
full forward's, while shorter prefixes agree (the defect); 0: they agree; 2: no Moshi here.
Measured: exit 1 on 5.18.0, 5.19.0, 5.20.2, 5.22.2, 5.23.0, 5.24.0, 5.25.0 (2e-7 inside the window, 0.26 past
it); 0 on 5.0.0-5.17.0, where a cached continuation differs already inside the window (0.39,
with its positions given: an earlier, different defect, not classified) — the window mismatch is
there too (0.21 past it) but this script's exit code asks for the clean inside.
"""
import argparse
import inspect
import sys

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=int, default=8, help="sliding_window of the tiny config")
    a = ap.parse_args()
    try:
        config = AutoConfig.for_model("moshi", num_hidden_layers=2, vocab_size=128, hidden_size=64,
                                      num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                      sliding_window=a.window, ffn_dim=32)
    except (KeyError, ValueError) as exc:
        print(f"transformers {transformers.__version__} has no moshi: {exc}")
        return 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    n = 2 * a.window
    ids = torch.randint(0, 128, (1, n))
    rows = []
    takes = "cache_position" in inspect.signature(type(model).forward).parameters
    with torch.no_grad():
        full = model(input_ids=ids).logits
        for p in range(2, n - 1):
            cache = model(input_ids=ids[:, :p], use_cache=True).past_key_values
            at = torch.tensor([[p]])      # its position given (older releases start it at 0 otherwise)
            extra = {"cache_position": at[0]} if takes else {}
            nxt = model(input_ids=ids[:, p:p + 1], past_key_values=cache, use_cache=True, position_ids=at,
                        **extra).logits
            rows.append((p, float((nxt[0, -1] - full[0, p]).abs().max())))
    inside = max(d for p, d in rows if p < a.window - 1)
    beyond = max(d for p, d in rows if p >= a.window)
    print(f"transformers {transformers.__version__}, moshi, sliding_window {a.window}: max |logit difference| of "
          f"the next token, cached prefix vs full forward: {inside:.3g} for prefixes < {a.window - 1}, "
          f"{beyond:.3g} for prefixes >= {a.window}")
    if beyond > 1e-4 and inside <= 1e-4:
        print("DEFECT: past the window the cache keeps fewer keys than the full forward's mask attends")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
