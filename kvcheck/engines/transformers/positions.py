"""Does a divergence come from the positions the model gives the new tokens?

A model's forward derives the new tokens' positions (for RoPE) when the caller passes none; it
must start them where the cache ends. Callers that continue a returned cache — the pattern
transformers' own docs teach (`model(new_ids, past_key_values=cache)`) — pass no positions, so a
forward that starts them at 0 rotates every reused query and key wrongly although the cache is
right (Bamba from 5.4.0: `position_ids = torch.arange(seq_len)`, while its siblings Jamba,
FalconH1, GraniteMoeHybrid add `cache.get_seq_length()`). kvcheck's scenarios pass no positions
either (they test what callers do); for a divergent scenario this probe replays the same extend
with the positions passed explicitly. Agreeing then, within the tolerance, decides the cause:
the cache is sound and the forward's own position derivation is not (engines/transformers/
known.py names it `positions_restart_without_cache`).
"""
from __future__ import annotations

import copy
from typing import Any

from .interface import declares

PARAMETER = "position_ids"


def probe(runner: Any, ids: Any, prefix: int, steps: list[int], restored: Any, ref: Any, tol: float,
          extend_diff: float) -> dict[str, Any]:
    """Replay the extend of a divergent scenario from a copy of the `restored` cache with explicit
    `position_ids` and compare with `ref` (the recompute's logits of the suffix). Only an extend
    that diverged (`extend_diff`, its own difference, over `tol`) can be explained so: a scenario
    whose divergence is in its generation alone is not probed. A crash here is reported, never
    raised: the probe only explains a verdict already given."""
    if extend_diff <= tol:
        return {"ran": False, "why": "the extend agrees with the recompute; the divergence is in the generation"}
    if not declares(type(runner.model), PARAMETER):
        return {"ran": False, "why": f"{type(runner.model).__name__}.forward declares no {PARAMETER}"}
    torch = runner.torch
    c, start, pieces = copy.deepcopy(restored), prefix, []
    try:
        for n in steps:
            pos = torch.arange(start, start + n).unsqueeze(0)
            lg, c = runner.step(ids[:, start:start + n], c, past=start, **{PARAMETER: pos})
            pieces.append(lg)
            start += n
    except Exception as exc:  # noqa: BLE001 - a probe explains; it never changes the verdict
        return {"ran": False, "why": f"the extend with explicit positions crashed: {type(exc).__name__}"}
    diff = float((torch.cat(pieces, dim=0) - ref).abs().max())
    return {"ran": True, "max_abs_diff": diff, "agrees": diff <= tol}
