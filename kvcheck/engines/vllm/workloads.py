"""What chat and agent clients send, as a vLLM workload, and the reuse profile of a layout.

The random workload (drivers.py `_Gen`, shared draws with SGLang through prompts.PromptGen) cuts
three base prompts at random points. Chat clients also resend the same turn with a few tokens
appended or one edited, branch siblings off an earlier prompt at any position (inside its last
block too), grow a conversation turn by turn (the previous prompt *and its output* plus a new
user turn) and share one system prompt across users while memory is short. `ChatGen` wraps the
random generator and replaces only the prompts of its `submit`s, from the same seeded rng, so
the random workload's draws stay byte-identical when this mode is off.

`reuse_profile(layout)`: usable hit against divergence position for a first sibling of a
computed prompt, on the layout and on its dense twin (the campaign JSON's ``reuse_profile``).
"""
from __future__ import annotations

import random
from typing import Any

from .layouts import MAX_TOKENS, VOCAB, RETENTION

MODES = ("resend", "sibling", "turn", "system")
PROFILE_LEN = 32      # tokens of the probed prompt (crosses every window and alignment unit)


class ChatGen:
    """The random generator, with chat-shaped prompts for its submits."""

    def __init__(self, base: Any) -> None:
        self.base, self.rng = base, base.rng
        self.history: list[list[int]] = []
        self.system = base.bases[0][: self.rng.randint(8, 20)]
        self.mode_w = [self.rng.choice([0.5, 1, 2]) for _ in MODES]

    def next(self, ad: Any) -> tuple[str, dict]:
        for req in ad.reqs.values():          # remember every conversation seen, with output
            toks = list(req.obj.all_token_ids)
            if toks not in self.history[-12:]:
                self.history = [*self.history[-23:], toks]
        a, p = self.base.next(ad)
        if a == "submit":
            p = {**p, "tokens": self.prompt(getattr(ad, "max_tokens", MAX_TOKENS))}
        return a, p

    def prompt(self, max_tokens: int = MAX_TOKENS) -> list[int]:
        rng, cap = self.rng, max_tokens - 4      # the layout's own scale
        k = max(1, max_tokens // MAX_TOKENS)     # lengths grow with it (real sizes: system prompts
        #                                          of thousands of tokens, turns of hundreds)
        mode = rng.choices(MODES, self.mode_w)[0] if self.history else "system"
        fresh = lambda n: [rng.randrange(VOCAB) for _ in range(n)]   # noqa: E731
        if mode == "system":
            out = self.system * k + fresh(rng.randint(1, 16 * k))
        else:
            prev = rng.choice(self.history)
            if mode == "resend":
                out = list(prev)
                if rng.random() < 0.5 and out:
                    out[rng.randrange(max(0, len(out) - 6), len(out))] = rng.randrange(VOCAB)
                out += fresh(rng.choice([0, 1, 2, 3]))
            elif mode == "sibling":
                d = rng.randint(0, len(prev))
                out = prev[:d] + [(prev[d] + 1) % VOCAB if d < len(prev) else rng.randrange(VOCAB)] \
                    + fresh(rng.randint(0, 6 * k))
            else:                                 # next turn: everything so far + a user turn
                out = list(prev) + fresh(rng.randint(2, 8 * k))
        out = out[:cap] or fresh(2)
        return out if len(out) >= 2 else out + fresh(1)


WORKLOADS: dict[str, Any] = {"random": None, "chat": ChatGen}


def _probe(ad: Any, prompt: list[int], sibling: list[int]) -> int:
    """Compute `prompt` and finish it, then return the hit of `sibling`."""
    ad.apply("submit", {"r": "a", "tokens": prompt})
    ad.apply("lookup", {"r": "a", "chunk": len(prompt)})
    ad.apply("finish", {"r": "a"})
    ad.apply("submit", {"r": "b", "tokens": sibling})
    return int(ad.apply("lookup", {"r": "b", "chunk": 1}).get("hit", 0))


def profile_points(layout: str) -> tuple[int, list[int]]:
    """The probed prompt's length and the divergence points: every token of PROFILE_LEN on the
    small layouts; at real sizes twice the largest window, chunk or scheduler block (within the
    layout's request cap), probed at 17 evenly spaced points and on each side of the first
    scheduler block's edge and of the largest unit's."""
    from .layouts import LAYOUT_DATA, layout_scale
    _, groups, sched = LAYOUT_DATA[layout]
    cap = layout_scale(layout)[1] * 3 // 4 - 8
    n = max(PROFILE_LEN, min(cap, 2 * max([p or 0 for _, _, p in groups] + [sched])))
    if n == PROFILE_LEN:
        return n, list(range(n + 1))
    unit = max([p or 0 for _, _, p in groups] + [sched])
    pts = set(range(0, n + 1, max(1, n // 16))) | {n}
    pts |= {e + o for e in (sched, unit) for o in (-1, 0, 1) if 0 <= e + o <= n}
    return n, sorted(pts)


def reuse_profile(layout: str, seed: int = 0) -> dict[str, list[list[int]]]:
    """{layout: [[d, hit], ...], layout + " (dense twin)": [...]} for a first sibling that
    shares d tokens of a computed prompt (profile_points; d = its length: it extends it)."""
    from .adapter import VllmAdapter
    from .twin import DenseTwin
    rng = random.Random(seed)
    n, points = profile_points(layout)
    base = [rng.randrange(VOCAB) for _ in range(n)]
    tail = [rng.randrange(VOCAB) for _ in range(6)]
    out: dict[str, list[list[int]]] = {layout: []}
    kinds: list[tuple[str, type]] = [(layout, VllmAdapter)]
    if RETENTION.get(layout) is not None:
        kinds.append((f"{layout} (dense twin)", DenseTwin))
        out[kinds[-1][0]] = []
    from .layouts import LAYOUT_DATA
    blocks = 64 if n == PROFILE_LEN else 4 * (n // min(bs for _, bs, _ in LAYOUT_DATA[layout][1]) + 2) \
        * len(LAYOUT_DATA[layout][1]) + 8            # two prompts' tables in every group
    for name, cls in kinds:
        ad = cls(layout, blocks)
        for d in points:
            ad.reset()
            div = [(base[d] + 1) % VOCAB] if d < n else []
            out[name].append([d, _probe(ad, base, base[:d] + div + tail)])
    return out
