"""The episode's configuration published as the installed SGLang release takes one.

Releases differ in where a scheduler reads its configuration from, and each is followed from its
own code: 0.5.16+ publish a test-scoped record through the runtime context
(`override_server_args`), whose config groups (`get_schedule`, `get_lora`, `get_serving`: 0.5.17+)
the scheduler reads; 0.5.7-0.5.15 read a `ServerArgs` record published with
`set_global_server_args_for_scheduler`, built here as a server builds it. Ranks are the single
rank a launcher gives a one-process server (`get_parallel().override`, `ParallelState`; before
0.5.14 the scheduler's own fields, set by build.py).
A small tiny-Llama config.json stands in for the model directory (nothing is downloaded).
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import shutil
import tempfile
from typing import Any

from kvcheck.fuzz.boundary import StandIn

from ..install import SglangUnavailable, sglang_version

# a process group of one rank (the scheduler's groups, and 0.5.7-0.5.13's tensor-parallel group)
ONE_RANK = StandIn(world_size=1, first_rank=0, is_first_rank=True, is_last_rank=True, cpu_group=None, rank_in_group=0)

_DIR: dict[str, str] = {}


def model_dir(context: int) -> str:
    """A tiny Llama's config.json (no weights): SGLang's ModelConfig reads it (nothing is downloaded)."""
    key = str(context)
    if key not in _DIR:
        from transformers import LlamaConfig
        d = _DIR[key] = tempfile.mkdtemp(prefix="kvcheck-sglang-model-")
        atexit.register(shutil.rmtree, d, True)
        LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, vocab_size=512, max_position_embeddings=context,
                    architectures=["LlamaForCausalLM"]).save_pretrained(d)
    return _DIR[key]


def publish_record(published: dict[str, Any], context: int, undo: contextlib.ExitStack) -> Any:
    """Releases before `override_server_args` (0.5.7-0.5.15): a `ServerArgs` built as a server
    builds it (its own validation runs) on the CPU device, published with SGLang's
    `set_global_server_args_for_scheduler`; the previous record is put back afterwards."""
    from sglang.srt import server_args as sam
    # where the release keeps the published record: its server_args module (0.5.7-0.5.14) or the context
    if hasattr(sam, "_global_server_args"):
        holder, slot = sam, "_global_server_args"
    else:
        from sglang.srt import runtime_context as rc
        holder, slot = rc.get_context(), "_server_args"
    prev = getattr(holder, slot, None)
    record = sam.ServerArgs(model_path=model_dir(context), device="cpu", **published)
    sam.set_global_server_args_for_scheduler(record)
    undo.callback(setattr, holder, slot, prev)
    return record


def publish(published: dict[str, Any], context: int, undo: contextlib.ExitStack) -> Any:
    """Publish `published` (server-args fields) as the release takes a configuration, with the
    single rank; `undo` restores what was there. Returns the record the scheduler reads."""
    rc = _runtime_context()
    ctx = rc.get_context() if rc is not None else None
    # SGLang logs each refused or retracted request (and, building a record, the model's missing
    # generation config): the drive's results say what happened
    log = logging.getLogger("sglang")
    undo.callback(log.setLevel, log.level)
    log.setLevel(logging.CRITICAL)
    if ctx is not None and hasattr(ctx, "override_server_args"):
        ov = ctx.override_server_args(**published)
        server_args = ov.install()
        undo.callback(ov.restore)
    else:
        server_args = publish_record(published, context, undo)
    # the override publishes the fields to the config bags but leaves the record's own attributes
    # at their defaults; a server started with these flags has them on its record too (0.5.19's
    # GrammarManager reads `server_args.skip_tokenizer_init`). 0.5.20+ freeze the record (their
    # readers go through the bags): nothing to mend there.
    for name, value in published.items():
        if getattr(server_args, name, value) != value:
            try:
                object.__setattr__(server_args, name, value)
            except (TypeError, AttributeError):
                break
    if rc is None:                      # 0.5.7-0.5.13: ranks are the scheduler's own fields (build.py)
        _one_rank_groups(undo)
        return server_args
    ranks = dict(attn_tp_rank=0, attn_cp_rank=0, tp_rank=0, pp_rank=0, attn_dp_rank=0, dp_rank=0)
    known = (rc._parallel_fields() if hasattr(rc, "_parallel_fields")
             else getattr(rc, "_PARALLEL_FIELDS", set(ranks)))    # (the release's own list of fields)
    undo.enter_context(rc.get_parallel().override(**{k: v for k, v in ranks.items() if k in known}))
    return server_args


def _one_rank_groups(undo: contextlib.ExitStack) -> None:
    """0.5.7-0.5.13 read the tensor-parallel rank from the process group a launcher initialises
    (`get_tensor_model_parallel_rank()` in `Req.set_finish_with_abort`): the one-rank group
    stand-in is that group while the episode runs."""
    from sglang.srt.distributed import parallel_state as dps
    for slot in ("_TP", "_ATTN_TP"):
        if getattr(dps, slot, 0) is None:
            setattr(dps, slot, ONE_RANK)
            undo.callback(setattr, dps, slot, None)


def _runtime_context() -> Any:
    """SGLang's runtime context module (0.5.14+), None before."""
    try:
        from sglang.srt import runtime_context as rc
    except ImportError:
        return None
    return rc if hasattr(rc, "get_context") else None


def bag(server_args: Any, group: str) -> Any:
    """The release's accessor for a group of config fields (`get_schedule`, 0.5.17+), or, where
    it has none (0.5.7-0.5.16: its scheduler reads the record), the published record itself."""
    return getattr(_runtime_context(), f"get_{group}", lambda: server_args)


def set_env(name: str, value: str, undo: contextlib.ExitStack) -> None:
    """An SGLang environment setting for the episode (SGLang reads it as it runs: `envs.X.get()`),
    so that a trace decides it, not the caller's environment; `undo` puts back what was there."""
    import os
    prev = os.environ.get(name)
    os.environ[name] = value
    undo.callback(lambda: os.environ.__setitem__(name, prev) if prev is not None else os.environ.pop(name, None))


def env_setting(envs: Any, name: str) -> Any:
    """An SGLang environment setting's value, None where the release has no such setting."""
    v = getattr(envs, name, None)
    return None if v is None else v.get()


# what older releases pass their init methods (`init_metrics_collector(tp_rank, pp_rank, dp_rank)`):
# the single rank this scheduler is
RANK_ARGS = {"tp_rank": 0, "pp_rank": 0, "dp_rank": None, "attn_tp_rank": 0, "attn_cp_rank": 0, "moe_ep_rank": 0}


def init_args(fn: Any) -> dict[str, Any]:
    import inspect
    out = {}
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            if p.name not in RANK_ARGS:
                raise SglangUnavailable(f"sglang {sglang_version()}: Scheduler.{fn.__name__} takes {p.name!r}, which "
                                        "kvcheck's CPU scheduler does not know")
            out[p.name] = RANK_ARGS[p.name]
    return out


def parallel_state() -> Any:
    """The single rank as SGLang's own `ParallelState.trivial` states it (0.5.14-0.5.20's
    `Scheduler.ps`; dp_rank None as the launcher passes it without data parallelism), or None
    where the release keeps ranks in its runtime context only."""
    import dataclasses
    import sglang.srt.managers.scheduler as m
    P = getattr(m, "ParallelState", None)
    if P is None:
        return None
    if hasattr(P, "trivial"):
        return P.trivial(dp_rank=None)
    # 0.5.14-0.5.17: no trivial(); what the launcher passes a single-rank scheduler
    return P(**{f.name: 1 if f.name.endswith("_size") else (None if f.name == "dp_rank" else 0)
                for f in dataclasses.fields(P)})
