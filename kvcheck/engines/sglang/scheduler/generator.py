"""Seeded episodes for the scheduler drive (scheduler/adapter.py's actions)."""
from __future__ import annotations

import dataclasses
import random
import zlib
from typing import Any

from kvcheck.fuzz.prompts import PromptGen

from ..layouts import Layout
from .config import POLICIES, SchedConfig, all_swa
from .worker import EOS

VOCAB = 16
OVERLAP_SHARE = 0.5     # episodes under SGLang's overlap scheduler (its server default)
MAX_CHUNK = 16384       # SGLang's chunked prefill on large GPUs (8192 by default): a long window's 64 would exceed it
RATIO_SHARE = 0.25      # SWA episodes with an operator's --swa-full-tokens-ratio (the rest: the server's sizing)
LONG_SHARE = 0.3        # all-SWA episodes whose requests decode up to three windows (the rest: up to 24 tokens)
INTERVAL_SHARE = 0.5    # SWA episodes with an operator's SGLANG_SWA_EVICTION_INTERVAL (the rest: SGLang's 128)


class SchedGen(PromptGen):
    """Seeded episodes for the scheduler drive: a serving configuration drawn as ratios (chunk :
    page, or chunk : window on a sliding-window model; pool : chunk; prompt : chunk), prompts that
    share prefixes, and steps whose samples end a request now and then (EOS)."""

    def __init__(self, rng: random.Random, lay: Layout, capacity: int) -> None:
        super().__init__(rng, VOCAB - 2, 24, ("submit", "step", "abort"), ("step",))
        ps = lay.page_size
        w = self.w_ = lay.window if "swa" in lay.components else None
        if w:           # chunk : window as real models have it (SGLang's 8192-token chunk is 64 of gpt-oss's windows)
            chunk = rng.choice([-1, max(ps, int(w * rng.choice([0.25, 0.5, 1, 2, 4, 8, 16, 64])))])
            chunk = min(chunk, MAX_CHUNK)
        else:
            chunk = rng.choice([-1, ps * rng.choice([1, 2, 4, 8, 16])])
        unit = chunk if chunk > 0 else (w or ps * 8)
        self.cfg = SchedConfig(
            schedule_policy=rng.choice(POLICIES), chunked_prefill_size=chunk,
            max_running_requests=rng.choice([1, 2, 3, 4, 6]),
            enable_priority_scheduling=rng.random() < 0.3,
            max_prefill_tokens=max(unit, ps) * rng.choice([1, 2, 4, 16]),
            capacity=max(16 * ps, unit * rng.choice([1, 2, 3, 4, 8]) // 2) // ps * ps,
            context_length=max(64, unit * 6),
            enable_overlap=rng.random() < OVERLAP_SHARE)
        # the draws below come from a generator of their own, seeded by the configuration's text as it
        # read before `swa_eviction_interval` existed: every other draw of a seed stays what it was
        sub = random.Random(zlib.crc32(repr(self.cfg).replace(", swa_eviction_interval=128", "").encode()))
        if all_swa(lay):        # its one pool must take a window and a page (the server's floor), and a bit
            self.cfg = dataclasses.replace(self.cfg, capacity=max(self.cfg.capacity, (w + ps) * 5 // 4 // ps * ps + ps))
        elif w and sub.random() < RATIO_SHARE:
            # an operator's --swa-full-tokens-ratio: any SWA pool the server accepts (more than a
            # window and a page), below one chunk included. Drawn from a generator of its own, so
            # that every other draw of a seed stays what it was.
            low = (w + ps + 1) / self.cfg.capacity
            if low < 1:
                self.cfg = dataclasses.replace(self.cfg, swa_full_tokens_ratio=round(sub.uniform(low + 0.01, 1.0), 3))
        if w and sub.random() < INTERVAL_SHARE:
            # an operator's SGLANG_SWA_EVICTION_INTERVAL: decode frees the window's tail every that many
            # forwards (0.5.14-0.5.17) or tokens past the window (0.5.18+); at SGLang's 128 an episode
            # of a few dozen forwards would never see it on the older releases
            self.cfg = dataclasses.replace(self.cfg, swa_eviction_interval=sub.choice([1, 2, 4, 16]))
        # long decodes (as served: hundreds of tokens) in some all-SWA episodes: a prefill-aware
        # model frees only decoded tokens, once a request runs a window past its prompt (a hybrid
        # model's prompt past the window is freed at its first decodes)
        self.eos, self.long = 0.05, sub.random() < LONG_SHARE and all_swa(lay)
        if self.long:
            self.eos = 0.002
        # prompts SGLang admits (its limit: min(context, pool) - 1 - 5), a third of them past a chunk
        self.max_prompt = max(2, min(self.cfg.capacity - 8, self.cfg.context_length - 8, unit * 3))
        self.bases = [[2 + rng.randrange(VOCAB - 2) for _ in range(self.max_prompt)] for _ in range(3)]
        self.started = False
        self.n = 0

    def next(self, ad: Any) -> tuple[str, dict]:
        rng = self.rng
        if not self.started:
            self.started = True
            return "start", {"config": self.cfg.to_dict()}
        cands = {"step": self.w["step"] * 2}
        if len(ad.reqs) < 8:
            cands["submit"] = self.w["submit"] * (3 if not ad.reqs else 1)
        if ad.reqs:
            cands["abort"] = self.w["abort"] * 0.2
        a = self.choose(cands)
        if a == "submit":
            base = rng.choice(self.bases)
            n = rng.randint(2, self.max_prompt)
            cut = rng.randint(0, n)
            toks = base[:cut] + [2 + rng.randrange(VOCAB - 2) for _ in range(n - cut)]
            self.n += 1
            max_new = rng.randint(1, 24)
            if self.long:       # up to three windows, within the context
                max_new = max(1, min(max_new * self.w_ // 8, self.cfg.context_length - n - 8))
            return a, {"r": f"r{self.n}", "tokens": toks, "max_new": max_new,
                       "priority": rng.randint(0, 3) if self.cfg.enable_priority_scheduling else None}
        if a == "abort":
            return a, {"r": rng.choice(sorted(ad.reqs))}
        toks = [EOS if rng.random() < self.eos else 2 + rng.randrange(VOCAB - 2) for _ in range(4)]
        if self.long:           # several passes of the event loop in one action: a long decode fits an episode
            return a, {"toks": toks, "times": rng.choice([1, 4, 16, 32])}
        return a, {"toks": toks}
