"""A campaign's budget: a duration or a step count, parsed once for every command that takes one
(fuzz, mutants, the release matrix's cells, the project gate). A module of its own, below the
engine protocol and the campaign, so both can use it."""
from __future__ import annotations

import re
from dataclasses import dataclass


MIN_SECONDS = 1.0    # a campaign's start-up (Hypothesis, the engine) alone takes longer


@dataclass
class Budget:
    seconds: float | None = None
    steps: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Budget":
        """A duration (60s, 5m, 1h) or a step count; refused (ValueError, one line) when it is
        not one, is absurdly large, or is a duration too short for one step (a run that did no
        work would otherwise "hold")."""
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*", text if isinstance(text, str) else "")
        if not m:
            raise ValueError(f"budget must be a duration like 60s, 5m, 1h or a step count like "
                             f"20000, got {str(text)[:40]!r}")
        if len(m.group(1).split(".")[0].lstrip("0")) > 9:
            raise ValueError(f"budget {m.group(1)[:12]}... is too large (at most 999999999 steps or seconds)")
        n, unit = float(m.group(1)), m.group(2)
        if unit is None:
            if "." in m.group(1):
                raise ValueError(f"a step count is a whole number, got {m.group(1)!r} (or add s, m, h)")
            return cls(steps=int(n))
        seconds = n * {"s": 1, "m": 60, "h": 3600}[unit]
        if seconds < MIN_SECONDS:
            raise ValueError(f"budget {text.strip()!r} is shorter than one step can take (at least "
                             f"{MIN_SECONDS:g}s, or a step count)")
        return cls(seconds=seconds)

    def describe(self) -> str:
        return f"{self.seconds:g}s" if self.seconds is not None else f"{self.steps} steps"
