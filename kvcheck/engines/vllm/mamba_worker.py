"""The GPU worker's Mamba state blocks, as vLLM's model runner keeps them in align mode — drafts
included — and the check of every state a step resumes from when the step runs.

vLLM 0.33 (``v1/worker/mamba_utils.py``: ``preprocess_mamba``, ``postprocess_mamba_fused_kernel``;
``gpu_model_runner._update_states_after_model_execute``; cited in docs/adapters-vllm.md):
- the worker remembers, per request, the table index of its running state (``mamba_state_idx``)
  and how many tokens its last step accepted (``num_accepted_tokens``: 1 without drafts); both
  go when the request is finished, preempted or resumed (``cleanup_mamba_state_idx``; here: when
  its blocks are freed, which every one of those does: ``forget``);
- before the forward: ``prev`` = the remembered index, else ``(num_computed - 1) // b``;
  ``curr = cdiv(num_computed + num_scheduled, b) - 1`` (the scheduled tokens count the drafts);
  if ``prev`` is neither -1 nor ``curr``, column ``accepted - 1`` of block ``prev`` is copied into
  block ``curr`` and accepted becomes 1. The forward starts from column ``accepted - 1`` of
  block ``curr``, which must hold the state after exactly the request's computed tokens;
- the forward writes into block ``curr`` one state per position: column j is the state after
  ``rs + j`` tokens (``rs``: the known tokens, then j drafts);
- once the sampler accepted ``a - 1`` drafts (``new = rs + a - 1`` computed tokens): if a block
  boundary ``B = new // b * b`` lies in ``[rs, new]``, column ``B - rs`` is copied into block
  ``B // b - 1`` (the block keyed at B: the state the prefix cache serves); when that block is
  ``curr`` itself, accepted becomes 1. Else the worker remembers ``a``.
A state read that is not the state after exactly the request's computed tokens (a block the
scheduler published in this step, whose forward has not run; a block reassigned or overwritten)
is ``state_copy_sound``. The manager drive schedules no drafts: there ``curr = cdiv(hi, b) - 1``
and every read is column 0, the same rules.
"""
from __future__ import annotations

from typing import Any

from .layouts import MAMBA_ACCEPT_IGNORED, cdiv
from .mamba import MAMBA, Cols, mamba_block, prev_index
from .violation import Violation

REJECTED = ("<rejected draft>", ())       # a column whose draft the sampler rejected: no prefix's state


def column(w: Any, k: int) -> Any:
    """The state in column k of a block's bytes (a block written without drafts has column 0)."""
    if isinstance(w, Cols):
        return w[k] if k < len(w) else None
    return w if k == 0 else None


def run_states(ad: Any, tl: Any, items: list) -> None:
    """The step's state copies (from block prev to block curr of every scheduled request, column
    accepted - 1, together), then the forward's writes into block curr."""
    mb = mamba_block(ad.groups)
    moves, writes = [], []
    for rid, (lo, hi, _, _, drafts) in items:
        req = ad.reqs.get(rid)
        if req is None:
            continue
        src, dst, acc = prev_index(tl, rid, lo, mb), cdiv(hi + drafts, mb) - 1, tl.mamba_acc.get(rid, 1)
        for g, (kind, bs, _) in enumerate(ad.groups):
            if kind != MAMBA:
                continue
            table = ad._table(g, rid)
            if lo > 0:
                b = table[src] if 0 <= src < len(table) else None
                want = ad._content(req, lo)
                if b is None or b.is_null or column(tl.ready.get(b.block_id), acc - 1) != want:
                    _unsound(ad, tl, items, g, rid, lo, hi, src, acc, b)
                if src != dst and dst < len(table):
                    moves.append((table[dst].block_id, want))
                    ad.coverage["state:mamba_state_copy"] += 1
            if dst < len(table) and not table[dst].is_null and table[dst].block_id in req.owned[g]:
                now = ad._content(req, hi)
                writes.append((table[dst].block_id, Cols((now,) + (None,) * drafts) if drafts else now))
        tl.mamba_idx[rid] = dst
        if src not in (-1, dst):
            tl.mamba_acc[rid] = 1
        if drafts:
            tl.mamba_spec[rid] = (hi, drafts)
    for bid, w in moves + writes:
        tl.ready[bid] = w
        tl.cancelled.pop(bid, None)


def settle(ad: Any, tl: Any, rid: str, accepted: int) -> None:
    """After the sampler (the request's accepted tokens appended: `accepted` = drafts taken + 1):
    the draft columns of block curr become states of the request's prefix (or rejected), the
    state at a block boundary crossed by the accepted tokens is copied into the block keyed
    there, and the worker remembers how many tokens were accepted."""
    hi, drafts = tl.mamba_spec.pop(rid, (None, 0))
    req, curr = ad.reqs.get(rid), tl.mamba_idx.get(rid)
    if req is None or curr is None:
        return
    if hi is None:                       # no drafts: column 0 is the state at the step's end
        tl.mamba_acc[rid] = 1
        return
    mb, a = mamba_block(ad.groups), max(1, accepted)
    new = hi + a - 1
    B = new // mb * mb
    for g, (kind, _, _) in enumerate(ad.groups):
        if kind != MAMBA:
            continue
        table = ad._table(g, rid)
        b = table[curr] if curr < len(table) else None
        mine = b is not None and not b.is_null and b.block_id in req.owned[g]
        if mine:
            tl.ready[b.block_id] = Cols(tuple(ad._content(req, hi + j) for j in range(min(a, drafts + 1)))
                                        + (REJECTED,) * (drafts + 1 - a))
            ad.written[b.block_id] = ad._content(req, new)          # (what the block serves next step)
        if B >= hi and B > 0 and B // mb - 1 < len(table):
            d = table[B // mb - 1]
            if not d.is_null:               # the postprocess copy: column B - hi into the block keyed at B
                tl.ready[d.block_id] = column(tl.ready.get(b.block_id), B - hi) if b is not None else None
                if d.block_id in req.owned[g]:
                    ad.written[d.block_id] = ad._content(req, B)
                ad.coverage["state:mamba_spec_boundary_copy"] += 1
    tl.mamba_acc[rid] = 1 if B >= hi and B // mb - 1 == curr or ad.planted(MAMBA_ACCEPT_IGNORED) else a
    ad.coverage["state:mamba_drafts_settled"] += 1


def _unsound(ad: Any, tl: Any, items: list, g: int, rid: str, lo: int, hi: int, src: int, acc: int, b: Any) -> None:
    got = "missing" if b is None else "the null block" if b.is_null else (
        f"block #{b.block_id}, whose bytes are " + ("not written yet" if b.block_id not in tl.ready
                                                   else "another state"))
    w = tl.writer(items, b.block_id) if b is not None and not b.is_null else None
    if w is not None and w != rid:     # (a same-step hit: the state its writer's forward makes)
        got += f" (published in this step: {w}'s allocation in it published the block)"
    col = f", column {acc - 1} (drafts accepted)" if acc > 1 else ""
    why = tl.cause(b.block_id) if b is not None and not b.is_null else ""
    raise Violation("safety", "state_copy_sound",
                    f"{ad.layout} group {g} (mamba): the step of {rid} (tokens {lo}..{hi - 1}) "
                    f"resumes the state at {lo} tokens from table index {src}{col}, {got} when the "
                    "step's copies run (before its forward)" + why)
