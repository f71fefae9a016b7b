"""SGLang's HiRadixCache (a device tier written through to a host tier, loaded back) on CPU.

The device pool is a real `MHATokenToKVPool` and the host pool a real `MHATokenToKVPoolHost`
(layer-first, `io_backend="direct"`); SGLang's `HiCacheController` moves the bytes. CPU stand-ins
(KVCHECK_CPU_STUB, installed on SGLang's modules for this process only): host-memory registration
(nothing to pin on CPU), streams and events (work on a side stream is queued and runs when the
device "progresses" or when someone waits on its event, so transfers are really asynchronous to
the scheduler), and the direct transfer kernel (`transfer_kv_direct` as torch indexing). Where the
release's controller moves the bytes on threads of its own (0.4.10-0.5.1), kvcheck holds those
threads and steps SGLang's own thread functions where they would block (hicache_thread.py). The
controller's group is a single-process gloo group. The adapter writes a fingerprint of each
position's prefix into the device KV; every check reads bytes: a write-through is acknowledged
(`ongoing_write_through` released) only when the host copy holds the node's bytes (the spec's
host copy, `on_disk`), and a hit served from host reads only loaded, verified bytes.
"""
from __future__ import annotations

from typing import Any

from .adapter import SglangAdapter
from kvcheck.fuzz.boundary import CannotDrive

from .compat import has_params, new_allocator
from .checks import (Req, Violation, ints, slots_of, tokens_of)
from .hicache_cpu import (CPU_DEVICE, install_hicache_stand_ins, in_flight_loads, in_flight_writes, old_keywords,
                          published_settings, server_args)
from .hicache_thread import THREADS
from .layouts import FAULTS
from .mamba import fingerprint


class HiCacheAdapter(SglangAdapter):
    """SglangAdapter for HiRadixCache: write-through on insert, device eviction of backed-up
    nodes, load-back on a host hit; checks on the bytes of both tiers."""

    def reset(self, cfg: Any = None) -> None:
        from collections import Counter

        import torch
        import torch.distributed as dist
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        from .install import cache_class, load
        S = load()
        from sglang.srt.managers import cache_controller as cc
        THREADS.reset()                 # the last cache's held threads (if any) unwind
        install_hicache_stand_ins()
        if hasattr(cc.HiCacheController, "write_thread_func_direct"):
            # before 0.5.2 the controller writes through and loads back on threads of its own
            # (set_stream, synchronize): kvcheck holds them and steps SGLang's own thread functions
            THREADS.install(cc)
        import logging        # a refused load-back is an expected outcome here, not a warning to print
        log = logging.getLogger("sglang.srt.mem_cache.hiradix_cache")
        if log.level != logging.ERROR:          # (setLevel clears every logger's cache: once)
            log.setLevel(logging.ERROR)
        CPU_DEVICE.streams.clear()
        self.S, self.torch = S, torch
        self.params_api = hasattr(S["bpc"], "MatchPrefixParams")     # 0.5.12: *Params objects
        self.kv = MHATokenToKVPool(size=self.capacity, page_size=1, dtype=torch.float32, head_num=1, head_dim=1,
                                   layer_num=2, device="cpu", enable_memory_saver=False)
        self.alloc = new_allocator(S["allocator"].TokenToKVPoolAllocator, self.capacity, torch.float32, "cpu", self.kv)
        cls, sa = cache_class(self.lay.cls), server_args(2.0)
        with published_settings(sa):        # releases that read them from the runtime context's bags
            if S["CacheInitParams"] is not None:
                params = S["CacheInitParams"](disable=False, req_to_token_pool=None, page_size=1,
                                              token_to_kv_pool_allocator=self.alloc, tp_cache_group=dist.group.WORLD)
                self.cache = cls(params, sa)
            else:               # releases before CacheInitParams: the same settings as keywords
                self.cache = cls(**old_keywords(cls, self.alloc, dist.group.WORLD, sa))
        if THREADS.unknown():
            raise CannotDrive("sglang", S["version"], "HiCacheController started threads kvcheck does not know "
                              f"how to step: {', '.join(THREADS.unknown())}",
                              "kvcheck/engines/sglang/hicache_thread.py (ROLES)")
        THREADS.run()                   # the controller's threads start: each runs until it waits for a job
        self.cache.load_back_threshold = 1          # SGLang's 10 would skip every short host hit here
        self.host = self.cache.token_to_kv_pool_host
        self.reqs: dict[str, Req] = {}
        self.written: dict[int, tuple[int, ...]] = {}
        self.twin: set[tuple[int, ...]] = set()
        self.coverage, self.lost, self.hits, self.next_id = Counter(), [], 0, 0
        self.broken, self._inserts, self._host_len, self._refused = None, 0, 0, False
        self._held: set[tuple[int, ...]] = set()
        self._plant()
        if self.fault == "write_through_ack_early":
            real = self.cache.write_backup

            def write_backup(node: Any, write_back: bool = False) -> Any:
                out = real(node, write_back)
                if self.cache.ongoing_write_through.pop(node.id, None) is not None:
                    self.cache.dec_lock_ref(node)     # acknowledged before the copy ran
                return out
            self.cache.write_backup = write_backup

    # ---- bytes ----------------------------------------------------------------------------
    def _write(self, req: Req, p: int, slot: int) -> None:
        prefix = tuple(req.tokens[:p + 1])
        self.written[slot] = prefix
        for buf in self.kv.k_buffer + self.kv.v_buffer:
            buf[slot] = fingerprint(prefix)

    def _snap(self) -> None:
        """Read both tiers' bytes once per check (one value per slot per buffer)."""
        self._dev = [b[:, 0, 0].tolist() for b in self.kv.k_buffer + self.kv.v_buffer]
        h = self.host.kv_buffer
        self._hst = [h[i, j, :, 0, 0].tolist() for i in range(h.shape[0]) for j in range(h.shape[1])]

    def _device_holds(self, slot: int, prefix: tuple[int, ...]) -> bool:
        f = fingerprint(prefix)
        return all(row[slot] == f for row in self._dev)

    def _host_holds(self, slot: int, prefix: tuple[int, ...]) -> bool:
        f = fingerprint(prefix)
        return all(row[slot] == f for row in self._hst)

    # ---- the scheduler's loop ---------------------------------------------------------------
    def apply(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        CPU_DEVICE.progress()                       # the device ran since the last step
        THREADS.settle()                            # (and the controller's own threads, where it has them)
        try:
            self.cache.check_hicache_events()       # acknowledgements: writes, then loads
        except AssertionError as e:
            self.broken = self.engine_raised(e)
            return {}
        return super().apply(action, params)

    def _match(self, tokens: list[int]) -> tuple[int, Any]:
        c = self.cache
        bpc = self.S["bpc"]
        m = c.match_prefix(bpc.MatchPrefixParams(key=self._key(tokens)) if self.params_api else self._key(tokens))
        hit, node = len(m.device_indices), m.last_device_node
        self._host_len, self._refused = m.host_hit_length, False
        if m.host_hit_length > 0:
            if has_params("InitLoadBackParams"):
                field = ("best_match_node" if "best_match_node" in getattr(bpc.InitLoadBackParams,
                                                                               "__dataclass_fields__", {})
                         else "last_host_node")         # 0.5.10-0.5.11 name it last_host_node
                loaded, node2 = c.init_load_back(bpc.InitLoadBackParams(**{field: m.last_host_node},
                                                                        host_hit_length=m.host_hit_length))
            else:
                loaded, node2 = c.init_load_back(m.last_host_node, m.host_hit_length)
            self._refused = not len(loaded)          # no device room: a shorter hit is legitimate
            if len(loaded):
                c.cache_controller.layer_done_counter.set_consumer(c.ready_to_load_host_cache())
                THREADS.run()       # a load thread woken by that runs until it waits on the device
                self.coverage["state:loaded_back"] += 1
                if not self.planted(FAULTS["load_back_before_copy"]):
                    for i in range(self.kv.layer_num):     # the forward waits for each layer's load
                        c.cache_controller.layer_done_counter.wait_until(i)
                hit, node = hit + len(loaded), node2
        if self.planted(FAULTS["match_overreach"]) and hit:
            hit += 1
        return hit, node

    def check_hit(self, req: Req, hit: int, path: list[int]) -> None:
        """The hit's path is on device and every slot holds its prefix's bytes (a load-back
        must have completed before the hit is served)."""
        if len(path) != hit or hit > len(req.tokens) - 1:
            raise Violation("safety", "hit_sound", f"{req.rid}: match says {hit} tokens, its path holds {len(path)}")
        free = set(self.free_slots())
        self._snap()
        for p in range(hit):
            if path[p] in free or not self._device_holds(path[p], tuple(req.tokens[:p + 1])):
                check = "load_back_verified" if self._host_len else "hit_sound_full"
                raise Violation("safety", check, f"{req.rid}: hit {hit} reads position {p} from device slot "
                                f"{path[p]}, whose bytes are not its prefix's (host part {self._host_len})")

    def twin_hit(self, tokens: list[int]) -> int:
        return 0 if self._refused else super().twin_hit(tokens)

    def _cache_evict(self, n: int, swa: int | None = None) -> int:
        before = self.alloc.available_size()
        locked = [x for x, _ in self.tree() if x.lock_ref > 0 and x.value is not None]
        self.cache.evict(self.S["bpc"].EvictParams(num_tokens=n) if has_params("EvictParams") else n)
        if any(x.value is None for x in locked):
            raise Violation("bookkeeping", "no_evict_locked", f"evict({n}) dropped a locked node's device copy")
        self.coverage["state:device_evicted"] += any(x.value is None for x, _ in self.tree())
        return self.alloc.available_size() - before

    def _a_finish(self, r: str) -> dict:
        before = len(self.cache.ongoing_write_through)
        out = super()._a_finish(r)
        self.coverage["state:written_through"] += len(self.cache.ongoing_write_through) > before
        return out

    # ---- checks ---------------------------------------------------------------------------
    def tree_prefixes(self, nodes: list | None = None) -> set[tuple[int, ...]]:
        """Prefixes the tree holds on device or host."""
        out: set[tuple[int, ...]] = set()
        for node, path in self.tree() if nodes is None else nodes:
            full = self.prefix_of(path, node.key, tokens_of)
            out.update(self.conv(full, lambda f, n=len(path): [f[:end] for end in range(n + 1, len(f) + 1)]))
        return out

    def snapshot(self) -> dict[str, list]:
        """What dirties a slot: device (free, prefix written, bytes), host (free, bytes)."""
        self._snap()
        return {"dev": [frozenset(self.free_slots()), dict(self.written), *self._dev],
                "host": [frozenset(ints([self.host.free_slots])), *self._hst]}

    def path_slots(self, node: Any) -> list[int]:
        vals = []
        while node is not self.cache.root_node:
            vals.append([] if node.value is None else [int(v) for v in node.value.tolist()])
            node = node.parent
        return [v for part in reversed(vals) for v in part]

    def check_state(self, inc: Any = None) -> None:
        c, nodes = self.cache, self.walk(inc, self.tree)
        if inc is None:
            self._snap()                        # (the incremental check's snapshot read them)
        now = self.tree_prefixes(nodes)         # what the tree dropped (host eviction) is not lost reuse
        self.twin -= self._held - now
        self._held = now
        holders: dict[int, int] = {}
        root = c.root_node
        starts = [r.node for r in self.reqs.values() if r.state == "running"]
        flight = in_flight_writes(c)
        starts += [lock for lock, _ in flight] + in_flight_loads(c)
        unacked = {id(n) for _, nodes in flight for n in nodes}
        for n in starts:
            while n is not root:
                if n.parent is None or not any(x is n for x in n.parent.children.values()):
                    raise Violation("bookkeeping", "no_evict_locked", "a node held by a request or an in-flight "
                                    "transfer is no longer in the tree")
                holders[id(n)] = holders.get(id(n), 0) + 1
                n = n.parent
        pending = any(s.queue for s in CPU_DEVICE.streams)      # a load whose bytes are still in flight
        loading = {id(a) for x in in_flight_loads(c) for a in self._ancestors(x)} if pending else set()
        dev_free, host_free = set(self.free_slots()), set(ints([self.host.free_slots]))
        dev_owned, host_owned, total, prot = [], [], 0, 0
        for node, path in nodes:
            if node.lock_ref != holders.get(id(node), 0):
                raise Violation("bookkeeping", "lock_ref_equals_holders", f"node at depth {len(path)} has lock_ref "
                                f"{node.lock_ref}, holders (requests + in-flight transfers) {holders.get(id(node), 0)}")
            dv, hv = self.conv(node.value, slots_of), self.conv(node.host_value, slots_of)
            acked = id(node) not in unacked
            if inc is not None and inc.clean(node, (id(path), id(node.key), id(node.value), id(node.host_value), acked,
                                                    id(node) in loading), dev=dv, host=hv):
                if dv is not None:          # as at the last check, and no slot of it changed
                    prot += len(dv) if node.lock_ref else 0
                    total += len(dv)
                    dev_owned += dv
                host_owned += hv or ()
                continue
            toks = self.prefix_of(path, node.key, tokens_of)
            if node.value is not None:
                if node.lock_ref:
                    prot += len(dv)
                total += len(dv)
                for i, s in enumerate(dv):
                    dev_owned.append(s)
                    p = len(path) + i
                    if s in dev_free:
                        raise Violation("bookkeeping", "tree_slots_live", f"tree position {p} is in free slot {s}")
                    if id(node) not in loading and not self._device_holds(s, toks[:p + 1]):
                        raise Violation("bookkeeping", "tree_content_matches", f"tree position {p}: device slot {s} "
                                        "does not hold its prefix's bytes")
            elif node.host_value is None:
                raise Violation("bookkeeping", "no_evict_locked", f"node at depth {len(path)} is on neither tier")
            if node.host_value is not None:
                host_owned += hv
                for i, s in enumerate(hv):
                    if s in host_free:
                        raise Violation("bookkeeping", "write_through_acknowledged", f"node at depth {len(path)}: "
                                        f"host slot {s} is free")
                    if acked and not self._host_holds(s, toks[:len(path) + i + 1]):
                        raise Violation("bookkeeping", "write_through_acknowledged", f"node at depth {len(path)}: the "
                                        f"write-through is acknowledged but host slot {s} lacks position "
                                        f"{len(path) + i}'s bytes")
        if (c.evictable_size(), c.protected_size()) != (total - prot, prot):
            raise Violation("bookkeeping", "size_accounting", f"evictable {c.evictable_size()} / protected "
                            f"{c.protected_size()}, the device tree has {total - prot} / {prot}")
        dev_owned += [s for r in self.reqs.values() if r.state == "running" for s in r.slots[r.hit:]]
        for name, owned, free, every in (("device", dev_owned, dev_free, self.all_slots()),
                                         ("host", host_owned, host_free, set(range(self.host.size)))):
            seen = owned + sorted(free)
            if len(seen) != len(set(seen)) or set(seen) != every:
                raise Violation("bookkeeping", "size_accounting", f"{name}: {len(owned)} owned + {len(free)} free of "
                                f"{len(every)}: {len(seen) - len(set(seen))} counted twice, "
                                f"{len(every - set(seen))} leaked")

    def _ancestors(self, n: Any) -> list:
        out = []
        while n is not self.cache.root_node:
            out.append(n)
            n = n.parent
        return out

    def _holds(self) -> Any:
        """The scheduler path's row check (sched.py) reads device bytes: a load-back
        writes the bytes of the slots it fills, not the adapter's shadow."""
        self._snap()
        return self._device_holds
