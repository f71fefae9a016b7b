"""How kvcheck builds SGLang's HiRadixCache: the host tier is the one the adapter asks for (twice
the device pool, layer-first, direct IO) and every transfer stream is the CPU device stand-in's
(asynchronous to the scheduler), on every release that has the class. Releases whose HiRadixCache
reads these settings from the runtime context's config bags (`get_memory()`, 0.5.18-0.5.20) are
built with nothing published (a fresh process) and under an unresolved published config (whose
`hicache_ratio` is None: "int * NoneType" in the host pool before), and the process's config is
left as it was. Skipped where SGLang or the class is not importable.
"""
from __future__ import annotations

import pytest


def _build():
    from kvcheck.engines.sglang.install import SglangUnavailable, load
    from kvcheck.engines.sglang.layouts import list_layouts
    try:
        load()
    except SglangUnavailable as e:
        pytest.skip(str(e))
    rows = {r["name"]: r for r in list_layouts()}
    if not rows.get("hicache", {}).get("supported"):
        pytest.skip(f"layout hicache does not run on this release: {rows.get('hicache', {}).get('reason')}")
    from kvcheck.engines.sglang.hicache import HiCacheAdapter
    return HiCacheAdapter("hicache")


def _check_host_tier(a) -> None:
    from kvcheck.engines.sglang.hicache_cpu import _CpuStream
    h = a.cache.token_to_kv_pool_host
    assert (h.layout, a.cache.cache_controller.io_backend) == ("layer_first", "direct")
    # twice the device pool (ratio 2), aligned to a page (page 1): up (size // 1 + 1) where the
    # release aligns up, down (int(size * ratio) // page * page: 0.4.10-0.5.1) where it aligns down
    assert h.size in (a.kv.size * 2 + 1, a.kv.size * 2), (h.size, a.kv.size)
    owners = [a.cache.cache_controller, getattr(a.cache.cache_controller, "l2_transfer_engine", None)]
    streams = {n: v for o in owners if o is not None for n, v in vars(o).items()
               if n.endswith("_stream") and v is not None}     # (a load fence only a scheduler sets)
    assert streams and all(isinstance(s, _CpuStream) for s in streams.values()), streams


def _context():
    try:
        from sglang.srt import runtime_context as rc
    except ImportError:
        return None
    ctx = rc.get_context() if hasattr(rc, "get_context") else None
    return ctx if ctx is not None and hasattr(ctx, "config_bag") and hasattr(ctx, "override_server_args") else None


def _fresh_context(monkeypatch):
    """The release's runtime context (None without one) as a fresh process has it: no config
    projected yet (restored after the test); skipped where SGLang does not load."""
    from kvcheck.engines.sglang.install import SglangUnavailable, load
    try:
        load()
    except SglangUnavailable as e:
        pytest.skip(str(e))
    ctx = _context()
    if ctx is not None:
        monkeypatch.setattr(ctx, "_server_args", None)
        monkeypatch.setattr(ctx, "_config_bags", None)
    return ctx


def test_host_tier_with_nothing_published(monkeypatch):
    ctx = _fresh_context(monkeypatch)
    _check_host_tier(_build())
    if ctx is not None:
        with pytest.raises(ValueError):
            ctx.config_bag("memory")            # nothing left published


def test_host_tier_under_an_unresolved_config(monkeypatch):
    ctx = _fresh_context(monkeypatch)
    if ctx is None:
        pytest.skip("this release has no runtime-context config bags")
    from sglang.srt import server_args as sa
    from sglang.srt.runtime_context import get_memory

    from kvcheck.engines.sglang.mamba_state import unresolved
    ctx.set_server_args(unresolved(sa.ServerArgs, model_path="kvcheck-cpu-stand-in", device="cpu", page_size=1))
    before = dict(object.__getattribute__(get_memory(), "_fields"))
    # (the scheduler path's stand-in: 0.5.18-0.5.20 declare hicache_ratio None until __post_init__)
    _check_host_tier(_build())
    assert dict(object.__getattribute__(get_memory(), "_fields")) == before
