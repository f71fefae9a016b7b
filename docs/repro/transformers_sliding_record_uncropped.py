"""Standalone reproducer (transformers and torch only) of `sliding_record_uncropped_forward`: with
the cache's past recording on (assisted decoding's roll-back support), two forwards in a row
without a crop in between, past the sliding window, crash in the attention: the sliding layer's
`update` returns every recorded key while its `get_mask_sizes` reports only the window (found
by `kvcheck diff --sut transformers`, scenario `crop_continue`). Measured: exit 1 on 5.15.0,
5.15.1, 5.16.0, 5.16.1, 5.17.0; 0 on 5.14.1 and 5.18.0-5.24.0 (5.18.0's `update` slices what it
returns to the window for exactly this case, its comment naming an assistant that calls
`generate` with a past-aware cache); 2 (no past recording) on 5.0.0-5.13.1.

    python transformers_sliding_record_uncropped.py [--model-type mistral|gemma3_text] [--prefix 9]

Exit 1: the second uncropped forward crashes or its logits differ from a full forward (the
defect); 0: both forwards agree with the full forward; 2: the release cannot run it (no past
recording: nothing to reproduce).
"""
import argparse
import inspect
import sys

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

TINY = {
    "mistral": {"num_hidden_layers": 2, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8},
    "gemma3_text": {"num_hidden_layers": 2, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
                    "layer_types": ["sliding_attention", "full_attention"]},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-type", default="mistral", choices=sorted(TINY))
    ap.add_argument("--prefix", type=int, default=9, help="prefilled tokens (past the window of 8)")
    a = ap.parse_args()
    torch.manual_seed(0)
    config = AutoConfig.for_model(a.model_type, **TINY[a.model_type])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    params = inspect.signature(type(model).forward).parameters
    key = next(k for k in ("cache", "past_key_values") if k in params)
    ids = torch.randint(0, config.vocab_size, (1, a.prefix + 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[0]
        out = model(input_ids=ids[:, :a.prefix], use_cache=True)
        cache = getattr(out, key)
        if not hasattr(cache, "activate_past_recording"):
            print(f"transformers {transformers.__version__}: the cache has no past recording (nothing to reproduce)")
            return 2
        cache.activate_past_recording()
        got, p = [], a.prefix
        try:
            for n in (2, 2):                      # two forwards, no crop in between
                kw = {"input_ids": ids[:, p:p + n], "use_cache": True, key: cache}
                if "cache_position" in params:
                    kw["cache_position"] = torch.arange(p, p + n)
                out = model(**kw)
                cache = getattr(out, key)
                got.append(out.logits[0])
                p += n
        except RuntimeError as e:
            print(f"transformers {transformers.__version__}, {a.model_type}: DEFECT: the second uncropped forward "
                  f"with past recording on crashed: {e}")
            return 1
    d = float((torch.cat(got) - full[a.prefix:]).abs().max())
    print(f"transformers {transformers.__version__}, {a.model_type}: max |logit difference| {d:.3g}")
    return 1 if d > 1e-4 else 0


if __name__ == "__main__":
    sys.exit(main())
