"""Upstream-ready reproducers: a standalone Python script per vLLM finding, next to its trace.

A maintainer should not need kvcheck to see a bug. The script imports only vLLM (its public
classes: ``KVCacheManager``, ``KVCacheConfig``, the attention specs, ``Request``), builds the
trace's layout, replays the trace's operations the way the adapter drives them (lookup =
``get_computed_blocks`` + admission ``allocate_slots``, prefill/decode = ``allocate_slots``,
finish/preempt = ``free``), checks the finding's condition in plain code, prints hit lengths
and block tables, and exits 1 while the bug is present, 0 when it is fixed. A planted fault
(a kvcheck negative control) is inside the script as a clearly marked monkeypatch; ``--clean``
leaves it out, which is how the test shows that the script passes on clean vLLM.

Checks with a standalone condition: see :data:`CONDITIONS`. Others get the replay command only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .vllm_layouts import _EAGLE, _LAYOUTS, _RETENTION, B, MAX_MODEL_LEN, MAX_TOKENS, VOCAB, layout_scale

KINDS = ("full", "swa", "chunked_local", "mla", "swa_mla")

# check -> the plain-code condition the script evaluates (a function body in _TEMPLATE)
CONDITIONS = {
    "refcount_equals_holders": "every block's ref_cnt equals the number of block tables holding it",
    "hash_map_sound": "every prefix-cache map entry points at a block that carries that hash",
    "hit_sound_swa_window": "a hit's sliding-window blocks cover the window its resume reads (no null)",
    "lost_reuse": "the hit is as long as the longest aligned prefix whose needed blocks are all in "
                  "the prefix-cache map",
    "lost_reuse_retention": "the hit reaches the boundary the retention policy promises "
                            "(prefix_cache_retention_interval: replay boundary, junction, every N tokens)",
    "read_before_write": "no hit returns a block that allocate_slots published in a step whose request was "
                         "then taken out of that step (preempted before its forward): its KV was never written",
}

_PLANTS = {
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


def reproducer_source(trace: Any, trace_path: str) -> str | None:
    """The script's text, or None when this finding has no standalone condition."""
    v = trace.violation or {}
    check = v.get("check")
    layout = trace.meta.get("layout")
    if check not in CONDITIONS or layout not in _LAYOUTS:
        return None
    groups = _LAYOUTS[layout][1]
    if any(k not in KINDS for k, _, _ in groups) or (trace.fault and trace.fault not in _PLANTS):
        return None
    steps = [[s.action, s.params] for s in trace.steps]
    plant = _PLANTS.get(trace.fault or "", "")
    header = (f"# Standalone reproducer of a kvcheck finding on vLLM {trace.meta.get('vllm_version')}\n"
              f"# layout {layout!r}: {_LAYOUTS[layout][0]}\n# check {check}: {CONDITIONS[check]}\n"
              f"# finding: {v.get('message', '')}\n# trace: {trace_path} (kvcheck replay {trace_path} --sut vllm)\n")
    fault_block = ("# ======== PLANTED FAULT (kvcheck negative control " + repr(trace.fault) +
                   "): not vLLM's code. Run with --clean to leave it out. ========" + plant +
                   "# ======== END OF PLANTED FAULT ========\n") if plant else "def plant(mgr):\n    pass\n"
    return _TEMPLATE.format(
        header=header, release=repr(trace.meta.get("vllm_version")), groups=repr(groups),
        sched=_LAYOUTS[layout][2], retention=repr(_RETENTION.get(layout)), num_blocks=int(trace.meta.get("num_blocks", 24)),
        B=B, max_len=MAX_MODEL_LEN, max_tokens=MAX_TOKENS, vocab=VOCAB, check=repr(check),
        promised=repr((trace.meta.get("lost_reuse_size") or {}).get("promised")),
        steps=repr(steps), fault_block=fault_block)


def write_reproducer(trace: Any, trace_path: str) -> dict:
    """Write `<trace>.repro.py` next to the trace; the finding's fields that say where."""
    check = (trace.violation or {}).get("check")
    layout = trace.meta.get("layout")
    # the script builds the manager at the adapter's small default scale, without drafters
    scaled = layout in _EAGLE or layout_scale(layout) != (B, MAX_MODEL_LEN)
    src = None if scaled else reproducer_source(trace, trace_path)
    if src is None:
        return {"reproducer": None,
                "reproducer_note": f"no standalone reproducer for check {check!r} on this layout: replay with "
                                   f"`kvcheck replay {trace_path} --sut vllm`"}
    out = Path(trace_path).with_suffix(".repro.py")
    out.write_text(src)
    return {"reproducer": str(out), "reproducer_run": f"python {out}"}


_TEMPLATE = '''{header}# Needs only vLLM (the release above; the KV cache manager runs on CPU). Exit 1: the bug is
# present; exit 0: fixed. Prints every step, each lookup's hit and the request's block tables.
import inspect
import os
import sys

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

RECORDED_RELEASE = {release}
GROUPS = {groups}          # (kind, block_size, window or chunk)
SCHED_BLOCK, RETENTION, NUM_BLOCKS = {sched}, {retention}, {num_blocks}
HASH_BLOCK, MAX_MODEL_LEN, MAX_TOKENS, VOCAB = {B}, {max_len}, {max_tokens}, {vocab}
CHECK, PROMISED = {check}, {promised}
STEPS = {steps}

{fault_block}

def cdiv(a, b):
    return -(-a // b)


def build():
    common = dict(num_kv_heads=1, head_size=8, dtype=torch.float32)
    specs = []
    for kind, bs, p in GROUPS:
        if kind == "full":
            specs.append(kci.FullAttentionSpec(block_size=bs, **common))
        elif kind == "swa":
            specs.append(kci.SlidingWindowSpec(block_size=bs, sliding_window=p, **common))
        elif kind == "chunked_local":
            specs.append(kci.ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=p, **common))
        elif kind == "mla":
            specs.append(kci.MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=16, dtype=torch.float32))
        else:
            specs.append(kci.SlidingWindowMLASpec(block_size=bs, sliding_window=p, num_kv_heads=1, head_size=16,
                                                  dtype=torch.float32))
    extra = ({{"prefix_cache_retention_interval": RETENTION}}
             if "prefix_cache_retention_interval" in inspect.signature(kci.KVCacheConfig).parameters else {{}})
    cfg = kci.KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                            kv_cache_groups=[kci.KVCacheGroupSpec([f"layer{{i}}"], s) for i, s in enumerate(specs)],
                            **extra)
    kw = {{"scheduler_block_size": SCHED_BLOCK}} if "scheduler_block_size" in inspect.signature(KVCacheManager).parameters else {{}}
    return KVCacheManager(cfg, max_model_len=MAX_MODEL_LEN, hash_block_size=HASH_BLOCK, **kw)


ku.init_none_hash(sha256)
mgr = build()
if "--clean" not in sys.argv:
    plant(mgr)
pool, coord = mgr.block_pool, mgr.coordinator
ALIGN = int(getattr(coord, "_cache_hit_alignment_tokens", SCHED_BLOCK))
hasher = ku.get_request_block_hasher(HASH_BLOCK, sha256)
EOS = {{"eos_token_id": None}} if "eos_token_id" in inspect.signature(Request).parameters else {{}}
reqs = {{}}
bugs = []
STEP = None           # a scheduler step: {{rid: tokens computed before it}}, and the deferred samples
UNWRITTEN = {{}}        # block id -> why its bytes were never written (published, then unscheduled)


def table(g, rid):
    return coord.single_type_managers[g].req_to_blocks.get(rid, [])


def tables(rid):
    return " | ".join(f"g{{g}} {{GROUPS[g][0]}}: " + str(["null" if b.is_null else b.block_id for b in table(g, rid)])
                      for g in range(len(GROUPS)))


def group_hash(o, g, i):
    bs = GROUPS[g][1]
    if (i + 1) * bs // HASH_BLOCK > len(o.block_hashes):
        return None
    return o.block_hashes[i] if bs == HASH_BLOCK else ku.BlockHashListWithBlockSize(o.block_hashes, HASH_BLOCK, bs)[i]


def needed(g, L):
    """Blocks of group g a resume at L reads."""
    kind, bs, p = GROUPS[g]
    if kind in ("full", "mla"):
        return range(0, L // bs)
    if kind == "chunked_local":
        return range((L // p) * p // bs, cdiv(L, bs))
    return range(max(0, L - p + 1) // bs, cdiv(L, bs))


def map_usable(o):
    """Longest aligned hit whose needed blocks are all in the prefix-cache map."""
    cache = pool.cached_block_hash_to_block
    for L in range((o.num_tokens - 1) // ALIGN * ALIGN, 0, -ALIGN):
        if all((h := group_hash(o, g, i)) is not None
               and cache.get_one_block(ku.make_block_hash_with_group_id(h, g)) is not None
               for g in range(len(GROUPS)) for i in needed(g, L)):
            return L
    return 0


def check_state():
    if CHECK == "refcount_equals_holders":
        holders = {{}}
        for m in coord.single_type_managers:
            for lst in m.req_to_blocks.values():
                for b in lst:
                    if not b.is_null:
                        holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in pool.blocks:
            if not b.is_null and b.ref_cnt != holders.get(b.block_id, 0):
                bugs.append(f"block #{{b.block_id}}: ref_cnt {{b.ref_cnt}} but {{holders.get(b.block_id, 0)}} holder(s)")
    if CHECK == "hash_map_sound":
        by_block = getattr(pool, "cached_block_hashes_by_block", {{}})
        for key, val in pool.cached_block_hash_to_block._cache.items():
            for b in ([val] if not isinstance(val, dict) else list(val.values())):
                if b.block_hash != key and key not in by_block.get(b.block_id, ()):
                    bugs.append(f"prefix-cache map entry points at block #{{b.block_id}}, which does not carry it")


def maybe_sample(o, tok=None):
    if o.num_computed_tokens == o.num_tokens and o.num_tokens < MAX_TOKENS:
        o.append_output_token_ids(tok if tok is not None else (o.num_tokens * 7) % VOCAB)


def lookup(r, chunk, last, la=0):
    o = reqs[r]
    usable = map_usable(o)
    blocks, hit, *junction = mgr.get_computed_blocks(o)
    if junction:
        o.shared_prefix_boundary = junction[0]      # as vLLM's scheduler does
    print(f"  hit {{hit}} of {{o.num_tokens}} tokens; hit blocks: " + " | ".join(
        f"g{{g}}: " + str(["null" if b.is_null else b.block_id for b in lst]) for g, lst in enumerate(blocks.blocks)))
    if CHECK == "hit_sound_swa_window":
        for g, lst in enumerate(blocks.blocks):
            if GROUPS[g][0] in ("swa", "swa_mla") and hit:
                for i in needed(g, hit):
                    if i < len(lst) and lst[i].is_null:
                        bugs.append(f"{{r}}: hit {{hit}}, group {{g}} block {{i}} (tokens {{i * GROUPS[g][1]}}.."
                                    f"{{(i + 1) * GROUPS[g][1] - 1}}) that the window reads is the null block")
    if CHECK == "read_before_write":
        for g, lst in enumerate(blocks.blocks):
            for b in lst:
                if not b.is_null and b.block_id in UNWRITTEN:
                    bugs.append(f"{{r}}: hit {{hit}} returns block #{{b.block_id}} (group {{g}}), "
                                f"{{UNWRITTEN[b.block_id]}}")
    if CHECK == "lost_reuse" and last and hit < usable:
        bugs.append(f"{{r}}: every block a {{usable}}-token hit needs is in the prefix-cache map, vLLM hit {{hit}}")
    if CHECK == "lost_reuse_retention" and last and hit < PROMISED:
        bugs.append(f"{{r}}: prefix_cache_retention_interval={{RETENTION}} promises a {{PROMISED}}-token hit "
                    f"(vllm/config/cache.py: the latest replay boundary and shared-prefix junctions are "
                    f"retained), vLLM hit {{hit}}")
    chunk = max(1, min(chunk, o.num_tokens - hit))
    new = mgr.allocate_slots(o, chunk, hit, blocks, **({{"num_lookahead_tokens": la}} if la else {{}}))
    if new is None:
        print("  admission refused (no free blocks)")
        return
    reallocated(new)
    o.status = RequestStatus.RUNNING
    o.num_computed_tokens = hit + chunk
    scheduled(o, hit, None)
    print(f"  admitted, computed {{o.num_computed_tokens}}; tables: {{tables(r)}}")


def step(o, n, tok, la=0):
    new = mgr.allocate_slots(o, n, **({{"num_lookahead_tokens": la}} if la else {{}}))
    if new is None:
        print("  allocation refused")
        return
    reallocated(new)
    o.num_computed_tokens += n
    scheduled(o, o.num_computed_tokens - n, tok)


def scheduled(o, lo, tok):
    """In a scheduler step the forward runs (and the token is sampled) at `forward`."""
    if STEP is None:
        maybe_sample(o, tok)
    else:
        STEP["lo"][o.request_id] = lo
        STEP["samples"].append((o, tok))


def reallocated(new):
    for lst in new.blocks:
        for b in lst:
            UNWRITTEN.pop(b.block_id, None)     # a fresh allocation: its old hash is gone


def unscheduled(o):
    """The PRIORITY scheduler preempts a request it already scheduled in this step
    (scheduler.py: `preempted_req in scheduled_running_reqs`): its forward never runs."""
    lo = STEP["lo"].pop(o.request_id)
    STEP["samples"] = [x for x in STEP["samples"] if x[0] is not o]
    for g, (_, bs, _) in enumerate(GROUPS):
        for i, b in enumerate(table(g, o.request_id)):
            if (i + 1) * bs > lo and not b.is_null and b.block_hash is not None:
                UNWRITTEN[b.block_id] = (f"published by {{o.request_id}}'s allocate_slots, which was then "
                                         "preempted in the same step before its forward: never written")


print(f"vLLM {{vllm.__version__}} (finding recorded on {{RECORDED_RELEASE}}); layout {{GROUPS}}, "
      f"retention {{RETENTION}}, {{NUM_BLOCKS}} blocks")
for n, (action, p) in enumerate(STEPS):
    last = n == len(STEPS) - 1
    print(f"step {{n}}: {{action}} {{p}}")
    if action == "submit":
        reqs[p["r"]] = Request(p["r"], list(p["tokens"]), SamplingParams(max_tokens=MAX_TOKENS), None,
                               cache_salt=p.get("salt"), block_hasher=hasher, **EOS)
    elif action == "begin_step":
        STEP = {{"lo": {{}}, "samples": []}}
    elif action == "forward":
        for o, tok in STEP["samples"]:
            if o.request_id in reqs:
                maybe_sample(o, tok)
        STEP = None
    elif action == "lookup":
        lookup(p["r"], p["chunk"], last, p.get("la", 0))
    elif action == "prefill":
        o = reqs[p["r"]]
        step(o, max(1, min(p["chunk"], o.num_tokens - o.num_computed_tokens)), None, p.get("la", 0))
    elif action == "decode":
        step(reqs[p["r"]], 1, p["tok"], p.get("la", 0))
    elif action in ("finish", "preempt"):
        o = reqs[p["r"]]
        if STEP is not None and p["r"] in STEP["lo"]:
            unscheduled(o)
        mgr.free(o)
        if action == "finish":
            del reqs[p["r"]]
        else:
            o.status, o.num_computed_tokens = RequestStatus.PREEMPTED, 0
            o.num_preemptions += 1
    elif action == "reset_prefix_cache":
        print(f"  reset: {{mgr.reset_prefix_cache()}}")
    elif action == "evict_blocks":
        mgr.evict_blocks({{i for i in p["block_ids"] if 0 < i < NUM_BLOCKS}})
    check_state()
    if bugs:
        print("BUG: " + "; ".join(bugs))
        sys.exit(1)
print("OK: the condition holds on every step (fixed, or not this release)")
sys.exit(0)
'''
