"""SGLang's `Scheduler` built on CPU, without its processes.

`Scheduler.__init__` launches the model worker, joins process groups, opens ZMQ sockets and
sizes the pools from GPU memory; none of that runs here. So the scheduler is built as
`CpuScheduler` (a subclass that adds nothing to SGLang's methods): the configuration is
published the way SGLang's own tests publish it (`runtime_context.override_server_args`, with
the episode's scheduling fields; before 0.5.16 a `ServerArgs` record, publish.py), the parallel ranks through `get_parallel().override`, and the
scheduler's own `init_*` methods build every component that runs on CPU (running status,
chunked prefill, schedule policy, metrics, overlap relay, beam coordinator, DP-attention adapter,
batch-result processor, grammar manager, invariant checker, ...). What a server's `__init__`
would take from the model worker (`get_worker_info`: token and request limits) is computed as
`TpModelWorker.get_worker_info` computes it.

Stand-ins, each because the real one needs what is not here:
* the model worker (`worker.py`): the GPU forward; the scheduler calls
  `model_worker.forward_batch_generation(batch)` exactly where it calls the real one;
* `tp_worker` / its `model_runner`: only the fields the scheduler reads off them (the attention
  backend's tile size, `prefill_aware_swa`, the n-gram embedding manager, which for a model
  without n-gram embeddings hands the batch back unchanged);
* process groups (`ONE_RANK`): a single rank; the grammar manager and DP adapter read sizes;
* observability sinks (`_Sink`: KV-event, load and output publishers, the profiler, the sockets
  to the tokenizer and detokenizer): they read no cache state and write none; the load
  inquirer's two figures are 0 (statistics only);
* two methods: `_record_step_counters` (step timing) and `maybe_send_health_check_signal`
  (a socket), no-ops.
A field older releases' `__init__` copies from the server args (`self.enable_dp_attention =
server_args.enable_dp_attention`) is read from the published server args when first asked for
(`COPIED` lists them). A release whose scheduler reads anything else off `CpuScheduler` raises
AttributeError on kvcheck's object: "cannot drive" (fuzz/boundary.py), never a finding about
SGLang. The attention backend published is `torch_native`, SGLang's CPU backend: where the
scheduler's path picks a kernel by backend (0.5.21's `write_cache_indices`: a Triton kernel for
Triton-capable backends) it takes the torch path a CPU server takes. A Triton kernel SGLang's code
launches anyway (0.5.15-0.5.21's paged allocator extends a request only through
`alloc_extend_kernel`) runs in Triton's own CPU interpreter (install.py sets TRITON_INTERPRET=1
before SGLang is imported); an exception raised inside Triton is "cannot drive" (adapter.py),
never a finding.
This builder follows Schedulers whose constructor is a sequence of `init_*` methods (0.5.7-0.5.23),
called in the order the release's own `__init__` calls them (`init_order`); publish.py says how each
release takes its configuration and ranks, `_inline_parts` builds what a release's `__init__`
builds inline (0.5.14's metrics, 0.5.7-0.5.13's rank fields and grammar manager), and the tree is
the one its server picks (the registry's factory 0.5.14+, `init_cache_with_memory_pool`'s choice
before). A Scheduler without that sequence is refused with one line (`gap()`; the cache-level drive
covers 0.4.10-0.5.6).
"""
from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from typing import Any

from kvcheck.fuzz.boundary import StandIn

from ..compat import new_allocator, row_pool, swa_pools
from ..install import SglangUnavailable, load, sglang_version
from .config import SchedConfig, all_swa, swa_pool_size
from .publish import ONE_RANK, bag, env_setting, init_args, model_dir, parallel_state, publish, set_env

# the Scheduler's own init methods that run on CPU, in the order its __init__ calls them
INITS = ("init_metrics_collector", "init_metrics", "init_running_status", "init_pool_stats_observer", "init_metrics_reporter",
         "maybe_init_rust_server", "init_disaggregation", "init_overlap", "init_chunked_prefill", "init_grammar_backend", "init_schedule_policy", "init_diffusion_llm",
         "init_dp_attn_adapter", "init_grammar_manager", "init_invariant_checker", "init_beam_coordinator",
         "init_batch_result_processor", "init_kv_event_lora_names", "init_idle_sleeper")
# the init methods every release kvcheck builds has (0.5.7+); gap() refuses a Scheduler without them
# an all-SWA model is served prefill-aware (its prompt kept whole through decode), as the one model
# SGLang serves with PureSWARadixCache is (UnlimitedOCR's `is_prefill_aware_swa`); False: a plain
# all-SWA model, whose finished requests PureSWARadixCache caches with the window they freed
# (docs/findings-sglang.md; a test keeps it so)
PREFILL_AWARE_ALL_SWA = True
# the trees the drive reads (tree.py), whichever the release's server builds
TREES = ("RadixCache", "UnifiedRadixCache", "SWARadixCache", "PureSWARadixCache", "ChunkCache")
SEQUENCE = ("init_running_status", "init_chunked_prefill", "init_schedule_policy", "init_overlap")
class _Sink:
    """An observability sink (metrics, KV events, load, output streaming, profiler): every call
    is accepted and answers None. These components read no cache state and write none."""
    enable_metrics = False
    num_retracted_reqs = 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: None


_CLS: dict[str, type] = {}
COPIED: set[str] = set()        # the server-args fields the scheduler read through the fallback


def _fields(obj: Any) -> tuple[str, ...]:
    """The declared fields of a ServerArgs (a msgspec Struct on 0.5.23, a dataclass before)."""
    t = type(obj)
    return getattr(t, "__struct_fields__", None) or tuple(getattr(t, "__dataclass_fields__", {}))


def gap(page_size: int = 1) -> str | None:
    """Why this release's scheduler cannot be built here for `page_size` (None: it can)."""
    load()                      # SGLang's import chain with kvcheck's CPU stand-ins first
    from packaging.version import Version
    if Version(sglang_version()) < Version("0.5.7"):     # (its scheduler module is not imported here)
        return (f"sglang {sglang_version()}: kvcheck's CPU builder follows Schedulers whose constructor is a "
                "sequence of init_* methods (0.5.7+); this release predates them: kvcheck's gap, not the "
                "release's (its cache-level layouts run here)")
    try:
        from sglang.srt.managers.scheduler import Scheduler
    except Exception as e:              # its import chain needs what this environment lacks
        return f"sglang {sglang_version()}: its scheduler does not import here: {type(e).__name__}: {e}"
    missing = [m for m in SEQUENCE if not callable(getattr(Scheduler, m, None))]
    if missing:
        return (f"sglang {sglang_version()}: kvcheck's CPU builder follows Schedulers whose constructor is a "
                f"sequence of init_* methods (0.5.7+); this one has no {', '.join(missing)}: kvcheck's gap, not "
                "the release's (its cache-level layouts run here)")
    return None


def scheduler_class() -> type:
    """`CpuScheduler`: SGLang's Scheduler with an empty constructor; a missing attribute is an
    AttributeError on kvcheck's object (cannot drive)."""
    if "cls" not in _CLS:
        try:
            from sglang.srt.managers.scheduler import Scheduler
        except Exception as e:          # its import chain needs what this environment lacks
            raise SglangUnavailable(f"sglang {sglang_version()}: its scheduler does not import here: "
                                    f"{type(e).__name__}: {e}") from None

        class CpuScheduler(Scheduler):   # type: ignore[misc, valid-type]
            def __init__(self, **attrs: Any) -> None:      # noqa: D401 (no processes: see the module)
                self.__dict__.update(attrs)

            def __getattr__(self, name: str) -> Any:
                sa = self.__dict__.get("server_args")
                if sa is not None and not name.startswith("_") and name in _fields(sa):
                    value = getattr(sa, name)       # a field __init__ copies from its server args
                    self.__dict__[name] = value
                    COPIED.add(name)
                    return value
                f = sys._getframe(1)
                where = f"{'/'.join(f.f_code.co_filename.split('/')[-3:])}:{f.f_lineno} ({f.f_code.co_name})"
                raise AttributeError(f"kvcheck's CpuScheduler has no {name!r}, read at {where}", name=name, obj=self)

            def _record_step_counters(self, batch: Any, result: Any) -> None:
                return None

            def maybe_send_health_check_signal(self) -> None:
                return None
        _CLS["cls"] = CpuScheduler
    return _CLS["cls"]


class Built:
    """One episode's scheduler and what it runs on; `close()` restores the published config."""

    def __init__(self, sched: Any, cache: Any, alloc: Any, rows: Any, undo: contextlib.ExitStack) -> None:
        self.sched, self.cache, self.alloc, self.rows, self._undo = sched, cache, alloc, rows, undo

    def close(self) -> None:
        self._undo.close()


def published(cfg: SchedConfig, page_size: int, disable_radix_cache: bool = False) -> dict[str, Any]:
    """The server-args fields an episode publishes."""
    return dict(
        disable_radix_cache=disable_radix_cache, page_size=page_size, chunked_prefill_size=cfg.chunked_prefill_size, schedule_policy=cfg.schedule_policy,
        max_running_requests=cfg.max_running_requests, pp_max_micro_batch_size=cfg.max_running_requests,
        enable_priority_scheduling=cfg.enable_priority_scheduling, max_prefill_tokens=cfg.max_prefill_tokens,
        disable_overlap_schedule=not cfg.enable_overlap, skip_tokenizer_init=True, context_length=cfg.context_length,
        attention_backend="torch_native", sampling_backend="pytorch")


def _tree_cache(lay: Any, alloc: Any, rows: Any, server_args: Any, mc: Any, tp_worker: Any, chunk: int) -> Any:
    """The tree the release's server would build for this model (its own `create_tree_cache`:
    UnifiedRadixCache with the components the model needs, 0.5.16+), on the Python tree core (the
    Rust core, the server's default, is compared with it by the cache-level lockstep layouts);
    a release without the factory gets the layout's class."""
    from dataclasses import fields
    S = load()
    swa, pure = "swa" in lay.components, all_swa(lay)
    P = S["CacheInitParams"]
    names = {f.name for f in fields(P)}
    disable = disabled(lay)
    kw = dict(disable=disable, req_to_token_pool=rows, token_to_kv_pool_allocator=alloc, page_size=lay.page_size,
              sliding_window_size=lay.window if swa else None, tree_core_backend="python")
    params = P(**{k: v for k, v in kw.items() if k in names})
    try:
        from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    except ImportError:         # 0.5.7-0.5.13: init_cache_with_memory_pool picks the class itself
        return _server_tree(params, swa, lay.window, disable)
    ctx_names = {f.name for f in fields(TreeCacheBuildContext)}
    ctx = dict(server_args=server_args, params=params, is_hybrid_swa=swa, is_hybrid_ssm=False,
               enable_hierarchical_cache=False, disable_radix_cache=disable, tp_worker=tp_worker, model_config=mc,
               tp_size=1, tp_rank=0, tp_group=ONE_RANK, full_tokens_per_layer=0 if pure else alloc.size, is_dsa=False,
               # the server's own value (kv_cache_builder: the chunked_prefill_size server arg, -1 when off;
               # None only for a multimodal model on the transformers backend)
               effective_chunked_prefill_size=chunk)
    cache = create_tree_cache(TreeCacheBuildContext(**{k: v for k, v in ctx.items() if k in ctx_names}))
    if type(cache).__name__ not in TREES:
        raise SglangUnavailable(f"sglang {sglang_version()} builds a {type(cache).__name__} for the {lay.name} model; "
                                f"the scheduler drive reads {', '.join(TREES)} so far")
    return cache


@functools.lru_cache(maxsize=None)
def init_order(cls: type) -> list[str]:
    """The `INITS` the release has, in the order its own `Scheduler.__init__` calls them (0.5.7
    sizes its overlap relay from `chunked_prefill_size`, which `init_chunked_prefill` must set
    first); one it calls elsewhere keeps its place in `INITS` after those. Read once per class
    (not at every episode's start)."""
    import inspect
    import re
    try:
        src = inspect.getsource(cls.__mro__[1].__init__)
    except (OSError, TypeError):
        src = ""
    called = list(dict.fromkeys(re.findall(r"self\.((?:maybe_)?init_\w+)\(", src)))
    have = [n for n in INITS if callable(getattr(cls, n, None))]
    return [n for n in called if n in have] + [n for n in have if n not in called]


def disabled(lay: Any) -> bool:
    """A layout served with `--disable-radix-cache` (its class named ChunkCache: what the server
    builds then up to 0.5.21; 0.5.22+ build a disabled UnifiedRadixCache)."""
    return lay.cls == "ChunkCache"


def _server_tree(params: Any, swa: bool, window: int | None, disable: bool = False) -> Any:
    """The tree 0.5.7-0.5.13's `init_cache_with_memory_pool` builds for a server with no
    hierarchical cache: with the radix cache disabled a `ChunkCache` (full attention); else
    `SWARadixCache` for a hybrid-SWA model (the window passed where its constructor takes it,
    0.5.7), `RadixCache` otherwise."""
    import inspect
    if disable and not swa:
        from sglang.srt.mem_cache.chunk_cache import ChunkCache
        return ChunkCache(params)
    if not swa:
        from sglang.srt.mem_cache.radix_cache import RadixCache
        return RadixCache(params)
    from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache
    if "sliding_window_size" in inspect.signature(SWARadixCache).parameters:
        return SWARadixCache(params=params, sliding_window_size=window)
    return SWARadixCache(params=params)


def _inline_parts(sched: Any, server_args: Any) -> None:
    """What a release's `__init__` builds inline rather than in an init method, built as it builds
    it: 0.5.7-0.5.13's ranks on the scheduler itself (one rank), 0.5.14's metrics collector and
    reporter (its scheduler.py:389-400, :469-476); 0.5.7-0.5.13's profiler fields (`init_profiler`
    sets them and opens nothing)."""
    import sglang.srt.managers.scheduler as m
    if not hasattr(sched, "ps"):        # no ParallelState: ranks and sizes are the scheduler's fields
        for name in ("tp_rank", "pp_rank", "attn_tp_rank", "attn_dp_rank", "attn_cp_rank", "moe_ep_rank", "moe_dp_rank"):
            sched.__dict__.setdefault(name, 0)
        for name in ("tp_size", "pp_size", "dp_size", "attn_tp_size", "attn_dp_size", "attn_cp_size", "moe_ep_size",
                     "moe_dp_size"):
            sched.__dict__.setdefault(name, 1)
        sched.__dict__.setdefault("dp_rank", None)
        sched.__dict__.setdefault("gpu_id", 0)
    prof = getattr(type(sched), "init_profiler", None)
    if prof is not None and prof.__module__.endswith("scheduler_profiler_mixin"):
        prof(sched)     # 0.5.7-0.5.13: the profiler's idle fields (0.5.14+: a manager, a sink here)
    if any(callable(getattr(type(sched), n, None)) for n in ("init_metrics_collector", "init_metrics")):
        return
    collector = getattr(m, "SchedulerMetricsCollector", None)
    reporter = getattr(m, "SchedulerMetricsReporter", None)
    if collector is None or reporter is None:
        raise SglangUnavailable(f"sglang {sglang_version()}: its Scheduler builds metrics neither in an init method "
                                "nor as 0.5.14 does: kvcheck's gap")
    ctx = collector.init_new(server_args=server_args, ps=sched.ps, tp_rank=0, pp_rank=0, dp_rank=None,
                             enable_priority_scheduling=sched.enable_priority_scheduling, enable_lora=False,
                             enable_hierarchical_cache=False)
    sched.metrics_collector_context, sched.metrics_collector = ctx, ctx.collector
    sched.metrics_reporter = reporter(scheduler=sched, tp_rank=0, pp_rank=0, dp_rank=None,
                                      metrics_collector_context=ctx, metrics_collector=ctx.collector)


def build(lay: Any, cfg: SchedConfig, worker: Any) -> Built:
    """SGLang's scheduler over the tree its server builds for the layout's model, `cfg.capacity`
    slots, with `worker` as its model worker."""
    page_size = lay.page_size
    why = gap(page_size)
    if why:
        raise SglangUnavailable(why)
    S = load()
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.environ import envs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    undo = contextlib.ExitStack()
    # a server seeds Python's RNG with its random_seed as its model runner starts
    # (set_random_seed); SGLang's `random` schedule policy shuffles the waiting queue with it:
    # seeded per episode, a replay makes the same choices
    import random
    random.seed(0)
    try:
        server_args = publish(published(cfg, page_size, disabled(lay)), cfg.context_length, undo)
        set_env("SGLANG_SWA_EVICTION_INTERVAL", str(cfg.swa_eviction_interval), undo)
        get_schedule, get_lora, get_serving = (bag(server_args, g) for g in ("schedule", "lora", "serving"))
        al = S["allocator"]
        swa, pure = "swa" in lay.components, all_swa(lay)
        size_swa = swa_pool_size(cfg, lay)
        if swa:
            alloc = swa_pools(cfg.capacity, size_swa, pure)
        elif page_size == 1:
            alloc = new_allocator(al.TokenToKVPoolAllocator, cfg.capacity, torch.int64, "cpu", None)
        else:
            alloc = new_allocator(al.PagedTokenToKVPoolAllocator, cfg.capacity, page_size, torch.int64, "cpu", None)
        rows = row_pool(cfg.max_running_requests + 1, cfg.context_length + 8)
        mc = ModelConfig(model_path=model_dir(cfg.context_length), context_length=cfg.context_length)
        max_req_len = min(mc.context_len - 1, cfg.capacity - 1)      # TpModelWorker.get_worker_info
        runner = StandIn(attn_backend=StandIn(), prefill_aware_swa=all_swa(lay) and PREFILL_AWARE_ALL_SWA, canary_manager=None, mambaish_config=None,
                         ngram_embedding_manager=StandIn(prepare_for_forward=lambda b, chunked_req=None: b),
                         forward_stream=torch.cpu.Stream())
        tp_worker = StandIn(model_runner=runner, register_hicache_layer_transfer_counter=lambda *a: None)
        cache = _tree_cache(lay, alloc, rows, server_args, mc, tp_worker, cfg.chunked_prefill_size)
        sched = scheduler_class()(
            server_args=server_args, model_config=mc, tree_cache=cache, token_to_kv_pool_allocator=alloc,
            req_to_token_pool=rows, page_size=page_size, device="cpu", forward_stream=torch.cpu.Stream(),
            tp_worker=tp_worker, model_worker=worker, draft_worker=None, tokenizer=None,
            spec_algorithm=SpeculativeAlgorithm.from_string(None), is_generation=True,
            # the server args' fields Scheduler.__init__ copies (its "Parse args" block)
            schedule_policy=cfg.schedule_policy, enable_priority_scheduling=cfg.enable_priority_scheduling,
            abort_on_priority_when_disabled=get_schedule().abort_on_priority_when_disabled,
            schedule_low_priority_values_first=get_schedule().schedule_low_priority_values_first,
            priority_scheduling_preemption_threshold=get_schedule().priority_scheduling_preemption_threshold,
            enable_lora=False, enable_lora_overlap_loading=False, max_loras_per_batch=get_lora().max_loras_per_batch,
            enable_overlap=cfg.enable_overlap, enable_overlap_mlx=False, schedule_stream=torch.cpu.Stream(),
            _war_barrier_enabled=False,     # run_event_loop: is_cuda() or SGLANG_ENABLE_WAR_BARRIER
            enable_pdmux=False, skip_tokenizer_init=True,
            stream_interval=get_serving().stream_interval, enable_hierarchical_cache=False, enable_lmcache=False,
            enable_session_radix_cache=False, enable_hicache_storage=False, enable_unified_cache_external_linker=False,
            enable_decode_hicache=False, max_recv_per_poll=env_setting(envs, "SGLANG_SCHEDULER_MAX_RECV_PER_POLL"),
            max_new_tokens_limit=env_setting(envs, "SGLANG_MAX_NEW_TOKENS_LIMIT"), enable_hisparse=False,
            attn_dp_enabled=False, enable_unified_memory=False, enable_fpm=False,
            # what init_model_worker takes from the worker (get_worker_info) and the kv-cache builder
            max_total_num_tokens=cfg.capacity, max_prefill_tokens=cfg.max_prefill_tokens,
            max_running_requests=cfg.max_running_requests, max_queued_requests=get_schedule().max_queued_requests,
            max_req_len=max_req_len, max_req_input_len=max_req_len - 5, random_seed=0,
            min_free_slots_delayer=None, is_hybrid_swa=swa, is_hybrid_ssm=False,
            sliding_window_size=lay.window if swa else None, full_tokens_per_layer=0 if pure else cfg.capacity,
            swa_tokens_per_layer=size_swa if swa else None, disable_radix_cache=disabled(lay),
            hisparse_coordinator=None, decode_offload_manager=None, disaggregation_mode=DisaggregationMode.NULL,
            transfer_backend=None, dynamic_chunk_sizer=None, truncation_align_size=None, require_mlp_sync=False,
            scripted_scheduler_hook=None, _sched_idled=False, scheduler_stage_metrics=None, load_snapshot_writer=None,
            forward_ct=0, processed_tokens_counter=0, cur_batch_for_debug=None, is_initializing=False,
            # process groups: one rank
            dp_tp_group=ONE_RANK, dp_tp_cpu_group=None, pp_group=ONE_RANK, tp_group=ONE_RANK, tp_cpu_group=None,
            attn_tp_group=ONE_RANK, attn_tp_cpu_group=None, attn_cp_group=ONE_RANK, attn_cp_cpu_group=None,
            # what 0.5.7-0.5.13's init_cache_with_memory_pool / init_model_worker set besides the pools
            decode_mem_cache_buf_multiplier=1, pad_input_ids_func=None,     # (no speculative decoding)
            # what 0.5.7-0.5.13's __init__ / init_ipc_channels set: no kv_events_config, no dllm_algorithm,
            # no sleep_on_idle; their sockets to the tokenizer and detokenizer as sinks
            enable_kv_cache_events=False, dllm_config=None, idle_sleeper=None,
            send_to_tokenizer=_Sink(), send_to_detokenizer=_Sink(),
            # observability sinks and the statistics-only inquirer
            kv_events_publisher=_Sink(), load_publisher=_Sink(), output_streamer=_Sink(), profiler_manager=_Sink(),
            load_inquirer=StandIn(_get_num_pending_tokens=lambda *a, **k: 0, get_loads=lambda *a, **k: None),
            weight_updater=StandIn(offload_tags=set()),
            ipc_channels=StandIn(send_to_tokenizer=_Sink(), send_to_detokenizer=_Sink(), recv_from_rpc=None),
            ngram_embedding_manager=runner.ngram_embedding_manager, use_ngram_embedding=False)
        ps = parallel_state()
        if ps is not None:               # 0.5.18-0.5.20 keep their ranks in a ParallelState
            sched.ps = ps
        _inline_parts(sched, server_args)
        for name in init_order(type(sched)):
            getattr(sched, name)(**init_args(getattr(type(sched), name)))
        import sglang.srt.managers.scheduler as m
        if "grammar_manager" not in sched.__dict__ and hasattr(m, "GrammarManager"):
            sched.grammar_manager = m.GrammarManager(sched)     # 0.5.12-0.5.13: the end of __init__
        if hasattr(getattr(sched, "metrics_reporter", None), "scheduler_stage_metrics"):  # 0.5.20+ (__init__ copies it)
            sched.scheduler_stage_metrics = sched.metrics_reporter.scheduler_stage_metrics
    except BaseException:
        undo.close()
        raise
    return Built(sched, cache, alloc, rows, undo)
