"""Which planted faults a vLLM layout can take (one line when it cannot) and how the manager-level
ones are planted into a fresh manager (the declarations themselves: layouts.py, ENGINE_FAULTS)."""
from __future__ import annotations

from typing import Any

from . import mamba
from . import mamba_faults as mfaults
from .connector import supported as supported_by_connector
from .layouts import (CONNECTOR_CACHE_EARLY, EAGLE, EVICT_KEEPS_HASH, MAMBA_ACCEPT_IGNORED, MAMBA_FAULTS,
                      RETENTION_DROPS_TAIL, SWA_FAULTS, SWA_OVERSTRICT, layout_scale, release_gap, vllm_modules)


def refusal(layout: str, groups: list, fault: str | None, twin_oracle: bool) -> str | None:
    """Why `fault` cannot be planted on `layout` (None: it can)."""
    if any(f.name == fault for f in SWA_FAULTS) and not any(k in ("swa", "swa_mla") for k, _, _ in groups):
        return f"fault {fault!r} needs a layout with a sliding-window group"
    why = mfaults.needs(groups, layout_scale(layout)[0], fault)
    if why:
        return why
    if fault == CONNECTOR_CACHE_EARLY.name and supported_by_connector(groups) is not None:
        return (f"fault {fault!r} needs a layout the KV connector serves (one group, e.g. full, deepseek-v3; or "
                f"full and sliding-window groups on vLLM 0.18+): {supported_by_connector(groups)}")
    if fault == MAMBA_ACCEPT_IGNORED.name and (layout not in EAGLE or not any(k == mamba.MAMBA for k, _, _ in groups)):
        return f"fault {fault!r} needs a layout with Mamba groups and a drafter (e.g. qwen3-next+mtp)"
    if fault == RETENTION_DROPS_TAIL.name and not twin_oracle:
        return "fault 'retention_drops_tail' is planted and caught by the dense-twin adapter (vllm_twin.TwinAdapter) only"
    return release_gap(layout, fault) or None


def plant(ad: Any) -> None:
    """Plant the adapter's manager-level fault (Mamba, sliding window, eviction) into its fresh manager."""
    if any(ad.planted(x) for x in MAMBA_FAULTS):
        mfaults.plant(ad, vllm_modules()["stm"])
    if any(ad.planted(x) for x in SWA_FAULTS):
        SWM = vllm_modules()["stm"].SlidingWindowManager
        extra = 1 if ad.planted(SWA_OVERSTRICT) else None

        class FaultySWA(SWM):  # type: ignore[misc, valid-type]
            @classmethod
            def _contiguous_blocks_for_hit(cls, window_size, block_size, use_eagle):
                if extra is None:
                    return 1
                return super()._contiguous_blocks_for_hit(window_size, block_size, use_eagle) + extra

        groups = getattr(ad.coord, "attention_groups", None)
        if groups is None:
            raise ValueError(f"fault {ad.fault!r} needs a hybrid layout")
        ad.coord.attention_groups = [g._replace(manager_cls=FaultySWA) if issubclass(g.manager_cls, SWM) else g
                                     for g in groups]
    elif ad.planted(EVICT_KEEPS_HASH):
        pool = ad.pool

        def keep_map_entry(block: Any) -> bool:   # forget the block's hash, keep the map entry
            getattr(pool, "cached_block_hashes_by_block", {}).pop(block.block_id, None)
            block.reset_hash()
            return False

        pool._maybe_evict_cached_block = keep_map_entry
