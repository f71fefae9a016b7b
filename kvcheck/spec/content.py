"""Prompts with content (config `prompts = K`): which tokens a block holds, and what a hit on it
must match.

Owns the static prompt table and block identity. With K = 1 every request covers a prefix of
one shared token sequence (the spec before content existed: nothing here is consulted). With
K > 1 request r draws a prompt p = rp[r] at submit. Prompt 0 is the shared system prompt;
prompt p >= 1 is an *edit* of it: the same tokens except block e(p) = max(0, blocks - 1 - p),
so prompt p shares blocks [0, e(p)) with prompt 0 (siblings diverging at a block) and block by
block has the same tokens again after e(p) (what a hash that ignores its parent confuses).

A block's identity is the chained hash of its tokens and its parent's identity (a lineage id,
`chain(p, j)`: 0 while prompt p still agrees with prompt 0, p from e(p) on); its own tokens
alone are `local(p, j)`. A block slot records the lineage it holds (`bcid`) and the lineage
its published hash names (`bkey`). Hit soundness (`hit_content_sound`): every block a granted
hit reads holds exactly this request's prefix, bcid[j] == chain(rp, j). Symmetry over token
values: only equality of ids matters, so K prompts need K ids.
"""
from __future__ import annotations

from typing import Any

from . import faults as F
from .config import Config


def edit_block(cfg: Config, p: int) -> int:
    """The block where prompt p differs from prompt 0 (p >= 1)."""
    return max(0, cfg.blocks - 1 - p)


def chain(cfg: Config, p: int, j: int) -> int:
    """Lineage id of block j of prompt p: equal for two prompts iff blocks 0..j all agree."""
    return 0 if p == 0 or j < edit_block(cfg, p) else p


def local(cfg: Config, p: int, j: int) -> int:
    """Id of block j's own tokens (ignoring its parent): prompt 0's except at the edit."""
    return p if p and j == edit_block(cfg, p) else 0


def chain_of(L: Any, cfg: Config, p: Any, j: int) -> Any:
    """chain(p, j) for a state-dependent prompt p."""
    return L.Table(p, [chain(cfg, q, j) for q in range(cfg.prompts)])


def local_of_lineage(L: Any, cfg: Config, c: Any, j: int) -> Any:
    """The tokens of block j of lineage c (a lineage id is the prompt that computed it)."""
    return L.Table(c, [local(cfg, q, j) for q in range(cfg.prompts)])


def hash_matches(v: Any, L: Any, cfg: Config, r: int, j: int, planted: F.Planted) -> Any:
    """Does request r's hash of block j equal the one published for slot j? The chained hash
    names the lineage; `hash_ignores_parent` compares the block's own tokens only."""
    if cfg.prompts == 1:
        return True
    key, p = v.disk(j).bkey, v.req(r).rp
    if planted(F.HASH_IGNORES_PARENT):
        return local_of_lineage(L, cfg, key, j) == L.Table(p, [local(cfg, q, j) for q in range(cfg.prompts)])
    return key == chain_of(L, cfg, p, j)


def holds_prefix(v: Any, L: Any, cfg: Config, r: int, j: int) -> Any:
    """Ground truth: block slot j holds exactly request r's block j (its whole prefix to j)."""
    if cfg.prompts == 1:
        return True
    return v.disk(j).bcid == chain_of(L, cfg, v.req(r).rp, j)
