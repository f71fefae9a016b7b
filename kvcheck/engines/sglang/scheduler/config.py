"""The serving configuration one scheduler episode runs under: the SGLang server-args fields the
drive sets (a trace carries them; checked field by field, since a trace is user input)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

POLICIES = ("lpm", "dfs-weight", "fcfs", "lof", "random")


@dataclass(frozen=True)
class SchedConfig:
    """The serving configuration of one episode: SGLang's own server-args fields."""
    schedule_policy: str = "fcfs"
    chunked_prefill_size: int = -1        # -1: chunked prefill off
    max_running_requests: int = 4
    enable_priority_scheduling: bool = False
    max_prefill_tokens: int = 16384
    capacity: int = 256                   # token slots in the KV pool
    context_length: int = 512
    enable_overlap: bool = False          # SGLang's overlap scheduler (its default in a server)
    swa_full_tokens_ratio: float = 0.0    # 0: the server's own SWA pool sizing; > 0: an operator's --swa-full-tokens-ratio

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SchedConfig":
        """Checked field by field (a trace is user input): one line naming the field."""
        if not isinstance(d, dict):
            raise ValueError(f"the scheduler config must be an object, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        bad = sorted(set(d) - known)
        if bad:
            raise ValueError(f"unknown scheduler config field(s) {bad}; known: {sorted(known)}")
        out = cls(**d)
        for name, f in cls.__dataclass_fields__.items():
            v, want = getattr(out, name), type(f.default)
            if type(v) is not want:
                raise ValueError(f"scheduler config field {name} must be {want.__name__}, got {v!r}")
        if out.schedule_policy not in POLICIES:
            raise ValueError(f"scheduler config field schedule_policy must be one of {', '.join(POLICIES)}")
        lows = {"max_running_requests": 1, "max_prefill_tokens": 1, "capacity": 8, "context_length": 16}
        for name, low in lows.items():
            if getattr(out, name) < low:
                raise ValueError(f"scheduler config field {name} must be >= {low}, got {getattr(out, name)}")
        if not 0.0 <= out.swa_full_tokens_ratio <= 1.0:
            raise ValueError("scheduler config field swa_full_tokens_ratio must be in [0, 1] (0: the server's sizing)")
        if out.chunked_prefill_size == 0 or out.chunked_prefill_size < -1:
            raise ValueError("scheduler config field chunked_prefill_size must be -1 (off) or >= 1")
        return out
