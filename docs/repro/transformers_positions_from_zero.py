"""Standalone reproducer (transformers and torch only) of `positions_restart_without_cache`: a
forward that continues a populated cache without being given positions starts the new tokens'
positions at 0, not where the cache ends, so RoPE rotates the new queries and keys as if they
came first (found by `kvcheck diff --sut transformers --model-type bamba`; its probe replays the
extend with explicit `position_ids` and then agrees with the recompute). The cache itself is
right: passing `position_ids` fixes the output. `generate()` passes positions and is unaffected;
a caller continuing a returned cache (`model(new_ids, past_key_values=cache)`) is not.

Cause, in `BambaModel.forward` from 5.4.0 (when `cache_position` was removed):
`position_ids = torch.arange(hidden_states.shape[1])` where its siblings (Jamba, FalconH1,
GraniteMoeHybrid, NemotronH) add `cache.get_seq_length()`. 5.0.0-5.3.0 derived the positions
from `cache_position`, which counts the cache. Measured: exit 1 on 5.4.0, 5.5.4, 5.9.0, 5.10.4,
5.12.1, 5.13.1, 5.24.0, 5.25.0 (0.0016-0.0022 without positions, 2e-7 with them); 0 on 5.0.0 and
5.3.0 (2e-7 both ways). Jamba (`--model-type jamba`), whose forward counts the cache: 0.

    python transformers_positions_from_zero.py [--model-type bamba|jamba] [--prefix 4]

Exit 1: the extend without positions differs from a full forward while the same extend with
explicit positions agrees (the defect); 0: it agrees; 2: the release has no such model.
"""
import argparse
import inspect
import sys

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

TINY = {  # a Mamba2/attention hybrid and its sibling as a control (one attention layer, last)
    "bamba": {"num_hidden_layers": 4, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 4, "mamba_d_head": 32,
              "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2,
              "mamba_chunk_size": 8, "attn_layer_indices": [3]},
    "jamba": {"num_hidden_layers": 2, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
              "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 2, "mamba_d_state": 8,
              "mamba_d_conv": 4, "mamba_expand": 2, "use_mamba_kernels": False},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-type", default="bamba", choices=sorted(TINY))
    ap.add_argument("--prefix", type=int, default=4, help="prefilled tokens (the rest of 12 continue them)")
    a = ap.parse_args()
    try:
        config = AutoConfig.for_model(a.model_type, **TINY[a.model_type])
    except (KeyError, ValueError) as exc:
        print(f"transformers {transformers.__version__} has no {a.model_type}: {exc}")
        return 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids = torch.randint(0, 128, (1, 12))
    p = a.prefix

    takes = "cache_position" in inspect.signature(type(model).forward).parameters

    def counted(a: int, b: int) -> dict:
        """`cache_position` where the release's forward declares it (as generate() passes it;
        5.0-5.3's Mamba family ignores a cache without it): it counts the cache, positions may not."""
        return {"cache_position": torch.arange(a, b)} if takes else {}

    def extend(positions: bool):
        """Continue the prefix's cache one token at a time (a multi-token extend would also meet
        the Mamba2 mixer's own defect before 5.13, transformers_multitoken_extend.py)."""
        out = model(ids[:, :p], use_cache=True, **counted(0, p))
        if out.past_key_values is None:    # before 5.10 Bamba makes its cache only for generate()
            start = model.prepare_inputs_for_generation(ids[:, :p], past_key_values=None, use_cache=True,
                                                        cache_position=torch.arange(p))["past_key_values"]
            out = model(ids[:, :p], past_key_values=start, use_cache=True, **counted(0, p))
        cache, logits = out.past_key_values, []
        for t in range(p, 12):
            kw = {"position_ids": torch.tensor([[t]])} if positions else {}
            kw.update(counted(t, t + 1))
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True, **kw)
            cache = out.past_key_values
            logits.append(out.logits)
        return torch.cat(logits, dim=1)

    with torch.no_grad():
        full = model(ids).logits[:, p:]
        plain = float((extend(False) - full).abs().max())
        given = float((extend(True) - full).abs().max())
    print(f"transformers {transformers.__version__}, {a.model_type}: max |logit difference| of the token-by-token continuation vs a full "
          f"forward: {plain:.3g} without positions, {given:.3g} with its position_ids ({p}..11)")
    if plain > 1e-4 and given <= 1e-4:
        print("DEFECT: the forward starts the new tokens' positions at 0 although the cache holds the prefix")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
