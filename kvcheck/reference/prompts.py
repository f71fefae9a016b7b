"""The token content of the reference engine's requests: the seeded shared prefix, the prompt
table of `prompts = K` (the spec's content.py table made of real tokens) and each request's
private suffix. Every choice flows from the config's seed.
"""
from __future__ import annotations

import torch

from kvcheck.spec.config import Config
from kvcheck.spec.content import edit_block, extra_key, salted

SUFFIX = 3          # private suffix tokens per request


def prefix_tokens(cfg: Config, seed: int | None = None) -> list[int]:
    g = torch.Generator().manual_seed(10_007 + (cfg.seed if seed is None else seed))
    return torch.randint(0, 256, (cfg.blocks * cfg.block_size,), generator=g).tolist()


def prompt_table(cfg: Config, prefix: list[int]) -> list[list[int]]:
    """The token content of each prompt (spec/content.py): prompt 0 is the shared prefix;
    prompt p >= 1 the same tokens except block e(p), whose first token is shifted by p (so the
    edits differ from prompt 0 and from each other, and agree block by block after e(p)); a
    salted prompt has prompt 0's tokens unchanged (its extra key differs: `salt_of`)."""
    out = [list(prefix)]
    for p in range(1, cfg.prompts):
        t, at = list(prefix), edit_block(cfg, p) * cfg.block_size
        if not salted(cfg, p):
            t[at] = (t[at] + p) % 256
        out.append(t)
    return out


def salt_of(cfg: Config, base: str, p: int) -> str:
    """The cache salt of prompt p: the engine's own, or another tenant's for a salted prompt
    (spec/content.py extra_key: the extra key is part of every block's chained hash)."""
    k = extra_key(cfg, p)
    return f"{base}/tenant-{k}" if k else base


def suffix_tokens(rid: int, serial: int) -> list[int]:
    g = torch.Generator().manual_seed(99_991 + 131 * rid + serial)
    return torch.randint(0, 256, (SUFFIX,), generator=g).tolist()
