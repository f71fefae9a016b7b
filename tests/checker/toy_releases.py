"""A tiny engine with "releases" for the cross-release differential's tests (no real engine).

Its release is $TOY_RELEASE (1.0 by default): a prefix cache of 4-token blocks where a lookup
hits the longest cached whole-block prefix that leaves the last token. Planted per release:
2.0 never reuses past the first block (a reuse loss); 3.0 serves an identical resend whole,
its last token too, and breaks `hit_leaves_last_token` (an unsound hit). Layout "toy2"
is missing on 1.0 (cannot express)."""
from __future__ import annotations

import os
from typing import Any

from kvcheck.fuzz.engine import Engine

BLOCK = 4


class ToyReleases(Engine):
    name = "toy-releases"
    summary = "a prefix cache with planted per-release behaviour (tests)"
    distribution = "toy-releases"
    release_range = ("1.0", "3.0")

    def release(self) -> str | None:
        return os.environ.get("TOY_RELEASE", "1.0")

    def layouts(self) -> dict[str, str]:
        return {"toy": "4-token blocks", "toy2": "the same, from 2.0 on"}

    def unsupported(self) -> dict[str, str]:
        return {"toy2": "toy 1.0 has no toy2"} if self.release() == "1.0" else {}

    def reuse_sizes(self, layout: str) -> dict[str, int]:
        return {"block": BLOCK, "max_tokens": 40, "vocab": 50}

    def replay_reuse(self, layout: str, workloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rel, out = self.release(), []
        for w in workloads:
            cache: set[tuple[int, ...]] = set()
            sent: set[tuple[int, ...]] = set()
            for i, st in enumerate(w["steps"]):
                if st["op"] != "send":
                    continue
                toks = st["tokens"]
                hit = max([k for k in range(0, len(toks), BLOCK) if k <= len(toks) - 1 and tuple(toks[:k]) in cache]
                          + [0])
                violation = None
                if rel == "2.0":
                    hit = min(hit, BLOCK)
                if rel == "3.0" and tuple(toks) in sent:
                    hit = len(toks)
                    violation = {"kind": "safety", "check": "hit_leaves_last_token", "message": "hit = prompt"}
                out.append({"trace": w["name"], "step": i, "request": st["r"], "prompt_tokens": len(toks),
                            "hit": hit, "decision": "hit" if hit else "miss", "violation": violation})
                cache |= {tuple(toks[:k]) for k in range(0, len(toks) + 1, BLOCK)}
                sent.add(tuple(toks))
        return out


class NoReplay(Engine):
    name = "no-replay"
    distribution = "no-replay"
    release_range = ("1.0", "1.0")

    def layouts(self) -> dict[str, str]:
        return {"toy": "x"}


ENGINE = ToyReleases()
