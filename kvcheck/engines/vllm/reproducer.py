"""Upstream-ready reproducers: a standalone Python script per vLLM finding, next to its trace.

A maintainer should not need kvcheck to see a bug. The script imports only vLLM. It rebuilds
the finding's manager from the very objects the adapter built (every spec's fields, the group
flags, the KVCacheConfig and KVCacheManager arguments: any layout, block size, drafter, Mamba
group, retention interval), replays the trace's operations the way the adapter drives them
(lookup = ``get_computed_blocks`` + admission ``allocate_slots`` with the token count the
scheduler's own split gave, prefill/decode = ``allocate_slots``, finish/preempt = ``free``,
scheduler steps with their queued copies and forward), keeps the adapter's content model in
miniature (reproducer_body.py), checks the finding's condition in plain code, prints hit
lengths and block tables, and exits 1 while the bug is present, 0 when it is fixed (2: a step
it cannot play). What only kvcheck's spec knows is recorded in the script as data with its
evidence checked in vLLM's own state: a lost reuse lists every prefix-cache entry the usable
hit reads, and the script shows each is in vLLM's map. A planted fault (a kvcheck negative
control) is inside the script as a clearly marked monkeypatch; ``--clean`` leaves it out.

Checks with a standalone condition: see :data:`CONDITIONS`. Others get the replay command only.
"""
from __future__ import annotations

from types import SimpleNamespace

import dataclasses
import enum
from pathlib import Path
from typing import Any

from .layouts import EAGLE, VOCAB
from .reproducer_body import BODY

# check -> the plain-code condition the script evaluates (reproducer_body.py)
CONDITIONS = {
    "refcount_equals_holders": "every block's ref_cnt equals the number of block tables (and queued copies) holding it",
    "hash_map_sound": "every prefix-cache map entry points at a block that carries that key and holds (or will hold, "
                      "once its forward runs) the key's tokens: a Mamba block exactly the state after them",
    "hit_aligned": "a hit is a multiple of the manager's hit alignment",
    "hit_leaves_last_token": "a hit leaves at least one prompt token to compute",
    "hit_length_equal": "every group returns exactly the blocks that cover the hit",
    "hit_sound_swa_window": "no block the resume reads is the null block; every hit block holds the request's tokens",
    "hit_sound_chunked_local": "no block the resume reads is the null block; every hit block holds the request's tokens",
    "hit_sound_compressed_kv": "no block the resume reads is the null block; every hit block holds the request's tokens",
    "hit_sound_indexer": "no block the resume reads is the null block; every hit block holds the request's tokens",
    "hit_sound_recurrent_state": "the hit's last Mamba block holds exactly the state after the hit's tokens",
    "lost_reuse": "the hit is as long as the longest one whose every needed prefix-cache entry is in vLLM's map "
                  "(the entries are listed and looked up in the script)",
    "lost_reuse_retention": "the hit reaches the boundary the retention policy promises "
                            "(prefix_cache_retention_interval: replay boundary, junction, every N tokens)",
    "read_before_write": "every block a step's forward reads was written by a forward that ran (a block published by "
                         "allocate_slots of a request taken out of the step never is)",
    "state_copy_sound": "every copy a step runs (copy-on-write, Mamba state copies) reads a source that holds, "
                        "when the copy runs, what the destination needs",
    "vllm_internal_error": "vLLM's calls raise no exception",
}

PLANTS = {
    "drop_ref_on_free": '''
def plant(mgr):
    orig = mgr.free
    def free(req):
        held = [b for m in mgr.coordinator.single_type_managers for b in m.req_to_blocks.get(req.request_id, [])
                if not b.is_null]
        orig(req)
        shared = [b for b in held if b.ref_cnt >= 1]
        if shared:
            shared[0].ref_cnt -= 1          # one reference too many dropped
    mgr.free = free
''',
    "swa_hit_unchecked": '''
def plant(mgr):
    SWM = stm.SlidingWindowManager
    class FaultySWA(SWM):
        @classmethod
        def _contiguous_blocks_for_hit(cls, window_size, block_size, use_eagle):
            return 1                        # window coverage unchecked
    mgr.coordinator.attention_groups = [g._replace(manager_cls=FaultySWA) if issubclass(g.manager_cls, SWM)
                                        else g for g in mgr.coordinator.attention_groups]
''',
    "swa_overstrict": '''
def plant(mgr):
    SWM = stm.SlidingWindowManager
    class FaultySWA(SWM):
        @classmethod
        def _contiguous_blocks_for_hit(cls, window_size, block_size, use_eagle):
            return super()._contiguous_blocks_for_hit(window_size, block_size, use_eagle) + 1
    mgr.coordinator.attention_groups = [g._replace(manager_cls=FaultySWA) if issubclass(g.manager_cls, SWM)
                                        else g for g in mgr.coordinator.attention_groups]
''',
    "evict_keeps_hash": '''
def plant(mgr):
    pool = mgr.block_pool
    def keep_map_entry(block):              # forget the block's hash, keep the map entry
        getattr(pool, "cached_block_hashes_by_block", {}).pop(block.block_id, None)
        block.reset_hash()
        return False
    pool._maybe_evict_cached_block = keep_map_entry
''',
    "retention_drops_tail": '''
def plant(mgr):
    for m in mgr.coordinator.single_type_managers:
        if not isinstance(m, stm.SlidingWindowManager):
            continue
        def wrap(orig):
            def mask(*a, **kw):
                out = orig(*a, **kw)
                bounds = list(kw.get("reachable_boundaries", ()))
                if out is None or kw.get("retention_interval") is None or not bounds:
                    return out
                al, bs, start = kw["alignment_tokens"], kw["kv_cache_spec"].block_size, kw["start_block"]
                j = (bounds[0] // al * al) // bs - 1     # last SWA block before the replay boundary
                if start <= j < kw["end_block"]:
                    out[j - start] = False
                return out
            return mask
        m.reachable_block_mask = wrap(m.reachable_block_mask)
''',
}


def _lit(v: Any) -> str:
    """Python source for a spec field's value (torch dtypes and vLLM enums included)."""
    if isinstance(v, enum.Enum):
        return f"C({type(v).__module__!r}, {type(v).__name__!r})[{v.name!r}]"
    if type(v).__name__ == "dtype" and str(v).startswith("torch."):
        return str(v)
    if isinstance(v, (tuple, list)):
        inner = ", ".join(_lit(x) for x in v)
        return f"({inner},)" if isinstance(v, tuple) and len(v) == 1 else (f"({inner})" if isinstance(v, tuple) else f"[{inner}]")
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_lit(k)}: {_lit(x)}" for k, x in v.items()) + "}"
    return repr(v)


def changed_fields(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A dataclass's constructor fields whose values differ from their defaults."""
    out = {}
    for f in dataclasses.fields(obj):
        if not f.init or f.name in skip:
            continue
        v = getattr(obj, f.name)
        d = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        if d is dataclasses.MISSING or v != d:
            out[f.name] = v
    return out


def _kw(d: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k!r}: {_lit(v)}" for k, v in d.items()) + "}"


def record(trace: Any) -> dict | None:
    """Replay the trace on the adapter and record what the script needs: the manager's
    construction, the steps vLLM played (with the token counts the scheduler's split gave),
    and at the finding's step the spec's numbers (usable hit and its witness entries, the
    blocks the hit's resume reads). None when the trace does not reproduce its check."""
    from kvcheck.spec.sut import ActionRejected
    from .build import make_adapter, resolve_layout
    layout = resolve_layout(trace)
    v = trace.violation or {}
    ad = make_adapter(layout, int(trace.meta.get("num_blocks", 24)), trace.fault,
                  bool(trace.meta.get("strict_reuse")), bool(trace.meta.get("dense_twin")),
                  trace.meta.get("sched_policy", "fcfs"))
    steps: list[list] = []
    expect: dict[str, Any] = {}
    for s in trace.steps:
        p = dict(s.params)
        pre = None
        if s.action == "lookup" and p.get("r") in ad.reqs and v.get("check") == "lost_reuse":
            req = ad.reqs[p["r"]]
            usable = ad.spec_usable(req)
            pre = {"usable": usable, "witness": ad.usable_at(req, usable) if usable else []}
        ad.last_n = ad.last_hit = None      # (what the step scheduled and hit, even when a check then failed)
        try:
            obs = ad.apply(s.action, s.params)
        except ActionRejected:
            continue
        if ad.last_n is not None:
            p["n"] = ad.last_n
        steps.append([s.action, p])
        broke = ad.extra_checks(s.action, s.params)
        if broke is not None:
            if broke[1] != v.get("check"):
                return None
            hit = ad.last_hit
            if s.action == "lookup" and hit is not None:
                expect.update(pre or {}, hit=hit,
                              needed={str(g): ad.needed_hit(g, hit) for g in range(len(ad.groups))} if hit else {})
            break
    else:
        return None
    mgr = ad.mgr
    groups = mgr.kv_cache_config.kv_cache_groups
    drafter = EAGLE.get(layout) or ()
    split = {}
    if ad.has_mamba:      # the scheduler's settings its split reads (vllm_mamba._split_fn)
        from . import mamba as vllm_mamba
        me = (ad.__dict__.get("_mamba_split") or vllm_mamba._split_fn(ad))[1]
        split = {k: (dict(vars(v)) if isinstance(v, SimpleNamespace) else v)       # (StandIn is one)
                 for k, v in vars(me).items() if k != "max_num_scheduled_tokens"}
    return {"layout": layout, "groups": ad.groups, "hb": ad.hb, "sched": ad.sched_bs, "steps": steps,
            "specs": [(type(g.kv_cache_spec).__module__, type(g.kv_cache_spec).__name__, changed_fields(g.kv_cache_spec))
                      for g in groups],
            "group_kw": [{**({"is_eagle_group": g in drafter} if drafter else {}),     # (offered to any release)
                          **changed_fields(x, ("layer_names", "kv_cache_spec"))} for g, x in enumerate(groups)],
            "config_kw": {k: x for k, x in ad.build_args["config"].items() if x is not None},   # (None: the default)
            "manager_kw": {"scheduler_block_size": ad.sched_bs, **ad.build_args["manager"]},
            "max_tokens": ad.max_tokens, "split": split, "expect": {**expect, "promised": (trace.meta.get("lost_reuse_size") or {}).get("promised")}}


def script_parts(trace: Any, rec: dict, plant: str) -> tuple[str, str]:
    """What every reproducer script starts with: the planted fault's marked block, and the data
    lines rebuilding the layout (release, groups, specs, group and KVCacheConfig arguments)."""
    fault_block = ("# ======== PLANTED FAULT (kvcheck negative control " + repr(trace.fault) +
                   "): not vLLM's code. Run with --clean to leave it out. ========" + plant +
                   "# ======== END OF PLANTED FAULT ========\n") if plant else "def plant(mgr):\n    pass\n"
    specs = "[\n" + "".join(f"    ({m!r}, {c!r}, {_kw(kw)}),\n" for m, c, kw in rec["specs"]) + "]"
    head = (f"RECORDED_RELEASE = {trace.meta.get('vllm_version')!r}\n"
            f"GROUPS = {rec['groups']!r}          # (kind, block_size, window or chunk)\n"
            f"SPECS = {specs}          # (module, class, fields that differ from the defaults), one per group\n"
            f"GROUP_KW = {_kw_list(rec['group_kw'])}\n"
            f"CONFIG_KW = {_kw(rec['config_kw'])}\n")
    return fault_block, head


def reproducer_source(trace: Any, trace_path: str) -> str | None:
    """The script's text, or None when this finding has no standalone condition."""
    v = trace.violation or {}
    check = v.get("check")
    if check not in CONDITIONS or (trace.fault and trace.fault not in PLANTS):
        return None
    rec = record(trace)
    if rec is None:
        return None
    plant = PLANTS.get(trace.fault or "", "")
    layout = rec["layout"]
    header = (f"# Standalone reproducer of a kvcheck finding on vLLM {trace.meta.get('vllm_version')}\n"
              f"# layout {layout!r}: groups (kind, block size, window/chunk) {rec['groups']}, hash block {rec['hb']}\n"
              f"# check {check}: {CONDITIONS[check]}\n"
              f"# finding: {v.get('message', '')}\n# trace: {trace_path} (kvcheck replay {trace_path} --sut vllm)\n"
              "# Needs only vLLM (the release above; the KV cache manager runs on CPU). Exit 1: the bug is\n"
              "# present; exit 0: fixed (or not this release); 2: a step this vLLM cannot play.\n")
    fault_block, head = script_parts(trace, rec, plant)
    data = (head +
            f"MANAGER_KW = {_kw(rec['manager_kw'])}\n"
            f"NUM_BLOCKS, HASH_BLOCK, SCHED_BLOCK = {int(trace.meta.get('num_blocks', 24))}, {rec['hb']}, {rec['sched']}\n"
            f"MAX_TOKENS, VOCAB = {rec['max_tokens']}, {VOCAB}\n"
            f"MAMBA = {any(k == 'mamba' for k, _, _ in rec['groups'])}\n"
            f"SPLIT = {rec['split']!r}   # the scheduler's settings its Mamba chunk split reads ({{}}: no Mamba group)\n"
            f"CHECK = {check!r}\n"
            f"EXPECT = {rec['expect']!r}   # the spec's numbers at the finding's step (checked in vLLM's state below)\n"
            f"STEPS = {rec['steps']!r}\n")
    return header + IMPORTS + data + "\n" + fault_block + BODY


def _kw_list(ds: list[dict]) -> str:
    return "[" + ", ".join(_kw(d) for d in ds) + "]"


def write_reproducer(trace: Any, trace_path: str) -> dict:
    """Write `<trace>.repro.py` next to the trace; the finding's fields that say where."""
    check = (trace.violation or {}).get("check")
    try:
        src = reproducer_source(trace, trace_path)
    except Exception as e:    # (a finding is saved even when its script cannot be made: said, not raised)
        return {"reproducer": None, "reproducer_note": f"no standalone reproducer ({type(e).__name__}: {e}): "
                                                       f"replay with `kvcheck replay {trace_path} --sut vllm`"}
    if src is None:
        why = (f"check {check!r} has no plain-code condition" if check not in CONDITIONS else
               f"planted fault {trace.fault!r} has no standalone monkeypatch" if trace.fault not in (None, *PLANTS)
               else f"the trace does not reproduce {check!r} on this vLLM and kvcheck")
        return {"reproducer": None, "reproducer_note": f"no standalone reproducer ({why}): replay with "
                                                       f"`kvcheck replay {trace_path} --sut vllm`"}
    out = Path(trace_path).with_suffix(".repro.py")
    out.write_text(src)
    return {"reproducer": str(out), "reproducer_run": f"python {out}"}


IMPORTS = '''import inspect
import os
import sys


def cannot_play(kind, value, tb):
    """Anything unexpected (a class or method this vLLM lacks, a broken install) is exit 2, never
    exit 1: exit 1 says the bug is present."""
    import traceback
    traceback.print_exception(kind, value, tb)
    print(f"CANNOT PLAY: {kind.__name__}: {value}", flush=True)
    os._exit(2)


sys.excepthook = cannot_play

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
import torch
import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1 import kv_cache_interface as kci
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.core import single_type_kv_cache_manager as stm
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request, RequestStatus


def C(module, name):
    """A vLLM class or enum by its module (the spec classes' own modules)."""
    import importlib
    return getattr(importlib.import_module(module), name)


# Fields that make the layout what it is: a release without one cannot play the finding.
ESSENTIAL = {"sliding_window", "attention_chunk_size", "mamba_cache_mode", "tokens_per_state", "cache_role",
             "model_version", "prefix_cache_retention_interval", "use_eagle", "hash_block_size"}


def fit(fn, kw):
    """The arguments this release's `fn` takes: a field the recorded release had and this one
    lacks is left out and said (the adapter also passes scheduler_block_size, is_eagle_group,
    ... only where a release has them); one that defines the layout is exit 2."""
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kw
    left = sorted(k for k in kw if k not in params)
    if set(left) & ESSENTIAL:
        print(f"CANNOT PLAY: this vLLM's {getattr(fn, '__name__', fn)} has no {', '.join(sorted(set(left) & ESSENTIAL))}")
        sys.exit(2)
    if left:
        print(f"  (this vLLM's {getattr(fn, '__name__', fn)} has no {', '.join(left)}: left out)")
    return {k: v for k, v in kw.items() if k in params}

'''
