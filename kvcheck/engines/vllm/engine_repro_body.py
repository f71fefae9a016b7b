"""The fixed part of a scheduler-drive reproducer (engine_repro.py writes the data, the planted
fault and the manager reproducer's content-model helpers above it).

It builds vLLM's own ``Scheduler`` the way kvcheck's sched_build.build does (every constructor's
arguments checked against the running release's signatures), watches the scheduler's calls into
its manager, runs the fake worker (its block tables from each SchedulerOutput alone, as worker.py
keeps them; each step's copies, then its forward's writes, then its reads), and replays the steps.
No kvcheck import: a maintainer runs it with vLLM alone.
"""

ENGINE_BODY = r'''
import atexit
import contextlib
import io
import shutil
import tempfile

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

TORN = ("<torn>", ())      # bytes mixing two prefixes: hold no prefix


def vllm_config():
    """The engine's VllmConfig for a tiny Llama whose config.json is written here (no weights)."""
    from transformers import LlamaConfig
    d = tempfile.mkdtemp(prefix="kvcheck-model-")
    atexit.register(shutil.rmtree, d, True)
    LlamaConfig(**MODEL).save_pretrained(d)
    # (older releases print "Error retrieving safetensors" for a directory without weights)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        mc = ModelConfig(model=d, skip_tokenizer_init=True, max_model_len=MODEL["max_position_embeddings"],
                         dtype="float32")
    mc.max_model_len = MAX_MODEL_LEN
    sc = SchedulerConfig(**fit(SchedulerConfig, dict(
        max_num_batched_tokens=KNOBS["max_num_batched_tokens"], max_num_seqs=KNOBS["max_num_seqs"],
        max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True, policy=KNOBS["policy"],
        long_prefill_token_threshold=KNOBS["long_prefill_token_threshold"], is_encoder_decoder=False)))
    if "async_scheduling" in inspect.signature(SchedulerConfig).parameters:
        sc.async_scheduling = ASYNC      # (as --[no-]async-scheduling; kept from the CPU platform's override below)
    attn = [bs for _, bs, _ in GROUPS]
    multi = len(GROUPS) > 1
    cc = CacheConfig(block_size=min(attn) if multi else attn[0], enable_prefix_caching=True,
                     **({"prefix_match_unit": HASH_BLOCK}
                        if multi and "prefix_match_unit" in inspect.signature(CacheConfig).parameters else {}))
    cc.num_gpu_blocks = NUM_BLOCKS
    spec = {}
    if DRAFTER:       # (built for one draft token, then the two fields the scheduler reads are set)
        import copy
        from vllm.config import SpeculativeConfig
        sp = copy.copy(SpeculativeConfig(method="eagle", model=d, num_speculative_tokens=1, target_model_config=mc,
                                         target_parallel_config=ParallelConfig()))
        sp.num_speculative_tokens = max(1, KNOBS["spec_tokens"])
        if hasattr(sp, "disable_lookahead_block_hashes"):
            sp.disable_lookahead_block_hashes = KNOBS.get("eagle_drop", False)
        spec["speculative_config"] = sp
    import vllm.triton_utils as tu     # (0.34's CPU platform wants triton-cpu for its kernels: none run here)
    from vllm import platforms
    cp = platforms.current_platform
    orig = cp.check_and_update_config

    def keep(vc):                      # (the CPU platform turns async scheduling off; a GPU engine keeps it)
        before = vc.scheduler_config.async_scheduling
        orig(vc)
        vc.scheduler_config.async_scheduling = before
    had, tu.HAS_TRITON, cp.check_and_update_config = getattr(tu, "HAS_TRITON", True), True, keep
    try:
        return VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, device_config=DeviceConfig(device="cpu"),
                          **spec)
    finally:
        tu.HAS_TRITON = had
        del cp.check_and_update_config


def kv_cache_config():
    groups = []
    for i, ((mod, cls, kw), gkw) in enumerate(zip(SPECS, GROUP_KW)):
        try:
            spec_cls = C(mod, cls)
        except (ImportError, AttributeError):
            print(f"CANNOT PLAY: this vLLM has no {mod}.{cls} (group {i})")
            sys.exit(2)
        groups.append(kci.KVCacheGroupSpec(**fit(kci.KVCacheGroupSpec, {
            "layer_names": [f"layer{i}"], "kv_cache_spec": spec_cls(**fit(spec_cls, kw)), **gkw})))
    return kci.KVCacheConfig(**fit(kci.KVCacheConfig, {"num_blocks": NUM_BLOCKS, "kv_cache_tensors": [],
                                                       "kv_cache_groups": groups, **CONFIG_KW}))


def build():
    """vLLM's Scheduler, as EngineCore builds it: its block sizes from the release's own rule."""
    vc, kcfg = vllm_config(), kv_cache_config()
    resolve = getattr(ku, "resolve_kv_cache_block_sizes", None)
    sbs, hbs = resolve(kcfg, vc) if resolve is not None else (vc.cache_config.block_size,) * 2
    if (sbs, hbs) != (SCHED_BLOCK, HASH_BLOCK):
        print(f"CANNOT PLAY: this vLLM derives scheduler block {sbs} and hash block {hbs} for these groups "
              f"(the finding needs {SCHED_BLOCK} and {HASH_BLOCK})")
        sys.exit(2)
    hbs_arg = {"hash_block_size": hbs} if "hash_block_size" in inspect.signature(Scheduler).parameters else {}
    cls = Scheduler
    if ASYNC:                  # (async scheduling: the engine core's batch queue steps it, below)
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as cls
    sched = cls(**fit(cls, dict(vllm_config=vc, kv_cache_config=kcfg, block_size=sbs, log_stats=True,
                                            structured_output_manager=StructuredOutputManager(vc), **hbs_arg)))
    la = getattr(vc, "num_hash_lookahead_tokens", 0) or 0
    hasher = (ku.get_request_block_hasher(hbs, sha256, la)
              if len(inspect.signature(ku.get_request_block_hasher).parameters) > 2
              else ku.get_request_block_hasher(hbs, sha256))
    return sched, hasher


ku.init_none_hash(sha256)
sched, hasher = build()
mgr = sched.kv_cache_manager
if "--clean" not in sys.argv:
    plant(mgr)
pool, coord = mgr.block_pool, mgr.coordinator
ALIGN = int(getattr(coord, "_cache_hit_alignment_tokens", 0) or SCHED_BLOCK)
REQ_ARGS = set(inspect.signature(Request).parameters)
reqs, ALL, OWNED, RESUMED = {}, {}, {}, {}   # live requests; every one; its own blocks; its last hit
HOLDS, READY, KEYS = {}, {}, {}     # block -> content it will hold / its bytes hold; key -> content
STEP = None                         # the open step: what its forward runs, its queued copies
RETAINED = []                       # blocks the scheduler holds for copies not yet run
ACCEPTED = {}                       # rid -> draft positions [lo, hi) of the step the sampler accepted
WT = {}                             # rid -> the worker's block table, one list of block ids per group
LAST = False                        # in the trace's last step (the finding's)
INFLIGHT = None                     # async: (SchedulerOutput, its model output, frame number) on its way
FRAMES, RESET_AT = [0], {}          # async: frames scheduled; rid -> frames scheduled before its forced reset
bugs = []


# ---- watching the scheduler's calls into its KV cache manager ------------------------------
def hook(name, around):
    inner = getattr(mgr, name)
    setattr(mgr, name, lambda *a, **k: around(inner, *a, **k))


def on_lookup(inner, o, *a, **k):
    out = inner(o, *a, **k)
    blocks, hit, rid = out[0], out[1], o.request_id
    RESUMED[rid] = hit
    print(f"    lookup {rid}: hit {hit} of {o.num_tokens} tokens; hit blocks: "
          + " | ".join(f"g{g}: {ids(lst)}" for g, lst in enumerate(blocks.blocks)))
    if not CHECK.startswith("lost_reuse") or (LAST and rid == EXPECT.get("r")):
        check_hit(rid, o, blocks, hit)
    return out


ALLOC = inspect.signature(type(mgr).allocate_slots)


def on_alloc(inner, o, *a, **k):
    """The blocks a request allocates will hold its tokens up to what this step computes."""
    args = ALLOC.bind(mgr, o, *a, **k).arguments
    lo = o.num_computed_tokens
    new = inner(o, *a, **k)
    end = lo + int(args.get("num_new_computed_tokens", 0) or 0) + int(args["num_new_tokens"])
    print(f"    allocate_slots {o.request_id} for tokens up to {end}: "
          + ("refused" if new is None else "new blocks " + " | ".join(f"g{g}: {ids(lst)}"
                                                                       for g, lst in enumerate(new.blocks))))
    if new is not None and o.request_id in OWNED:
        own(o.request_id, new)
        stamp(o, lo, min(end, o.num_tokens))          # (draft positions: once accepted)
    return new


def on_free(inner, o, *a, **k):
    accept(o.request_id)                 # (a request finishing in update_from_output: its drafts first)
    print(f"    free {o.request_id}: {tables(o.request_id)}")
    out = inner(o, *a, **k)
    OWNED[o.request_id] = [set() for _ in GROUPS]
    return out


def on_copies(inner, *a, **k):
    """The copies the step queued run before its forward."""
    out = inner(*a, **k)
    for c in out[0]:
        want, exact = claim(c.src_block_id, c.dst_block_id)
        print(f"    queued copy #{c.src_block_id} -> #{c.dst_block_id}")
        if CHECK == "state_copy_sound" and (want is None or not holds(HOLDS.get(c.src_block_id), want, exact)):
            bugs.append(f"copy #{c.src_block_id} -> #{c.dst_block_id}: the source will not hold what the "
                        "destination needs")
        HOLDS[c.dst_block_id] = want
        STEP["copies"].append((c.src_block_id, c.dst_block_id, want, exact))
    return out


hook("get_computed_blocks", on_lookup)
hook("allocate_slots", on_alloc)
hook("free", on_free)
if hasattr(mgr, "take_kv_cache_block_copies"):
    hook("take_kv_cache_block_copies", on_copies)


# ---- the fake worker ---------------------------------------------------------------------
def reads(g, n):
    """Table indices of group g the next token of a request at n computed tokens attends to."""
    kind, bs, p = GROUPS[g]
    if kind in ("tail_ring", "mamba"):
        return range(0)
    if kind in ("compressed", "indexer"):      # entries of complete compression blocks
        return range(0, (n // p) * p // bs)
    lo = (n // p) * p if kind == "chunked_local" else max(0, n - p + 1) if kind in ("swa", "swa_mla") else 0
    return range(lo // bs, cdiv(n, bs))


def write(o, lo, hi):
    """The forward writes tokens [lo, hi) into the request's own blocks; what a block holds before
    lo must be the request's own prefix (else its bytes are torn)."""
    for g, (kind, bs, _) in enumerate(GROUPS):
        if kind in ("tail_ring", "mamba"):
            continue
        t = table(g, o.request_id)
        for i in range(lo // bs, min(len(t), cdiv(hi, bs))):
            b = t[i]
            if not b.is_null and b.block_id in OWNED[o.request_id][g]:
                ok = i * bs >= lo or holds(READY.get(b.block_id), content(o, lo), False)
                READY[b.block_id] = content(o, min((i + 1) * bs, hi)) if ok else TORN


def check_reads(o, lo):
    for g, (kind, bs, _) in enumerate(GROUPS):
        t = table(g, o.request_id)
        for i in reads(g, lo):
            b = t[i] if i < len(t) else None
            if b is None or b.is_null:
                continue
            end = min((i + 1) * bs, lo)
            if CHECK == "read_before_write" and not holds(READY.get(b.block_id), content(o, end), False):
                bugs.append(f"{o.request_id}'s forward (tokens from {lo}) reads block #{b.block_id} (group {g} "
                            f"{kind}, tokens {i * bs}..{end - 1}), whose bytes were never written with that prefix "
                            "by a forward that ran (vLLM published it at schedule time)")


def worker(so):
    """The model runner's block tables, from the SchedulerOutput alone (GPUModelRunner._update_states;
    a resumed request's new_block_ids replace its table); then worker_table_sound, before the forward."""
    c, check = so.scheduled_cached_reqs, CHECK == "worker_table_sound"
    for rid in so.finished_req_ids:
        WT.pop(rid, None)
    WT.update({x.req_id: [list(b) for b in x.block_ids] for x in so.scheduled_new_reqs})
    for rid, new in zip(c.req_ids, c.new_block_ids):
        if rid in (getattr(c, "resumed_req_ids", None) or ()):
            if new is None and check:
                bugs.append(f"{rid} resumes from preemption without its block table (new_block_ids is None)")
            WT[rid] = [list(b) for b in new or ()]
        elif new is not None:
            for t, b in zip(WT.setdefault(rid, [[] for _ in new]), new):
                t.extend(b)
    for rid in so.num_scheduled_tokens if check else ():
        have = WT.get(rid, [])
        for g in range(len(GROUPS)):
            want, got = table(g, rid), have[g] if g < len(have) else []
            if len(got) > len(want) or any(not b.is_null and (i >= len(got) or got[i] != b.block_id)
                                           for i, b in enumerate(want)):
                bugs.append(f"{rid}'s block table in the worker (group {g}), built from the scheduler's outputs, is "
                            f"{got} where the manager's is {ids(want)}: its forward misses or misplaces blocks")


def forward():
    """The step runs: its queued copies, then its forward (every layer writes the whole batch's
    new KV, then attends); SPLIT_FORWARD (a planted fault): the admitted requests first."""
    global STEP
    step, STEP = STEP, None
    for src, dst, want, exact in step["copies"]:
        if CHECK == "state_copy_sound" and (want is None or not holds(READY.get(src), want, exact)):
            bugs.append(f"the step copies #{src} -> #{dst} before its forward, but #{src}'s bytes are "
                        + ("not written yet" if src not in READY else "not what the copy claims"))
        READY[dst] = want
    items = list(step["sched"].items())
    for phase in ([[x for x in items if x[1][2]], [x for x in items if not x[1][2]]] if SPLIT_FORWARD else [items]):
        # (async: a request finished by the previous frame's output still runs here; vLLM drops it)
        phase = [x for x in phase if x[0] in sched.requests]
        for rid, (lo, hi, _) in phase:
            write(ALL[rid], lo, hi)
        for rid, (lo, hi, _) in phase:
            check_reads(ALL[rid], lo)


def sampled(o, drafts):
    """The greedy model's tokens for a scheduled request: none mid-prompt; else the token after its
    context, and after each of its scheduled drafts while they match (the rejection sampler)."""
    if o.num_computed_tokens - len(drafts) < o.num_tokens:
        return []
    ctx, out = list(o.all_token_ids), []
    while True:
        out.append(next_token(ctx))
        if len(out) > len(drafts) or drafts[len(out) - 1] != out[-1]:
            return out
        ctx.append(out[-1])


def accept(rid):
    """Accepted draft positions: the forward wrote their KV, which is right."""
    span = ACCEPTED.pop(rid, None)
    if span is not None and rid in ALL:
        o = ALL[rid]
        write(o, *span)
        stamp(o, span[0], min(o.num_computed_tokens, o.num_tokens))


def propose():
    """EAGLE: drafts for every decoding request, each right with probability ~0.7 (a stable function
    of its context), fed to the scheduler as the engine feeds the drafter's."""
    k = KNOBS["spec_tokens"] if DRAFTER else 0
    rids, drafts = [], []
    for rid, o in reqs.items():
        if k <= 0 or o.status != RequestStatus.RUNNING or o.num_tokens - o.num_computed_tokens != 1:
            continue
        rids.append(rid)
        drafts.append(draft_tokens(o.all_token_ids, k))
    if rids:
        from vllm.v1.outputs import DraftTokenIds
        print(f"    drafts proposed: {dict(zip(rids, drafts))}")
        sched.update_draft_token_ids(DraftTokenIds(rids, drafts))


def model_output(so, spec, real):
    """update_from_output's input: each scheduled request's sampled tokens."""
    ids_ = list(so.num_scheduled_tokens)
    toks = [sampled(sched.requests[r], list(spec.get(r, ()))) if r in sched.requests else [1] for r in ids_]
    ACCEPTED.update({r: (real[r], real[r] + len(t) - 1) for r, t in zip(ids_, toks) if len(t) > 1})
    extra = {}
    for k, p in inspect.signature(ModelRunnerOutput).parameters.items():   # the release's other fields
        if p.default is inspect.Parameter.empty and k not in ("req_ids", "req_id_to_index", "sampled_token_ids"):
            extra[k] = [] if "list" in str(p.annotation) else {} if "dict" in str(p.annotation) else None
    if "req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters:      # (gone in 0.34)
        extra["req_id_to_index"] = {r: i for i, r in enumerate(ids_)}
    return ModelRunnerOutput(req_ids=ids_, sampled_token_ids=toks, **extra)


def sync():
    for rid in [r for r in reqs if r not in sched.requests]:
        del reqs[rid]
        print(f"    {rid} finished")


def step():
    global STEP, INFLIGHT
    STEP = {"sched": {}, "copies": []}
    so = sched.schedule()
    if STALE_OUTPUT:                      # (a planted fault: the output the worker gets is changed)
        stale_output(so)
    worker(so)
    new = {x.req_id for x in so.scheduled_new_reqs}
    new |= set(getattr(so.scheduled_cached_reqs, "resumed_req_ids", ()) or ())
    spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
    real = {}                             # rid -> end of the known tokens it computes (drafts: once accepted)
    for rid, n in so.num_scheduled_tokens.items():
        hi = sched.requests[rid].num_computed_tokens
        real[rid] = hi - len(spec.get(rid, ()))
        STEP["sched"][rid] = (hi - n, real[rid], rid in new)
    gone = sorted(getattr(so, "preempted_req_ids", ()) or ())
    if ASYNC:
        RESET_AT.update({r: FRAMES[0] for r in gone})
    print("    scheduled " + ", ".join(f"{r} [{lo}, {hi}){' (admitted)' if a else ''}"
                                      for r, (lo, hi, a) in STEP["sched"].items())
          + (f"; preempted {gone}" if gone else ""))
    for r in STEP["sched"]:
        print(f"      {r}: {tables(r)}" + (f"; the worker's: {WT.get(r)}" if CHECK == "worker_table_sound" else ""))
    sync()
    if ASYNC:                             # the batch queue: frame N's output arrives after N+1 was scheduled
        FRAMES[0] += 1
        take_inflight()
        forward()
        INFLIGHT = (so, model_output(so, spec, real), FRAMES[0])
        return
    forward()
    sched.update_from_output(so, model_output(so, spec, real))
    for rid in list(ACCEPTED):
        accept(rid)
    sync()
    propose()


def take_inflight():
    """The output of the frame in flight through update_from_output. A token vLLM drops is stale only
    if its frame was scheduled before the request's forced reset; a later frame's is a real token lost."""
    global INFLIGHT
    if INFLIGHT is None:
        return
    (so, out, frame), INFLIGHT = INFLIGHT, None
    before = {r: (discarding(sched.requests[r]), len(sched.requests[r].output_token_ids))
              for r in out.req_ids if r in sched.requests}
    sched.update_from_output(so, out)
    for r, toks in zip(out.req_ids, out.sampled_token_ids):
        o, (flag, n) = sched.requests.get(r), before.get(r, (False, 0))
        if flag and len(toks) and o is not None and len(o.output_token_ids) == n:
            late = frame > RESET_AT.get(r, frame)      # (the frames before its latest preemption are stale)
            print(f"    vLLM dropped {r}'s output of frame {frame} (the frames before its reset: "
                  f"{RESET_AT.get(r)}){': a real token' if late else ''}")
            if late and CHECK == "toctou_bound_stable":
                bugs.append(f"vLLM dropped {r}'s token at position {o.num_tokens}, sampled by a forward scheduled "
                            "after its forced preemption: the KV the next forward computed from it is of a token "
                            "the request no longer has")
    sync()


def state():
    RETAINED[:] = [b for _, bl in getattr(sched, "deferred_frees", ()) for b in bl]
    for o in ALL.values():
        note_keys(o)
    check_state()


print(f"vLLM {vllm.__version__} (finding recorded on {RECORDED_RELEASE}); groups {GROUPS}, hash block "
      f"{HASH_BLOCK}, {NUM_BLOCKS} blocks; scheduler {KNOBS}")
arrivals = 0
for n, (action, p) in enumerate(STEPS):
    LAST = n == len(STEPS) - 1
    print(f"step {n}: {action} {p}")
    try:
        if action == "submit":
            rid = p["r"]
            if rid in reqs or not 1 <= len(p["tokens"]) < MAX_TOKENS:
                print(f"    (refused: {rid} is live, or its length is out of range)")
                continue
            arrivals += 1
            mt = max(1, min(int(p.get("max_tokens", 8)), MAX_TOKENS - len(p["tokens"])))
            kw = {k: v for k, v in dict(cache_salt=p.get("salt"), block_hasher=hasher, eos_token_id=None,
                                        priority=int(p.get("prio", 0)), arrival_time=float(arrivals)).items()
                  if k in REQ_ARGS}
            o = Request(rid, list(p["tokens"]), SamplingParams(max_tokens=mt), None, **kw)
            reqs[rid] = ALL[rid] = o
            OWNED[rid] = [set() for _ in GROUPS]
            sched.add_request(o)
        elif action == "step":
            step()
        elif action == "abort":
            if p["r"] not in reqs:
                print(f"    ({p['r']} is not live on this release: nothing to abort)")
                continue
            sched.finish_requests([p["r"]], RequestStatus.FINISHED_ABORTED)
            sync()
        elif action == "reset_prefix_cache":    # running: the scheduler first preempts every running request
            kw = {"reset_running_requests": True} if p.get("running") else {}
            if kw and "reset_running_requests" not in inspect.signature(sched.reset_prefix_cache).parameters:
                print("CANNOT PLAY: this vLLM's Scheduler.reset_prefix_cache has no reset_running_requests")
                sys.exit(2)
            if ASYNC and kw:              # (its in-flight outputs are stale for the requests it preempts)
                RESET_AT.update({o.request_id: FRAMES[0] for o in sched.running})
            print(f"    reset: {sched.reset_prefix_cache(**kw)}")
        elif action == "evict_blocks":
            mgr.evict_blocks({i for i in p["block_ids"] if 0 < i < NUM_BLOCKS})
        else:
            print(f"CANNOT PLAY: unknown action {action!r}")
            sys.exit(2)
    except (AssertionError, ValueError, KeyError, IndexError, TypeError, AttributeError, RuntimeError) as e:
        if CHECK != "vllm_internal_error":
            print(f"CANNOT PLAY: vLLM raised {type(e).__name__}: {e} (not the finding's check)")
            sys.exit(2)
        bugs.append(f"vLLM raised {type(e).__name__}: {e}")
    state()
    if bugs:
        print("BUG: " + "; ".join(dict.fromkeys(bugs)))
        sys.exit(1)
print("OK: the condition holds on every step (fixed, or not this release)")
sys.exit(0)
'''
