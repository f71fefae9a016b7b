"""Mamba / linear-attention (MambaSpec, "align" mode) groups in the vLLM adapter: the shadow
model of state blocks, the scheduler's chunk rule, the copies, and the state-copy check.

In align mode vLLM keeps one recurrent state per request in block cdiv(n, b) - 1 of its Mamba
table after n computed tokens (speculative blocks of a drafter after it), caches a block once the
state it holds is the state at the block's key, and nulls the blocks between. So:
- a block's content is the state after exactly the tokens computed when it was last written
  (not a prefix of KV: a later write replaces it),
- a hit at L reads the state after exactly L tokens and nothing older (spec:
  objects.RECURRENT_STATE); with a hash block smaller than the Mamba block (0.33's fine-grained
  hits) L may end inside a block: the block is keyed at L, and the request takes a private
  copy of it (copy-on-write, ``take_kv_cache_block_copies``),
- each step the worker copies the state from block cdiv(lo, b) - 1 into block cdiv(hi, b) - 1
  (``preprocess_mamba``) after the step's copy-on-write copies and before its forward, which
  then writes the state at hi there; so a state published in a step exists only once that
  step's forward has run (vLLM refuses a same-step hit on it: ``cached_blocks_this_step``),
- the scheduler ends prefill chunks where states must be cached: the adapter calls the
  installed release's own ``Scheduler._mamba_block_aligned_split``.
Check `state_copy_sound`: at schedule time (the content model: what blocks will hold) and when
the step runs (the timeline: what their bytes hold), every copy's source holds what the copy
claims and every state a step resumes from is the state at the step's start.
"""
from __future__ import annotations

from typing import Any

from kvcheck.fuzz.boundary import Needs, StandIn, require

from .runtime import vllm_modules, vllm_version
from .violation import Violation

MAMBA = "mamba"
SPEC_TOKENS = 2      # num_speculative_tokens of a Mamba layout with a drafter (= num_speculative_blocks)


def is_mamba(groups: list, g: int) -> bool:
    return groups[g][0] == MAMBA


def mamba_block(groups: list) -> int | None:
    """The Mamba block size (vLLM has one: cache_config.mamba_block_size), or None."""
    return next((bs for k, bs, _ in groups if k == MAMBA), None)


def block_want(kind: str, bs: int, i: int, L: int) -> tuple[int, bool]:
    """(tokens, exact?) block i of a hit at L must hold: a KV block its own tokens' prefix (up to
    L in a block the hit ends inside: a prefix of what it holds); the last state block of a Mamba
    hit exactly the state after L tokens (an interior one: the state at its own end)."""
    if kind == MAMBA:
        return (L if i == -(-L // bs) - 1 else (i + 1) * bs), True
    return min((i + 1) * bs, L), (i + 1) * bs <= L


class Cols(tuple):
    """A Mamba block written by a step with drafts: one state per position (column j: the state
    after the step's known tokens and j drafts; mamba_worker.py). Read alone, its column 0."""


def prev_index(tl: Any, rid: str, lo: int, bs: int) -> int:
    """The table index of the state a step of `rid` resumes from: the worker's remembered index
    (mamba_worker.py), else the block of its computed tokens' end (vLLM's ``(n - 1) // b``)."""
    return tl.mamba_idx.get(rid, (lo - 1) // bs)


def holds(w: Any, want: tuple, exact: bool) -> bool:
    """Does content `w` satisfy `want`: the very state (exact), or a KV prefix of it."""
    if isinstance(w, Cols):
        w = w[0]
    if exact or w is None:
        return w == want
    return w[0] == want[0] and len(w[1]) >= len(want[1]) and w[1][:len(want[1])] == want[1]


FINE_KINDS = ("full", "mla", "mla_indexer", MAMBA)    # vLLM's fine-grained managers (Full, Mamba)


def fine_usable(ad: Any, req: Any, g: int, L: int, eagle: bool, witness: list | None = None) -> bool:
    """Can group g serve a hit at L under fine-grained lookup (the spec's needed_objects; a block
    the hit ends inside is reached through any entry of it keyed at or past L within the
    lookup's reach)? A Mamba group needs its entry keyed at exactly L with the state at L; an
    EAGLE group also proves the tokens [L, L + margin) (vLLM's eagle_proof_margin: one hash
    block when fine-grained). The entries found are appended to `witness` as ("entry", g, end)."""
    kind, bs, _ = ad.groups[g]
    hs, hb = req.obj.block_hashes, ad.hb
    make = vllm_modules()["ku"].make_block_hash_with_group_id
    get = ad.pool.cached_block_hash_to_block.get_one_block

    def entry_holds(end: int, exact: bool) -> bool:      # the entry keyed at `end` tokens
        if end % hb or not 0 < end <= len(hs) * hb:
            return False
        blk = get(make(hs[end // hb - 1], g))
        ok = blk is not None and holds(ad.written.get(blk.block_id), ad._content(req, end), exact)
        if ok and witness is not None:
            witness.append(("entry", g, end))
        return ok

    if kind == MAMBA:
        return entry_holds(L, True)
    margin = (hb if bs > hb else bs) if eagle else 0
    reach = min(req.obj.num_tokens - 1 + margin, len(hs) * hb)   # the finder's max_length
    end = L + margin
    if end > reach:
        return False
    need = set(ad.needed_hit(g, L)) | ({(end - 1) // bs} if eagle else set())
    for i in sorted(need):
        if (i + 1) * bs <= end:                     # a whole block: its own key
            if not entry_holds((i + 1) * bs, False):
                return False
        elif not any(entry_holds(p, False) for p in range(min((i + 1) * bs, reach) // hb * hb, end - 1, -hb)):
            return False                            # cut by the hit: any entry at p >= end
    return True


# ---- construction ----------------------------------------------------------------------
def spec_kwargs(drafter: bool, feats: set[str]) -> dict:
    """MambaSpec's extra arguments: a drafter's speculative state blocks."""
    return {"num_speculative_blocks": SPEC_TOKENS} if drafter and "mamba_speculative_blocks" in feats else {}


def manager_kwargs(has_mamba: bool, feats: set[str]) -> dict:
    """KVCacheManager's: shared-prefix checkpoints where the release has them (vLLM narrows the
    flag itself to EAGLE + fine-grained layouts)."""
    if has_mamba:
        import vllm.v1.core.sched.scheduler  # noqa: F401  (the split's module: imported here, ~3 s
        #                                       on some releases, not inside a timed campaign)
    return {"enable_mamba_shared_prefix_checkpoint": True} \
        if has_mamba and "mamba_shared_prefix_checkpoint" in feats else {}


def partial(ad: Any) -> bool:
    """Does the manager hit inside a Mamba block (hash block < Mamba block, vLLM enabled it)?"""
    mb = mamba_block(ad.groups)
    return bool(mb and mb > ad.hb and getattr(ad.coord, "enable_partial_hash_hits", False))


# ---- the scheduler's chunk split ----------------------------------------------------------
def split(ad: Any, o: Any, hit: int, chunk: int, max_prefill: int = 0) -> int:
    """The chunk vLLM's scheduler gives a request (its own `_mamba_block_aligned_split` with this
    layout's settings): chunks end on states that must be cached; 0 when the budget fits no
    aligned chunk (the scheduler then skips the request). `max_prefill`: min(max_num_scheduled_
    tokens, long_prefill_token_threshold) of the scheduler; 0: the chunk itself (one request)."""
    if not ad.has_mamba:
        return chunk
    fn, me = ad.__dict__.get("_mamba_split") or _split_fn(ad)
    me.max_num_scheduled_tokens = max_prefill or chunk
    return fn(me, o, chunk, hit)       # (a waiting request has 0 computed tokens: hit is passed)


_PREFLIGHT: list[bool] = []


def _split_fn(ad: Any) -> tuple:
    from vllm.v1.core.sched.scheduler import Scheduler
    mb = mamba_block(ad.groups)
    eagle = bool(getattr(ad, "drafter", False))
    fine = partial(ad)
    me = StandIn(
        cache_config=StandIn(block_size=mb), block_size=ad.sched_bs, hash_block_size=ad.hb,
        use_eagle=eagle, use_eagle_block_drop=eagle, num_hash_lookahead_tokens=0,
        mamba_partial_cache_hit=fine, mamba_has_prefill_checkpoint_blocks=False,
        mamba_prefill_checkpoint_alignment=None, max_num_scheduled_tokens=0,
        mamba_shared_prefix_checkpoint=fine and bool(getattr(ad.mgr, "mamba_shared_prefix_checkpoint", False)),
        # 0.30's name of the same opt-in (the pre-flight found the stand-in lacked it)
        mamba_fine_grained_prefix_cache=fine and bool(getattr(ad.mgr, "mamba_fine_grained_prefix_cache", False)),
        scheduler_config=StandIn(long_prefill_token_threshold=0))
    if not _PREFLIGHT:                  # once per process: what the release reads off the stand-in
        require([Needs("vllm.v1.core.sched.scheduler:Scheduler._mamba_block_aligned_split", reads=("self", lambda: me),
                       where="kvcheck/engines/vllm/mamba.py (_split_fn: the Scheduler stand-in)")],
                "vllm", vllm_version())
        _PREFLIGHT.append(True)
    ad._mamba_split = (Scheduler._mamba_block_aligned_split, me)
    return ad._mamba_split


# ---- copies ------------------------------------------------------------------------------
def take_copies(ad: Any) -> None:
    """Drain vLLM's queued block copies (copy-on-write of a partial hit, the move of a running
    request's partial-tail entry), as the scheduler does when it builds the step. Each copy
    claims what its destination must hold (the content of the key it carries, or the state /
    prefix its holder resumes from); the source must hold that in the content model now, and the
    timeline checks its bytes when the copy runs (before the step's forward). The retained
    endpoints are freed when the step's scheduling ends (``_free_cow_retained_blocks``)."""
    take = getattr(ad.mgr, "take_kv_cache_block_copies", None)
    if take is None:
        return
    copies, retained = take()
    note_copies(ad, copies)
    ad.retained.extend(retained)


def note_copies(ad: Any, copies: Any) -> None:
    """Check and record the step's block copies (the source holds what the copy claims)."""
    for c in copies:
        claim, exact, g = _claim(ad, c.src_block_id, c.dst_block_id)
        w = ad.written.get(c.src_block_id)
        if claim is None or not holds(w, claim, exact):
            raise Violation("safety", "state_copy_sound",
                            f"{ad.layout} group {g}: vLLM copies block #{c.src_block_id} -> #{c.dst_block_id}, "
                            f"but the source {'holds nothing written' if w is None else 'holds other content'}"
                            " than the destination needs")
        ad.written[c.dst_block_id] = claim
        ad.timeline.copy(c.src_block_id, c.dst_block_id, claim, exact)
        ad.coverage["state:cow_copy"] += 1
        ad.coverage["state:mamba_entry_moved"] += ad.pool.blocks[c.dst_block_id].ref_cnt == 1 and exact \
            and ad.pool.blocks[c.dst_block_id].block_hash is not None


def release_retained(ad: Any) -> None:
    """The scheduling of the step is over: the copies' retained endpoints go back."""
    if ad.retained:
        blocks, ad.retained = ad.retained, []
        ad.pool.free_blocks(blocks)
        ad._bk_evicted.update(b.block_id for b in blocks)     # (the bookkeeping checks them next)


def retained_counts(ad: Any) -> dict[int, int]:
    """Block id -> references held outside the requests' tables (for the bookkeeping check): the
    step's queued copies', and the scheduler's deferred frees (0.34: with overlapping batches and
    a consumer KV connector, a freed request's blocks wait in ``Scheduler.deferred_frees`` until
    the in-flight steps that may still write them are processed: ``_free_request_blocks``)."""
    out: dict[int, int] = {}
    deferred = getattr(getattr(ad, "sched", None), "deferred_frees", None) or ()
    for b in [*getattr(ad, "retained", ()), *(b for _, blocks in deferred for b in blocks)]:
        out[b.block_id] = out.get(b.block_id, 0) + 1
    return out


def _claim(ad: Any, src: int, dst: int) -> tuple[tuple | None, bool, int]:
    """(content the destination must hold, exact?, group) of a copy: a request's private copy of
    the block its hit ends inside holds what the request resumes from (its own forward writes the
    rest, and may publish the block under a longer key in the same step); a moved cache entry
    (in no table) what its key promises."""
    for rid, req in ad.reqs.items():
        for g in range(len(ad.groups)):
            if any(b.block_id == dst for b in ad._table(g, rid)) and hasattr(req, "resumed_at"):
                return ad._content(req, req.resumed_at), ad.groups[g][0] == MAMBA, g
    ku = vllm_modules()["ku"]
    key = ad.pool.blocks[dst].block_hash
    if key is not None:
        g = ku.get_group_id(key)
        return ad.hash_content.get(bytes(ku.get_block_hash(key))), ad.groups[g][0] == MAMBA, g
    return ad.written.get(src), False, -1


# ---- the content model -------------------------------------------------------------------
def stamp(ad: Any, req: Any, g: int, n: int) -> None:
    """After a step to n computed tokens: the forward writes the state after n tokens into the
    request's state block (only a block the request allocated is written). With drafts (the
    engine drive's `state_block`: counted in) the state block may lie past n; a state at a block
    boundary n then reaches the block keyed at n by the worker's postprocess copy
    (mamba_worker.settle), which this predicts."""
    bs = ad.groups[g][1]
    table = ad._table(g, req.rid)
    at = getattr(req, "state_block", None)
    for i in ([-(-n // bs) - 1] if at is None else [at] + ([n // bs - 1] if n and n % bs == 0 else [])):
        b = table[i] if 0 <= i < len(table) else None
        if b is not None and b.block_id in req.owned[g] and not b.is_null:
            ad.written[b.block_id] = ad._content(req, n)


def admitted(ad: Any, req: Any, hit: int, copies: Any = None) -> None:
    """A request admitted with a hit of `hit` tokens: its copies are taken (`copies`: the ones its
    allocation queued, seen without draining vLLM's queue: the real scheduler drains it), then the
    state it resumes from is checked (check_state_copy)."""
    req.resumed_at = hit
    ad.coverage["state:mamba_partial_hit"] += bool(hit % (mamba_block(ad.groups) or 1))
    ad.coverage["state:shared_prefix_junction"] += bool(getattr(req.obj, "shared_prefix_boundary", 0))
    if copies is None:
        take_copies(ad)
    else:
        note_copies(ad, copies)
    check_state_copy(ad, req, hit)


def same_step(ad: Any, blocks: Any) -> bool:
    """Is the hit's state one this step published (vLLM refuses the admission: its rule)?"""
    return any(kind == MAMBA and lst and lst[-1].block_hash in getattr(
        ad.coord.single_type_managers[g], "cached_blocks_this_step", ())
        for g, ((kind, _, _), lst) in enumerate(zip(ad.groups, blocks.blocks)))


def check_state_copy(ad: Any, req: Any, start: int) -> None:
    """At schedule time: the state a step resumes from (block cdiv(start, b) - 1) must be in the
    request's table and (will) hold exactly the state after `start` tokens."""
    if start <= 0:
        return
    for g, (kind, bs, _) in enumerate(ad.groups):
        if kind != MAMBA:
            continue
        src = prev_index(ad.timeline, req.rid, start, bs)
        table = ad._table(g, req.rid)
        b = table[src] if src < len(table) else None
        if b is None or b.is_null or ad.written.get(b.block_id) != ad._content(req, start):
            got = "missing" if b is None else ("the null block" if b.is_null else
                                               f"block #{b.block_id} holding other content")
            raise Violation("safety", "state_copy_sound",
                            f"{ad.layout} group {g} (mamba): request {req.rid} resumes its state at "
                            f"{start} tokens from table index {src}, which is {got}")
