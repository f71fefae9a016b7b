"""Batch-invariant activations.

torch's own SiLU and sigmoid are NOT position-invariant on this CPU: the vectorised body and the
scalar tail of the elementwise loop round differently, so an element's bits depend on where it
sits in the tensor (measured: ~1% of elements of odd-length slices differ). exp, add and divide
are invariant (tested), so SiLU is composed from them.
"""
from __future__ import annotations

import torch


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), computed as x / (1 + exp(-x))."""
    return x / (1.0 + torch.exp(-x))
