"""A request's execution in the reference engine: its working model state and the logits it
produced. A module of its own so that engine.py and decode.py share it without importing each
other."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .model import ModelState


@dataclass
class Run:
    """A request's execution: its working state and the logits it produced with reuse."""

    start: int                                  # token position the reuse path started from
    state: ModelState
    logits: list[torch.Tensor] = field(default_factory=list)
    probe: tuple | None = None                  # (pos, tokens, logits, state) computed at use
    result: torch.Tensor | None = None          # all logits from `start` on, after finish
