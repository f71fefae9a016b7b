"""Building vLLM's own v1 ``Scheduler`` on CPU, as its ``EngineCore`` builds it.

Nothing is downloaded: the model config is a ``config.json`` kvcheck writes into a temporary
directory (a tiny Llama: the scheduler reads only lengths and flags from it), read by the
release's own ``ModelConfig`` with ``skip_tokenizer_init``. The expensive pieces
(``ModelConfig`` and an EAGLE ``SpeculativeConfig``: 2-15 s each, they inspect the model class)
are built once per process; a ``VllmConfig`` and a ``Scheduler`` per episode take milliseconds.
The scheduler and hash block sizes come from the release's own rule (``EngineCore``:
``resolve_kv_cache_block_sizes`` where the release has it, else ``cache_config.block_size``);
a layout whose block sizes the release would derive differently cannot be expressed on it.
Which knobs a release takes is read off its constructors' signatures, never assumed.
"""
from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from kvcheck.fuzz.boundary import CannotExpress

from .layouts import EAGLE, LAYOUT_DATA, RETENTION, layout_scale, make_specs, vllm_modules

_CACHE: dict[str, Any] = {}
BIG_LEN = 1 << 16          # the model's max_position_embeddings: every layout's max_model_len fits


@dataclass(frozen=True)
class SchedKnobs:
    """What one episode's scheduler is configured with (drawn by the generator, kept in traces)."""

    policy: str = "fcfs"                 # fcfs | priority
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 4
    long_prefill_token_threshold: int = 0
    num_blocks: int = 48
    spec_tokens: int = 0                 # EAGLE draft tokens per step (layouts with a drafter)
    eagle_drop: bool = False             # legacy block hashes + the EAGLE block drop, where the release
    #                                      has lookahead block hashes (disable_lookahead_block_hashes)
    connector: bool = False              # an external prefix store behind vLLM's KV connector (connector.py)
    sync_fail: bool = False              # its synchronous loads fail too (opt-in: connector.py, SYNC_FAILURES_ENV)
    async_sched: bool = False            # AsyncScheduler under the batch queue (engine_async.py; vLLM's default)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _sig(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)


def model_dir() -> str:
    d = _CACHE.get("dir")
    if d is None:
        from transformers import LlamaConfig
        d = _CACHE["dir"] = tempfile.mkdtemp(prefix="kvcheck-model-")
        atexit.register(shutil.rmtree, d, True)
        LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, vocab_size=64, max_position_embeddings=BIG_LEN,
                    architectures=["LlamaForCausalLM"]).save_pretrained(d)
    return d


@contextlib.contextmanager
def kernels_not_needed() -> Any:
    """vLLM 0.34's CPU platform refuses an x86 host without Triton's CPU backend (triton-cpu: its
    model runner's kernels; no wheel on the package index) when a VllmConfig is built. kvcheck
    runs no kernel: while the config is built, the platform's check is answered as a triton-cpu
    install would answer it (vllm.triton_utils.HAS_TRITON; nothing else is touched, and a release
    without the flag, or with Triton usable, is left as it is)."""
    import vllm.triton_utils as tu
    if getattr(tu, "HAS_TRITON", True):
        yield
        return
    tu.HAS_TRITON = True
    try:
        yield
    finally:
        tu.HAS_TRITON = False


@contextlib.contextmanager
def platform_keeps_async() -> Any:
    """vLLM's CPU platform turns async scheduling off ("not required on CPU": its
    check_and_update_config, run after VllmConfig decided; 0.29+ resolve the CPU platform here) and
    0.34's scheduler reads the flag (Mamba states published at output time only without it).
    kvcheck drives a GPU engine's scheduler: while the config is built, what VllmConfig decided stays."""
    from vllm import platforms
    cp = platforms.current_platform
    orig = cp.check_and_update_config

    def keep(vc: Any) -> Any:
        before = vc.scheduler_config.async_scheduling
        try:
            return orig(vc)
        finally:
            vc.scheduler_config.async_scheduling = before
    cp.check_and_update_config = keep
    try:
        yield
    finally:
        del cp.check_and_update_config


def _model_config() -> Any:
    mc = _CACHE.get("model")
    if mc is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import contextlib
        import io
        from vllm.config import ModelConfig
        # (older releases print "Error retrieving safetensors" for a local directory without weights:
        # kvcheck writes none on purpose; a failure still raises with its own message)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            mc = _CACHE["model"] = ModelConfig(model=model_dir(), skip_tokenizer_init=True,
                                               max_model_len=BIG_LEN, dtype="float32")
    return mc


def _spec_config(k: int, drop: bool) -> Any:
    """An EAGLE SpeculativeConfig with k draft tokens (built once: 2-15 s; the variants are copies
    with the two fields the scheduler reads changed)."""
    import copy
    if "spec" not in _CACHE:
        from vllm.config import ParallelConfig, SpeculativeConfig
        _CACHE["spec"] = SpeculativeConfig(method="eagle", model=model_dir(), num_speculative_tokens=1,
                                           target_model_config=_model_config(),
                                           target_parallel_config=ParallelConfig())
    spec = copy.copy(_CACHE["spec"])
    spec.num_speculative_tokens = k
    if hasattr(spec, "disable_lookahead_block_hashes"):
        spec.disable_lookahead_block_hashes = drop
    return spec


@dataclass
class Built:
    """A scheduler and its requests' block hasher (its block sizes are the layout's: build checks)."""

    scheduler: Any
    hasher: Any


def async_by_default(layout: str, knobs: SchedKnobs) -> bool:
    """Would the release's own VllmConfig turn async scheduling on for this layout by default
    (``async_scheduling=None``)? 0.16.0 turns it off for Mamba prefix caching (and refuses it when
    asked for), other releases keep it; kvcheck draws it only where vLLM would run it. Once per
    layout and connector setting (a VllmConfig: milliseconds)."""
    key = ("async", layout, knobs.connector)
    if key not in _CACHE:
        _CACHE[key] = bool(_vllm_config(layout, knobs, None).scheduler_config.async_scheduling)
    return _CACHE[key]


def _vllm_config(layout: str, knobs: SchedKnobs, async_scheduling: bool | None) -> Any:
    """The engine's VllmConfig for `layout` under `knobs` (its scheduler's async_scheduling as given)."""
    V = vllm_modules()
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
    desc, groups, sched_bs = LAYOUT_DATA[layout]
    hb, max_len = layout_scale(layout)
    mc = _model_config()
    mc.max_model_len = max_len
    sc_args = _sig(SchedulerConfig)
    sc = SchedulerConfig(**{k: v for k, v in dict(
        max_num_batched_tokens=knobs.max_num_batched_tokens, max_num_seqs=knobs.max_num_seqs,
        max_model_len=max_len, enable_chunked_prefill=True, policy=knobs.policy,
        long_prefill_token_threshold=knobs.long_prefill_token_threshold,
        is_encoder_decoder=False).items() if k in sc_args})
    if "async_scheduling" in sc_args:       # (False: as --no-async-scheduling; None: vLLM's default decides)
        sc.async_scheduling = async_scheduling
    elif async_scheduling is not False:
        raise CannotExpress(f"vLLM {V['version']} has no async scheduling")
    attn_bs = [bs for k, bs, _ in groups]
    cc_args = _sig(CacheConfig)
    mb = next((bs for k, bs, _ in groups if k == "mamba"), None)
    mamba = {k: v for k, v in dict(mamba_cache_mode="align", mamba_block_size=mb,
                                   enable_mamba_shared_prefix_checkpoint=True).items() if k in cc_args} if mb else {}
    # (align mode: vLLM's platform sets the Mamba block to cache_config.block_size, and the scheduler's
    # Mamba split aligns chunks to cache_config.block_size: Platform._align_hybrid_block_size)
    cc = CacheConfig(block_size=mb or (min(attn_bs) if len(groups) > 1 else attn_bs[0]), enable_prefix_caching=True,
                     **({"prefix_match_unit": hb} if "prefix_match_unit" in cc_args and len(groups) > 1 else {}),
                     **mamba)
    cc.num_gpu_blocks = knobs.num_blocks
    drafter = EAGLE.get(layout)
    spec = _spec_config(max(1, knobs.spec_tokens), knobs.eagle_drop) if drafter is not None else None
    extra_cfg: dict[str, Any] = {"speculative_config": spec} if spec else {}
    if knobs.connector:
        from .connector import supported, transfer_config
        why = supported(groups)
        if why is not None:
            raise CannotExpress(f"layout {layout!r} with a KV connector: {why}")
        extra_cfg["kv_transfer_config"] = transfer_config()
    with kernels_not_needed(), platform_keeps_async():
        return VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc,
                          device_config=DeviceConfig(device="cpu"), **extra_cfg)


def build(layout: str, knobs: SchedKnobs) -> Built:
    """vLLM's own Scheduler for `layout` under `knobs` (ValueError: the release cannot express it)."""
    V = vllm_modules()
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager
    desc, groups, sched_bs = LAYOUT_DATA[layout]
    hb, max_len = layout_scale(layout)
    vc = _vllm_config(layout, knobs, knobs.async_sched)
    drafter = EAGLE.get(layout)
    feats = V["features"]
    flag = drafter is not None and "is_eagle_group" in feats
    extra = {"prefix_cache_retention_interval": RETENTION[layout]} \
        if layout in RETENTION and "retention_interval" in feats else {}
    kcfg = KVCacheConfig(num_blocks=knobs.num_blocks, kv_cache_tensors=[], **extra,
                         kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s, **(
                             {"is_eagle_group": i in drafter} if flag else {}))
                                          for i, s in enumerate(make_specs(layout))])
    resolve = getattr(V["ku"], "resolve_kv_cache_block_sizes", None)
    sbs, hbs = resolve(kcfg, vc) if resolve is not None else (vc.cache_config.block_size,) * 2
    if (sbs, hbs) != (sched_bs, hb):
        raise CannotExpress(f"layout {layout!r} needs scheduler block {sched_bs} and hash block {hb}; "
                         f"vLLM {V['version']}'s engine derives {sbs} and {hbs} for its groups")
    kw: dict[str, Any] = dict(vllm_config=vc, kv_cache_config=kcfg, block_size=sbs, log_stats=True,
                              structured_output_manager=StructuredOutputManager(vc))
    if "hash_block_size" in _sig(Scheduler):
        kw["hash_block_size"] = hbs
    from .engine_async import scheduler_class
    sched = scheduler_class(knobs)(**kw)
    la = getattr(vc, "num_hash_lookahead_tokens", 0) or 0
    ku = V["ku"]
    hasher = (ku.get_request_block_hasher(hbs, V["sha256"], la)
              if len(_sig(ku.get_request_block_hasher)) > 2 else ku.get_request_block_hasher(hbs, V["sha256"]))
    return Built(sched, hasher)
