"""Standalone reproducer (SGLang's own classes only, CPU): UnifiedRadixCache FULL+SWA frees the
full KV of a node that a running request holds, when an insert recovers that node's SWA
tombstone (0.5.11-0.5.12: SWAComponent.update_component_on_insert_overlap, branch 1, frees the
node's full value and replaces it; it asserts the SWA lock_ref is 0 but not the FULL one).
A request's SWA lock covers only the last W positions of its prefix, so an older node on its
path can be SWA-tombstoned while its full KV is locked; the recovery then frees slots the
request's req_to_token row still reads. Fixed upstream by sgl-project/sglang#29352 ("skip swa
recovery on locked full kv"; 0.5.23 emits RecoverSWAWithLockedFull instead).

    PYTHONPATH=. DIR/bin/python docs/repro/sglang_unified_swa_recover_frees_locked_full.py
    # exit 1: reproduced (0.5.11, 0.5.12), 0: not (0.5.23)
"""
import inspect
import sys
from array import array

import torch


def main() -> int:
    import importlib
    try:        # only the import chain's CPU stand-ins (torchvision users), where kvcheck is on the path
        from kvcheck.engines.sglang.install import _idempotent_autoconfig_register, install_cpu_stubs
        install_cpu_stubs()
        with _idempotent_autoconfig_register():
            import sglang.srt.mem_cache.unified_radix_cache  # noqa: F401
    except ImportError:
        pass
    from sglang.srt.mem_cache import base_prefix_cache as bpc
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    def first(name, *mods):
        for m in mods:
            try:
                return getattr(importlib.import_module(m), name)
            except (ImportError, AttributeError):
                pass
        raise ImportError(name)

    def kw(fn, **k):
        ps = inspect.signature(fn).parameters
        return {a: b for a, b in k.items() if a in ps}

    CT = first("ComponentType", "sglang.srt.mem_cache.unified_cache.component_type",
               "sglang.srt.mem_cache.unified_cache_components")
    Pool = first("SWAKVPool", "sglang.srt.mem_cache.swa_memory_pool", "sglang.srt.mem_cache.memory_pool")
    Alloc = first("SWATokenToKVPoolAllocator", "sglang.srt.mem_cache.allocator.swa",
                  "sglang.srt.mem_cache.swa_memory_pool")
    pool = Pool(**kw(Pool.__init__, size=64, size_swa=32, page_size=1, dtype=torch.float16, head_num=1, head_dim=2,
                     swa_attention_layer_ids=[0], full_attention_layer_ids=[1], enable_kvcache_transpose=False,
                     device="cpu"))
    alloc = Alloc(**kw(Alloc.__init__, size=64, size_swa=32, page_size=1, dtype=torch.float16, device="cpu",
                       kvcache=pool, need_sort=False))
    fields = {f.name for f in __import__("dataclasses").fields(CacheInitParams)}
    p = dict(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1,
             tree_components=(CT.FULL, CT.SWA), sliding_window_size=4, tree_core_backend="python")
    cache = UnifiedRadixCache(CacheInitParams(**{k: v for k, v in p.items() if k in fields}))
    key = lambda t: RadixKey(array("q", t))
    ins = lambda t: cache.insert(bpc.InsertParams(key=key(t), value=alloc.alloc(len(t)), prev_prefix_len=0))

    ins([1, 2, 3, 4, 5, 6, 7, 8, 9])
    ins([1, 2, 3, 4, 5, 0, 0, 0, 0])               # splits: [1..5] -> {[6..9], [0,0,0,0]}
    m = cache.match_prefix(bpc.MatchPrefixParams(key=key([1, 2, 3, 4, 5, 6, 7, 8, 9])))
    held = (m.device_indices if hasattr(m, "device_indices")
            else cache.path_device_indices(m.last_device_node)).tolist()
    cache.inc_lock_ref(m.last_device_node)          # a running request holds [0, 9): full on both nodes,
    # SWA only on [6..9] (the window, W = 4); now evict SWA: [0,0,0,0] goes, [1..5] is tombstoned
    cache.evict(bpc.EvictParams(num_tokens=0, swa_num_tokens=9))
    ins([1, 2, 3, 4, 5, 7, 7])                      # overlaps the tombstone [1..5] with live SWA: recovery
    a = alloc.full_attn_allocator
    free = {int(x) for t in (a.free_pages, a.release_pages) if t is not None for x in t.tolist()}
    lost = [s for s in held if s in free]
    print(f"held request's prefix slots {held}; freed while it holds the lock: {lost}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
