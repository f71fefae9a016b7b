"""Workload themes: weighted mixes of the spec's actions that the generators draw from.

Owns what "a workload" means for every generator that is not a plain uniform walk: `kvcheck
diff` draws one theme per scenario, the fuzz machine one per example (so that rare actions such
as version bumps come often enough, in some examples, to meet state worth making stale).
`BASE` is the everyday mix (requests build and reuse prefixes; disruptions are rare); a theme
overrides some weights of it.
"""
from __future__ import annotations

BASE = {"submit": 6, "lookup": 8, "bind": 8, "bind_stale": 3, "use": 8, "use_stale": 3, "append": 14,
        "finish": 6, "compress": 4, "indexer_sync": 4, "slide": 1, "preempt": 0.3, "resume": 1,
        "evict": 0.5, "migrate": 0.2, "offload_start": 0.3, "offload_ack": 1, "prefetch_start": 1,
        "prefetch_complete": 1, "verify_ok": 3, "checksum_fail": 3, "corrupt": 0.1,
        "bump_model": 0.05, "bump_compressor": 0.05, "bump_indexer": 0.05, "bump_abi": 0.05,
        "capture": 0.1, "release_graph": 0.5}
THEMES: dict[str, dict[str, float]] = {
    "shared_prefix": {},
    "interrupt_resume": {"preempt": 3, "resume": 4},
    "memory_pressure": {"evict": 5, "slide": 3, "migrate": 1},
    "offload_reload": {"offload_start": 4, "offload_ack": 6, "evict": 4, "prefetch_start": 10,
                       "prefetch_complete": 12, "verify_ok": 14, "checksum_fail": 14},
    "corrupted_files": {"offload_start": 4, "offload_ack": 6, "evict": 4, "prefetch_start": 10,
                        "prefetch_complete": 12, "corrupt": 3, "verify_ok": 14, "checksum_fail": 14},
    "version_bumps": {"bump_model": 1, "bump_compressor": 1.5, "bump_indexer": 1.5, "bump_abi": 1,
                      "offload_start": 1, "evict": 1.5, "prefetch_start": 2},
    "lookups_during_transfers": {"offload_start": 3, "prefetch_start": 4, "evict": 3, "lookup": 14,
                                 "offload_ack": 0.5, "prefetch_complete": 0.5},
    "graphs": {"capture": 4, "migrate": 3, "evict": 2, "release_graph": 0.5},
}


def weights(theme: str) -> dict[str, float]:
    """The action weights of a theme (actions not named weigh 1)."""
    return {**BASE, **THEMES[theme]}
