"""vLLM itself, imported lazily and once: the pieces of its KV cache manager the adapter uses,
the release's features, and a one-line reason when it cannot be used. Below every other module
of the engine (the layouts, the Mamba shadow and the checks all need it)."""
from __future__ import annotations

import os
from typing import Any

OLDEST, NEWEST = "0.14.1", "0.34.0"      # the releases tested (docs/adapters-vllm.md)
INSTALL_HINT = ("vLLM is not importable: install it with `bash scripts/install-vllm.sh [VERSION]` "
                "(pip install --no-deps vllm==VERSION + requirements-vllm.txt; torch is kept)")


from .release import (OPTIONAL_SPECS, REQUIRED_SPECS, fault_gap, layout_gap, release_features)


class VllmUnavailable(Exception):
    """vLLM cannot be imported (one-line install hint)."""


_V: dict[str, Any] = {}


def vllm_modules() -> dict[str, Any]:
    """Import the vLLM pieces lazily (about 8 s the first time)."""
    if _V:
        return _V
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # vLLM's own logging config writes to stdout, which would corrupt `--json`: leave logging
    # to Python's (errors on stderr) unless the user configured vLLM's.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import logging
    logging.getLogger("vllm").setLevel(logging.ERROR)
    try:
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1 import kv_cache_interface as kci
        from vllm.v1.core import kv_cache_utils as ku
        from vllm.v1.core import single_type_kv_cache_manager as stm
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.request import Request, RequestStatus
        missing = [n for n in REQUIRED_SPECS if not hasattr(kci, n)]
        if missing:
            raise ImportError(f"vllm.v1.kv_cache_interface has no {', '.join(missing)}")
    except Exception as e:  # ImportError, or a broken install
        raise VllmUnavailable(_why_unusable(e)) from None
    ku.init_none_hash(sha256)
    _V.update(torch=torch, version=vllm.__version__, SamplingParams=SamplingParams, sha256=sha256,
              ku=ku, stm=stm, KVCacheManager=KVCacheManager, Request=Request,
              RequestStatus=RequestStatus, features=release_features(kci, KVCacheManager, stm, Request))
    _V.update({n: getattr(kci, n, None) for n in REQUIRED_SPECS + OPTIONAL_SPECS})
    return _V


def _why_unusable(e: Exception) -> str:
    """One line: no vLLM at all, or which release is there and what it lacks."""
    import importlib.metadata
    try:
        found = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return f"{INSTALL_HINT} ({type(e).__name__}: {e})".splitlines()[0]
    return (f"vLLM {found} is installed but its v1 KV cache manager cannot be used here "
            f"({type(e).__name__}: {e}); supported: releases with the hybrid v1 manager, "
            f"{OLDEST}..{NEWEST} tested; `scripts/install-vllm.sh VERSION DIR` builds a side "
            "environment for one").splitlines()[0]


def vllm_version() -> str:
    return vllm_modules()["version"]


def map_blocks(m: Any, key: Any) -> list:
    """The blocks vLLM's prefix-cache map (``BlockHashToBlockMap``) holds under `key`, in every
    release's representation: a block or {block id: block} (0.14-0.33), a block id with the
    duplicates' ids apart (0.34: ``_cache`` / ``_dup_ids``, ids into ``_blocks``)."""
    val = m._cache.get(key)
    if val is None:
        return []
    if isinstance(val, int):
        dups = getattr(m, "_dup_ids", {}).get(key)
        return [m._blocks[i] for i in (dups if dups is not None else (val,))]
    return list(val.values()) if isinstance(val, dict) else [val]


def map_entries(m: Any) -> list[tuple[Any, Any]]:
    """Every (key, block) entry of the prefix-cache map (map_blocks, for every key)."""
    return [(key, b) for key in list(m._cache) for b in map_blocks(m, key)]
