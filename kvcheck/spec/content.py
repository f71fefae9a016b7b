"""Prompts with content (config `prompts = K`): which tokens a block holds, and what a hit on it
must match.

Owns the static prompt table and block identity. With K = 1 every request covers a prefix of
one shared token sequence (the spec before content existed: nothing here is consulted). With
K > 1 request r draws a prompt p = rp[r] at submit. Prompt 0 is the shared system prompt;
prompt p >= 1 is an *edit* of it: the same tokens except block e(p) = max(0, blocks - 1 - p),
so prompt p shares blocks [0, e(p)) with prompt 0 (siblings diverging at a block) and block by
block has the same tokens again after e(p) (what a hash that ignores its parent confuses).
The last `salted_prompts` prompts are instead prompt 0's very tokens under another *extra key*
of the block hash (a cache salt / tenant, a LoRA adapter id, a model fingerprint: vLLM's
`extra_keys`): their chain differs from block 0 on while every block's own tokens agree (what a
hash that leaves the extra key out confuses).

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


def salted(cfg: Config, p: int) -> bool:
    """Is prompt p prompt 0's tokens under another extra key (one of the last salted_prompts)?"""
    return 1 <= p and p >= cfg.prompts - cfg.salted_prompts


def extra_key(cfg: Config, p: int) -> int:
    """Id of prompt p's extra key (salt / tenant): 0 = prompt 0's, p for a salted prompt."""
    return p if salted(cfg, p) else 0


def edit_block(cfg: Config, p: int) -> int:
    """The block where prompt p differs from prompt 0 (p >= 1): a salted prompt from block 0."""
    return 0 if salted(cfg, p) else max(0, cfg.blocks - 1 - p)


def chain(cfg: Config, p: int, j: int) -> int:
    """Lineage id of block j of prompt p: equal for two prompts iff blocks 0..j all agree and
    their extra keys do."""
    return 0 if p == 0 or j < edit_block(cfg, p) else p


def local(cfg: Config, p: int, j: int) -> int:
    """Id of block j's own tokens (ignoring its parent): prompt 0's except at the edit."""
    return p if p and not salted(cfg, p) and j == edit_block(cfg, p) else 0


def unsalted(cfg: Config, p: int, j: int) -> int:
    """Lineage id of block j's token chain without the extra key: prompt 0's for a salted prompt."""
    return 0 if salted(cfg, p) else chain(cfg, p, j)


def chain_of(L: Any, cfg: Config, p: Any, j: int) -> Any:
    """chain(p, j) for a state-dependent prompt p."""
    return L.Table(p, [chain(cfg, q, j) for q in range(cfg.prompts)])


def _by(L: Any, cfg: Config, x: Any, j: int, f: Any) -> Any:
    return L.Table(x, [f(cfg, q, j) for q in range(cfg.prompts)])


def hash_matches(v: Any, L: Any, cfg: Config, r: int, j: int, planted: F.Planted) -> Any:
    """Does request r's hash of block j equal the one published for slot j? The chained hash
    names the lineage; `hash_ignores_parent` compares the block's own tokens only;
    `hash_missing_salt` the token chain without the extra key (asked only where a prompt is
    salted: elsewhere the fault plants nothing)."""
    if cfg.prompts == 1:
        return True
    key, p = v.disk(j).bkey, v.req(r).rp
    if planted(F.HASH_IGNORES_PARENT):
        return _by(L, cfg, key, j, local) == _by(L, cfg, p, j, local)
    if cfg.salted_prompts and planted(F.HASH_MISSING_SALT):
        return _by(L, cfg, key, j, unsalted) == _by(L, cfg, p, j, unsalted)
    return key == chain_of(L, cfg, p, j)


def copy_fits(v: Any, L: Any, j: int, alive: list[Any]) -> Any:
    """An on-disk copy may complete slot j (offload tiers): it holds the slot's content, or none
    of the slot's objects is live (`alive`), so a copy never mixes with other live content."""
    return L.Or(v.disk(j).dcid == v.disk(j).bcid, L.Not(L.Or(*alive)))


def holds_prefix(v: Any, L: Any, cfg: Config, r: int, j: int) -> Any:
    """Ground truth: block slot j holds exactly request r's block j (its whole prefix to j)."""
    if cfg.prompts == 1:
        return True
    return v.disk(j).bcid == chain_of(L, cfg, v.req(r).rp, j)
