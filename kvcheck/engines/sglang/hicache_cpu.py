"""HiRadixCache's CPU stand-ins (KVCHECK_CPU_STUB, installed on SGLang's modules for this
process only) and the release differences of its construction: streams and events (work on a
side stream is queued and runs when the device "progresses" or when someone waits on its
event; the current stream is per thread), the direct transfer kernel as torch indexing,
host-memory registration and pinning (nothing to pin on CPU), the server args it reads, its
keyword constructor before CacheInitParams, and the two shapes of a write-through (and of a
load-back) in flight."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from kvcheck.fuzz.boundary import StandIn


# ---- KVCHECK_CPU_STUB: streams, events, transfer kernel, host registration ------------------
class _CpuStream:
    """A stream whose work is queued until it progresses (or an event on it is waited for)."""

    def __init__(self, *a: Any, **k: Any) -> None:
        self.queue: list[Any] = []

    def run(self, upto: Any = None) -> None:
        while self.queue:
            fn = self.queue.pop(0)
            fn()
            if upto is not None and fn is upto:
                return

    def wait_event(self, ev: "_CpuEvent") -> None:
        ev.synchronize()

    def synchronize(self) -> None:
        """The host waits for the stream: its work runs now; on one of SGLang's own transfer threads
        kvcheck holds (hicache_thread.py), that thread blocks until the device ran it."""
        if CPU_DEVICE.thread_sync is not None and CPU_DEVICE.thread_sync(self):
            return
        self.run()


class _CpuEvent:
    def __init__(self, *a: Any, **k: Any) -> None:
        self.done, self.stream, self.mark = True, None, None

    def record(self, stream: Any = None) -> None:
        s = stream or CPU_DEVICE.current
        if s is CPU_DEVICE.default:
            self.done = True
            return
        self.done, self.stream = False, s

        def mark() -> None:
            self.done = True
        self.mark = mark
        s.queue.append(mark)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done and self.stream is not None:
            self.stream.run(upto=self.mark)

    def wait(self, stream: Any = None) -> None:
        self.synchronize()

    def elapsed_time(self, end: "_CpuEvent") -> float:
        """A timing event's reading (SGLang's transfer metrics, 0.5.18+, with metrics on): the CPU
        device has no clock for queued work; 0 ms once both events completed, as CUDA requires."""
        if not (self.done and end.done):
            raise RuntimeError("elapsed_time on an event that has not completed")
        return 0.0


class _CpuDevice:
    """Stands for SGLang's `device_module` (torch.cuda): Stream, Event, stream(), current_stream(),
    set_stream(). The current stream is per thread, as CUDA's is (a controller's own thread sets
    its side stream for itself: set_stream, 0.4.10-0.5.1)."""

    Stream, Event = _CpuStream, _CpuEvent

    def __init__(self) -> None:
        import threading
        self.default = _CpuStream()
        self._tls = threading.local()
        self.streams: list[_CpuStream] = []
        self.thread_sync: Any = None        # hicache_thread's hook: a held thread's stream.synchronize()

    @property
    def current(self) -> _CpuStream:
        return getattr(self._tls, "stream", self.default)

    @current.setter
    def current(self, s: _CpuStream) -> None:
        self._tls.stream = s

    @contextmanager
    def stream(self, s: _CpuStream) -> Any:
        prev, self.current = self.current, s
        if s not in self.streams:
            self.streams.append(s)
        try:
            yield
        finally:
            self.current = prev

    def set_stream(self, s: _CpuStream) -> None:
        if s not in self.streams:
            self.streams.append(s)
        self.current = s

    def current_stream(self) -> _CpuStream:
        return self.current

    def progress(self) -> None:
        for s in self.streams:
            s.run()


CPU_DEVICE = _CpuDevice()


def transfer_kv_direct(src_layers: list, dst_layers: list, src_indices: Any, dst_indices: Any,
                       page_size: int = 1) -> None:
    """KVCHECK_CPU_STUB for sgl_kernel's direct transfer: runs on the current stream, in order."""
    src_i, dst_i = src_indices.clone(), dst_indices.clone()

    def copy() -> None:
        for s, d in zip(src_layers, dst_layers):
            d[dst_i] = s[src_i]
    s = CPU_DEVICE.current
    copy() if s is CPU_DEVICE.default else s.queue.append(copy)


def _host_alloc(dims: Any, dtype: Any, device: str, pin_memory: bool = False, allocator: Any = None,
                registration_granularity_bytes: int | None = None) -> Any:
    """KVCHECK_CPU_STUB for host-memory registration (`alloc_with_host_register`): nothing to
    register on CPU (0.5.6 passes no allocator: plain memory). It takes what the real one takes:
    0.5.19+ pass `registration_granularity_bytes`, the chunking of cudaHostRegister (no bearing on
    the buffer's shape or bytes), which has nothing to chunk here."""
    if allocator is None:
        import torch
        return torch.empty(dims, dtype=dtype, device=device)
    return allocator.allocate(dims, dtype=dtype, device=device)


class _CudaOnCpu:
    """`torch.cuda` for those modules: the CPU device's streams and events, and a `cudart()` whose
    host registration (pinning a host buffer for DMA) has nothing to do on CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(CPU_DEVICE, name)

    def cudart(self) -> Any:
        return _NoHostRegister()


class _NoHostRegister:
    def cudaHostRegister(self, *a: Any) -> int:        # noqa: N802 - CUDA's name
        return 0

    def cudaHostUnregister(self, *a: Any) -> int:      # noqa: N802
        return 0


class _TorchUnpinned:
    """KVCHECK_CPU_STUB: `torch` as the HiCache modules of releases before ALLOC_MEMORY_FUNCS and
    `device_module` see it: `empty(pin_memory=True)` allocates plain memory (a CPU-only torch has
    no pinned allocator; pinning only speeds a GPU's DMA, which the CPU stand-in copy has not),
    and `torch.cuda` (their streams and events, used directly) is the CPU device below."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self.cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def empty(self, *a: Any, **k: Any) -> Any:
        k.pop("pin_memory", None)
        return self._torch.empty(*a, **k)


def install_hicache_stand_ins() -> None:
    import torch.distributed as dist
    from sglang.srt.managers import cache_controller as cc
    from sglang.srt.mem_cache import memory_pool_host as mph
    cc.device_module = CPU_DEVICE
    mph.transfer_kv_direct = transfer_kv_direct
    import importlib
    try:        # 0.5.18+: the controller's transfers run in L2TransferEngine, on its own module's
        #         streams and events (torch.cpu's here: synchronous, a premature ack never visible)
        importlib.import_module("sglang.srt.mem_cache.l2_transfer").device_module = CPU_DEVICE
    except ImportError:
        pass
    for name in ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mla"):
        try:                    # 0.5.16+: the host pools moved to pool_host/ (each imports the kernel)
            importlib.import_module(name).transfer_kv_direct = transfer_kv_direct
        except ImportError:
            pass
    if hasattr(mph, "ALLOC_MEMORY_FUNCS"):       # releases that register host memory through it
        mph.ALLOC_MEMORY_FUNCS["cpu"] = _host_alloc
    else:                       # older ones pin it with torch.empty(pin_memory=True), use torch.cuda
        for mod in (mph, cc):
            if not isinstance(mod.torch, _TorchUnpinned):
                mod.torch = _TorchUnpinned(mod.torch)
    if not dist.is_initialized():
        import os
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)


def in_flight_writes(cache: Any) -> list[tuple[Any, list[Any]]]:
    """(the node a write-through locks, the nodes whose host copy awaits its acknowledgement) for
    each write in flight: SGLang keeps the node itself (0.4.10-0.5.12), or (lock node, length,
    nodes published on the ack) where a split can move the ack to the new nodes (0.5.14)."""
    out = []
    for v in cache.ongoing_write_through.values():
        out.append((v[0], list(v[2])) if isinstance(v, tuple) else (v, [v]))
    return out


def in_flight_loads(cache: Any) -> list[Any]:
    """The node each load-back in flight locks: SGLang keeps it (0.5.2+), or (the ancestor it
    loads below, that node) (0.4.10-0.5.1)."""
    return [v[1] if isinstance(v, tuple) else v for v in cache.ongoing_load_back.values()]


def server_args(host_ratio: float) -> Any:
    """The server args HiRadixCache reads (write-through, direct IO, layer-first, no storage)."""
    return StandIn(hicache_io_backend="direct", hicache_mem_layout="layer_first", hicache_ratio=host_ratio,
                           hicache_size=0, hicache_storage_backend=None, hicache_write_policy="write_through",
                           hicache_storage_backend_extra_config=None, hicache_storage_prefetch_policy="best_effort",
                           served_model_name="kvcheck", extra_metric_labels=None,
                           disable_hicache_numa_detect=True)       # 0.5.8-0.5.9 (no NUMA on a CPU stand-in)


@contextmanager
def published_settings(sa: Any) -> Any:
    """While HiRadixCache is built, the runtime context's config bags hold the settings of `sa`.

    Releases with a runtime context (`get_memory()`: 0.5.18-0.5.20's HiRadixCache, and the host
    pool's `get_allocator_type`) read the HiCache settings (ratio, size, layout, IO backend, write
    policy, storage) from its "memory" bag, projected from the published ServerArgs, not from the
    server args passed to the constructor. Nothing published: the bag is missing ("config namespace
    'memory' not published"); an unresolved stand-in published (`set_server_args_stand_in`, the
    scheduler path's): `hicache_ratio` is None, which only ServerArgs' __post_init__ resolves to 2.0
    (the host pool's `device_pool.size * None`), and the layout and IO backend are SGLang's defaults
    (page_first, kernel), not the layer-first direct transfer the CPU stand-ins model. So each field
    of `sa` that the release routes to a bag (its own `namespace_of`, as `RuntimeContext.override`
    routes) is set there with the bag's scoped `override`, over SGLang's own test publish
    (`override_server_args`, a dummy ServerArgs) where no config is published. Both are undone
    when the construction ends (no read after it): the process's config is left as it was.
    Releases without config bags read `sa` itself: nothing to do."""
    from contextlib import ExitStack
    try:
        from sglang.srt import runtime_context as rc
        from sglang.srt.arg_groups.arg_utils import namespace_of
    except ImportError:
        rc = None
    ctx = rc.get_context() if rc is not None and hasattr(rc, "get_context") else None
    if ctx is None or not hasattr(ctx, "config_bag") or not hasattr(ctx, "override_server_args"):
        yield
        return
    with ExitStack() as stack:
        try:
            ctx.config_bag("memory")
        except ValueError:              # "config namespace 'memory' not published"
            stack.enter_context(ctx.override_server_args())
        routes: dict[str, dict[str, Any]] = {}
        for name, path in namespace_of(type(ctx.server_args)).items():
            if name in vars(sa):
                routes.setdefault(path, {})[name] = getattr(sa, name)
        for path, values in routes.items():
            top, *subs = path.split(".")
            bag = ctx.config_bag(top)
            for seg in subs:
                bag = getattr(bag, seg)
            stack.enter_context(bag.override(**values))
        yield


def old_keywords(cls: Any, alloc: Any, group: Any, sa: Any) -> dict[str, Any]:
    """HiRadixCache's keyword constructor (before CacheInitParams) from the same server args:
    each of its parameters named as the server arg it comes from, the others as below."""
    import inspect
    named = {"req_to_token_pool": None, "token_to_kv_pool_allocator": alloc, "tp_cache_group": group,
             "page_size": 1, "enable_metrics": False, "model_name": sa.served_model_name,
             "storage_backend_extra_config": sa.hicache_storage_backend_extra_config}
    out = {}
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.name in named:
            out[p.name] = named[p.name]
        elif hasattr(sa, p.name):
            out[p.name] = getattr(sa, p.name)
        elif p.default is inspect.Parameter.empty:
            raise TypeError(f"{cls.__name__}.__init__ takes {p.name!r}, which kvcheck does not know how to set")
    return out
