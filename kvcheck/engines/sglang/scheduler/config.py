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
    swa_eviction_interval: int = 128      # SGLANG_SWA_EVICTION_INTERVAL (SGLang's default 128): how often decode frees the window's tail

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
        lows = {"max_running_requests": 1, "max_prefill_tokens": 1, "capacity": 8, "context_length": 16,
                "swa_eviction_interval": 1}
        for name, low in lows.items():
            if getattr(out, name) < low:
                raise ValueError(f"scheduler config field {name} must be >= {low}, got {getattr(out, name)}")
        if not 0.0 <= out.swa_full_tokens_ratio <= 1.0:
            raise ValueError("scheduler config field swa_full_tokens_ratio must be in [0, 1] (0: the server's sizing)")
        if out.chunked_prefill_size == 0 or out.chunked_prefill_size < -1:
            raise ValueError("scheduler config field chunked_prefill_size must be -1 (off) or >= 1")
        return out


def all_swa(lay: Any) -> bool:
    """A model whose every layer is sliding-window attention (no full-attention pool)."""
    return "swa" in lay.components and "full" not in lay.components


def model_gap(lay: Any) -> str | None:
    """Why the installed release's server cannot serve the layout's model at all (None: it can):
    an all-sliding-window model needs `PureSWATokenToKVPoolAllocator` (0.5.15+), at page 1."""
    if not all_swa(lay):
        return None
    from ..install import sglang_version
    try:
        from sglang.srt.mem_cache.allocator.swa import PureSWATokenToKVPoolAllocator  # noqa: F401
    except ImportError:
        return (f"sglang {sglang_version()} serves no all-sliding-window model (its PureSWATokenToKVPoolAllocator "
                "and PureSWARadixCache came in 0.5.15)")
    if lay.page_size != 1:
        return f"an all-sliding-window model is served at page 1 (SGLang's allocator asserts it), not {lay.page_size}"
    return None


def swa_pool_size(cfg: SchedConfig, lay: Any) -> int:
    """The SWA pool as SGLang's pool configurator sizes it. An all-SWA model: the whole pool
    (`_solve_pool_sizes`: no full pool, no ratio). An operator's `--swa-full-tokens-ratio`:
    that share of the full pool, page-aligned, which the server accepts while it exceeds a window
    and a page (`validate_swa_pool_size`; `pool_too_small` says so), even below one prefill chunk.
    Otherwise `swa_full_tokens_ratio` (0.8) of the full pool, and never below what its request-cap
    configurator reserves (one prefill chunk in flight, a window and a page per running request, a
    page)."""
    w, ps = lay.window or 0, lay.page_size
    if all_swa(lay):
        return cfg.capacity // ps * ps
    if cfg.swa_full_tokens_ratio > 0:
        return int(cfg.capacity * cfg.swa_full_tokens_ratio) // ps * ps
    chunk = cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else cfg.context_length
    cap = chunk + cfg.max_running_requests * (w + ps) + ps
    return max(int(cfg.capacity * 0.8), cap, 2 * w)


def pool_too_small(cfg: SchedConfig, lay: Any) -> str | None:
    """Why SGLang's server refuses this SWA pool at start (0.5.23 `validate_swa_pool_size`:
    it cannot hold one request), None where it accepts it."""
    if "swa" not in lay.components or not lay.window:
        return None
    size = swa_pool_size(cfg, lay)
    if lay.window + lay.page_size >= size:
        return (f"an SWA pool of {size} slots cannot hold one request (window {lay.window} + page "
                f"{lay.page_size}): SGLang's server refuses it at start")
    if all_swa(lay) and cfg.swa_full_tokens_ratio > 0:
        return "an all-sliding-window model has no full pool: swa_full_tokens_ratio does not apply (0)"
    return None
