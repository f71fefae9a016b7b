"""Standalone reproducers of scheduler-drive findings (``--drive engine``): a script per finding
that imports only vLLM, builds the release's own v1 ``Scheduler`` as ``sched_build.build`` does,
and replays the trace's submit / step / abort / reset_prefix_cache (``running``: the scheduler's
reset preempting the running requests first) / evict_blocks through it.

What a step is, in the script as in kvcheck (engine_sched.py): ``schedule()`` → a forward that
writes every scheduled token's KV (the ``SchedulerOutput``'s ``num_scheduled_tokens``; the
queued block copies run first) → one greedy token per request whose prompt is done (kvcheck's
``next_token``, its source copied in by ``inspect``) → ``update_from_output()``. The script
watches the scheduler's calls into its own manager (``get_computed_blocks``,
``allocate_slots``, ``free``, ``take_kv_cache_block_copies``) to keep the manager reproducer's
content model (reproducer_body.py: its helpers are taken from there by name, never retyped),
and checks the finding's one condition in plain code: :data:`ENGINE_CONDITIONS`. A planted fault
is a marked monkeypatch (reproducer.py's where it fits the scheduler's manager); ``--clean``
leaves it out. Exit 1: the bug is present; 0: fixed (or not this release); 2: a step this vLLM
cannot play.

What only kvcheck's spec knows is data in the script (the blocks a hit's resume reads; for a lost
reuse, the prefix-cache entries of the usable hit, each looked up in vLLM's map by the script).
"""
from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path
from typing import Any

from .engine_repro_body import ENGINE_BODY
from .reproducer import IMPORTS, PLANTS, CONDITIONS, changed_fields, script_parts
from .reproducer_body import BODY

# check -> the plain-code condition the script evaluates on the scheduler drive
ENGINE_CONDITIONS = {
    **{k: CONDITIONS[k] for k in ("refcount_equals_holders", "hash_map_sound", "hit_aligned",
                                  "hit_leaves_last_token", "hit_length_equal", "hit_sound_swa_window",
                                  "hit_sound_chunked_local", "hit_sound_compressed_kv", "hit_sound_indexer",
                                  "vllm_internal_error")},
    "read_before_write": "every block a scheduled request's forward reads holds its prefix, written by a forward "
                         "that ran: the script runs each SchedulerOutput's forward (its num_scheduled_tokens), so a "
                         "block published by allocate_slots of a request the PRIORITY scheduler then preempted in "
                         "the same step is never written",
    "state_copy_sound": "every block copy a step queues (take_kv_cache_block_copies) reads a source that holds, "
                        "when the copy runs (before the step's forward), what the destination needs",
    "lost_reuse": CONDITIONS["lost_reuse"] + " (at the finding's lookup, inside the last step's schedule())",
    "toctou_bound_stable": "under async scheduling, every output vLLM drops is stale: its frame was scheduled "
                           "before the request's forced preemption (reset_prefix_cache(reset_running_requests=True)); "
                           "a token of a later frame is real, and the next forward already computed its KV",
    "worker_table_sound": "before each step's forward, every scheduled request's block table as the worker builds "
                          "it from the SchedulerOutputs alone (finished_req_ids dropped, a new request's block_ids, "
                          "a running one's new_block_ids appended per group, a resumed one's replacing its table: "
                          "GPUModelRunner._update_states) equals the manager's req_to_blocks at every position whose "
                          "block is not null, and is no longer",
}
# the checks whose state needs more than this replay: kvcheck's replay shows them
NOT_STANDALONE = {
    "lost_reuse_retention": "a promise of the dense twin, which runs on the manager drive only",
    "hit_sound_recurrent_state": "Mamba groups are not on the scheduler drive",
}

_SPLIT_FORWARD = '''
def plant(mgr):
    global SPLIT_FORWARD
    SPLIT_FORWARD = True      # the worker runs the step's newly admitted requests in a forward of their
                              # own, before the running requests' forward (a micro-batched step)
'''
_STALE_OUTPUT = '''
def plant(mgr):
    global STALE_OUTPUT
    STALE_OUTPUT = True       # after each schedule(), stale_output changes the SchedulerOutput the worker gets


def stale_output(so):
    """The scheduler leaves the first new block of the first running (not resumed) request with new
    blocks out of the step's new_block_ids: the worker never learns it."""
    c = so.scheduled_cached_reqs
    for i, rid in enumerate(c.req_ids):
        new = c.new_block_ids[i]
        if new is not None and rid not in (getattr(c, "resumed_req_ids", None) or ()) and any(new):
            g = next(g for g, x in enumerate(new) if x)
            c.new_block_ids[i] = tuple(x[1:] if k == g else x for k, x in enumerate(new))
            return
'''
# planted fault -> its monkeypatch (`plant(sched.kv_cache_manager)`); the manager reproducer's
# where the scheduler's manager takes it as is; for the others a global the body consults: the
# fake worker's split forward, the scheduler's output changed after schedule()
ENGINE_PLANTS = {**{k: PLANTS[k] for k in ("drop_ref_on_free", "swa_hit_unchecked", "swa_overstrict",
                                             "evict_keeps_hash")},
                 "early_reader_forward": _SPLIT_FORWARD, "worker_table_stale": _STALE_OUTPUT}

# the manager reproducer's content model and checks, used as they are (reproducer_body.py)
HELPERS = ("cdiv", "content", "holds", "table", "ids", "tables", "group_hash", "note_keys", "cached",
           "stamp", "own", "claim", "check_hit", "check_state")


def helpers_source() -> str:
    """The functions of reproducer_body.BODY named in HELPERS, by name (KeyError: one is gone)."""
    tree = ast.parse(BODY)
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    return "\n\n".join(ast.get_source_segment(BODY, defs[n]) for n in HELPERS) + "\n"


def _model_kw() -> dict[str, Any]:
    """The tiny model's fields, read off the config.json sched_build writes (the script writes
    its own with the running release's transformers)."""
    from .sched_build import model_dir
    got = json.loads((Path(model_dir()) / "config.json").read_text())
    return {k: got[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "vocab_size", "max_position_embeddings", "architectures")}


def record_engine(trace: Any) -> dict | None:
    """Replay the trace on the scheduler drive's adapter and record what the script needs: the
    steps it played, the layout's specs and knobs, and at the finding's lookup the spec's numbers
    (the hit and the blocks its resume reads; for a lost reuse, the usable hit and its witness
    entries). None when the trace does not reproduce its check here."""
    from kvcheck.spec.sut import ActionRejected
    from .build import make_adapter, resolve_layout
    from .engine_gen import knobs_of
    from .layouts import EAGLE, RETENTION, layout_scale, make_specs, vllm_modules
    layout = resolve_layout(trace)
    knobs = knobs_of(trace.meta)
    want = (trace.violation or {}).get("check")
    ad = make_adapter(layout, knobs.num_blocks, trace.fault, bool(trace.meta.get("strict_reuse")), False, knobs)
    seen: list[dict] = []          # the open step's lookups, as the adapter judged them
    check_hit, judge_hit = ad._check_hit, ad._judge_hit

    def spy_check(req: Any, blocks: Any, hit: int) -> None:
        seen.append({"r": req.rid, "hit": hit,
                     "needed": {str(g): ad.needed_hit(g, hit) for g in range(len(ad.groups))} if hit else {}})
        check_hit(req, blocks, hit)

    def spy_judge(req: Any, usable: int, hit: int) -> dict:
        if hit < usable:
            seen.append({"r": req.rid, "hit": hit, "usable": usable, "witness": ad.usable_at(req, usable) or []})
        return judge_hit(req, usable, hit)
    ad._check_hit, ad._judge_hit = spy_check, spy_judge
    steps: list[list] = []
    for s in trace.steps:
        seen.clear()
        try:
            ad.apply(s.action, dict(s.params))
        except ActionRejected:
            continue
        steps.append([s.action, dict(s.params)])
        broke = ad.extra_checks(s.action, s.params)
        if broke is not None:
            if broke[1] != want:
                return None
            break
    else:
        return None
    lost = [x for x in seen if "usable" in x]
    expect = (lost[-1] if want == "lost_reuse" and lost else
              next((x for x in reversed(seen) if "needed" in x), {}) if want.startswith("hit_") else {})
    drafter = EAGLE.get(layout) or ()
    specs = make_specs(layout)
    hb, max_len = layout_scale(layout)
    return {"layout": layout, "groups": ad.groups, "hb": hb, "sched": ad.sched_bs, "max_len": max_len,
            "steps": steps, "knobs": knobs.as_dict(), "max_tokens": ad.max_tokens,
            "specs": [(type(x).__module__, type(x).__name__, changed_fields(x)) for x in specs],
            "group_kw": [{"is_eagle_group": g in drafter} if drafter else {} for g in range(len(specs))],
            "config_kw": ({"prefix_cache_retention_interval": RETENTION[layout]}
                          if layout in RETENTION and "retention_interval" in vllm_modules()["features"] else {}),
            "drafter": layout in EAGLE, "expect": {**expect, "promised": None}}


def without_connector(trace: Any) -> Any:
    """The trace as its script replays it: an episode with the KV connector on replays with it off
    when the finding needs none of its transfers (it reproduces so); None when it needs them."""
    import copy
    if not ((trace.meta or {}).get("scheduler") or {}).get("connector"):
        return trace
    plain = copy.deepcopy(trace)
    plain.meta["scheduler"]["connector"] = False
    if record_engine(plain) is not None:
        return plain
    return None if record_engine(trace) is not None else trace     # (not at all: said as such later)


def why_not(trace: Any) -> str | None:
    """Why this engine finding gets no standalone script (None: it gets one, if it replays)."""
    from .build import resolve_layout
    from .layouts import LAYOUT_DATA
    check = (trace.violation or {}).get("check")
    if check == "toctou_bound_stable" and "scheduled after its forced preemption" not in \
            (trace.violation or {}).get("message", ""):
        return "check 'toctou_bound_stable': the script checks only the async-scheduling drop condition"
    if check in NOT_STANDALONE:
        return f"check {check!r}: {NOT_STANDALONE[check]}"
    if check not in ENGINE_CONDITIONS:
        return f"check {check!r} has no plain-code condition on the scheduler drive"
    if trace.fault and trace.fault not in ENGINE_PLANTS:
        return f"planted fault {trace.fault!r} has no standalone monkeypatch on the scheduler drive"
    if any(k == "mamba" for k, _, _ in LAYOUT_DATA[resolve_layout(trace)][1]):
        return "a Mamba group: the script has no model of the worker's state copies yet"
    return None


def engine_reproducer_source(trace: Any, trace_path: str) -> str | None:
    """The script's text, or None when this finding has no standalone condition (why_not)."""
    from .sampler import draft_tokens, next_token
    from .layouts import VOCAB
    v = trace.violation or {}
    check = v.get("check")
    if why_not(trace) is not None:
        return None
    rec = record_engine(trace)
    if rec is None:
        return None
    plant = ENGINE_PLANTS.get(trace.fault or "", "")
    header = (f"# Standalone reproducer of a kvcheck finding on vLLM {trace.meta.get('vllm_version')}, driven by\n"
              "# vLLM's own v1 Scheduler (schedule -> forward -> update_from_output), built on CPU\n"
              f"# layout {rec['layout']!r}: groups (kind, block size, window/chunk) {rec['groups']}, hash block "
              f"{rec['hb']}\n# scheduler knobs: {rec['knobs']}\n"
              f"# check {check}: {ENGINE_CONDITIONS[check]}\n"
              f"# finding: {v.get('message', '')}\n# trace: {trace_path} (kvcheck replay {trace_path} --sut vllm)\n"
              "# Needs only vLLM (and transformers, to write a tiny model's config.json: nothing is\n"
              "# downloaded). Exit 1: the bug is present; exit 0: fixed (or not this release); 2: a step\n"
              "# this vLLM cannot play.\n"
              "import os\nos.environ.setdefault(\"HF_HUB_OFFLINE\", \"1\")\n")
    fault_block, head = script_parts(trace, rec, plant)
    data = (head +
            f"KNOBS = {rec['knobs']!r}   # the episode's scheduler configuration\n"
            f"NUM_BLOCKS, HASH_BLOCK, SCHED_BLOCK = {rec['knobs']['num_blocks']}, {rec['hb']}, {rec['sched']}\n"
            f"MAX_MODEL_LEN, MAX_TOKENS, VOCAB = {rec['max_len']}, {rec['max_tokens']}, {VOCAB}\n"
            f"DRAFTER = {rec['drafter']}   # an EAGLE drafter (SpeculativeConfig; no draft is proposed)\n"
            f"ASYNC = {bool(rec['knobs'].get('async_sched'))}   # async scheduling: AsyncScheduler under the "
            "engine core's two-deep batch queue\n"
            f"MODEL = {_model_kw()!r}   # a tiny Llama: the scheduler reads only lengths and flags\n"
            f"CHECK = {check!r}\n"
            f"EXPECT = {rec['expect']!r}   # the spec's numbers at the finding's lookup (checked in vLLM's state)\n"
            f"STEPS = {rec['steps']!r}\n")
    from .engine_async import discarding
    token = "\n\nimport zlib\n\n\n" + "\n\n".join(inspect.getsource(f) for f in (next_token, draft_tokens, discarding))
    return (header + IMPORTS + data + token + "\n\nSPLIT_FORWARD = STALE_OUTPUT = False\n" + fault_block + "\n\n"
            + helpers_source() + ENGINE_BODY)


def write_engine_reproducer(trace: Any, trace_path: str) -> dict:
    """Write `<trace>.repro.py` next to an engine trace; the finding's fields that say where
    (the keys of reproducer.write_reproducer)."""
    check = (trace.violation or {}).get("check")
    replay = f"replay with `kvcheck replay {trace_path} --sut vllm`"
    try:
        plain = trace if why_not(trace) is not None else without_connector(trace)
        if plain is None:
            return {"reproducer": None, "reproducer_note": "no standalone reproducer (the finding needs the KV "
                    "connector's transfers, and the script has no model of its external store yet: connector.py)"
                    f": {replay}"}
        src = engine_reproducer_source(plain, trace_path)
    except Exception as e:    # (a finding is saved even when its script cannot be made: said, not raised)
        return {"reproducer": None, "reproducer_note": f"no standalone reproducer ({type(e).__name__}: {e}): {replay}"}
    if src is None:
        why = why_not(trace) or f"the trace does not reproduce {check!r} on this vLLM and kvcheck"
        return {"reproducer": None, "reproducer_note": f"no standalone reproducer ({why}): {replay}"}
    out = Path(trace_path).with_suffix(".repro.py")
    out.write_text(src)
    return {"reproducer": str(out), "reproducer_run": f"python {out}"}
