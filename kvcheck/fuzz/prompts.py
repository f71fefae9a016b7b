"""Seeded generation of prompts and action mixes for adapters that speak their own actions
(vLLM, SGLang): shared base prompts, so that requests share prefixes, diverge at any position and
resend a turn; and per-episode action weights (swarm testing).

Owns the random draws both adapters' campaigns make, in one order, so a seed means the same
workload shape on either engine. Each adapter keeps its own rules for which actions are enabled.
"""
from __future__ import annotations

import random
from typing import ClassVar, Iterable


class PromptGen:
    """`bases` shared prompts of `base_len` tokens over `vocab`; each episode draws a weight per
    action (doubled for `boost`). `swarm = False` (set by benchmarks/search.py only, to measure
    what swarm buys) keeps the draws but gives every action weight 1."""

    swarm: ClassVar[bool] = True

    def __init__(self, rng: random.Random, vocab: int, base_len: int, actions: Iterable[str],
                 boost: Iterable[str]) -> None:
        self.rng, self.vocab = rng, vocab
        self.bases = [[rng.randrange(vocab) for _ in range(base_len)] for _ in range(3)]
        self.w = {a: rng.choice([0.3, 1, 2, 4]) for a in actions}
        if not self.swarm:
            self.w = dict.fromkeys(self.w, 1.0)
        for a in boost:
            self.w[a] *= 2

    def choose(self, cands: dict[str, float]) -> str:
        """One action among the candidates, by their weights."""
        acts = list(cands)
        return self.rng.choices(acts, [cands[x] for x in acts])[0]

    def prompt(self, max_len: int) -> list[int]:
        """2..max_len tokens: a prefix of a shared base (any length, none too), then fresh ones."""
        rng = self.rng
        base = rng.choice(self.bases)
        n = rng.randint(2, max_len)
        cut = rng.randint(0, n)
        return base[:cut] + [rng.randrange(self.vocab) for _ in range(n - cut)]
