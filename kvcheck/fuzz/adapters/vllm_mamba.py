"""Mamba / linear-attention (MambaSpec, "align" mode) groups in the vLLM adapter: the shadow
model of state blocks, the scheduler's chunk rule, the state-copy check and the planted faults.

In align mode vLLM keeps one recurrent state per request in the *last* block of its table
(block cdiv(n, b) - 1 after n computed tokens) and caches a block once the state it holds is the
state at that block's end; interior blocks of a chunk are the null block. Each step the worker
copies the state from the previous step's block into the new one before the forward. So:
- a block's content is the state after exactly the tokens computed when it was last written
  (not a prefix of KV: a later write replaces it),
- a hit at L reads the state block ending at L and nothing older (spec: objects.RECURRENT_STATE),
- a step that moves the state into a new block reads the previous state block, which must still
  be in the table and hold the state at the step's start (check `state_copy_sound`),
- the scheduler ends every prefill chunk but the prompt's last on a block boundary
  (Scheduler._mamba_block_aligned_split), so the states a sibling may hit exist.
"""
from __future__ import annotations

from typing import Any

MAMBA = "mamba"


def Violation(*args: Any) -> Exception:
    from .vllm_checks import Violation as V      # vllm_checks imports this module
    return V(*args)


def is_mamba(groups: list, g: int) -> bool:
    return groups[g][0] == MAMBA


def want_end(kind: str, bs: int, i: int, L: int) -> int:
    """How many tokens block i's content must cover for a resume at L: a KV block holds its own
    tokens' prefix; a recurrent state block holds the state after exactly L tokens."""
    return L if kind == MAMBA else (i + 1) * bs


def aligned_chunk(groups: list, start: int, chunk: int, num_tokens: int, num_prompt: int) -> int:
    """The scheduler's align-mode split: a prefill chunk that does not reach the prompt's end ends
    on a block boundary; a chunk starting mid-block stops at the next boundary; no chunk runs past
    the last cacheable boundary (num_tokens - 1 rounded down) inside it."""
    bss = [bs for k, bs, _ in groups if k == MAMBA]
    if not bss:
        return chunk
    bs = max(bss)
    prefill_end = max(num_prompt, num_tokens - 1)
    end = start + chunk
    if start >= prefill_end:
        return chunk
    if end < prefill_end and end // bs * bs > start:
        end = end // bs * bs
    stops = [(start // bs + 1) * bs if start % bs else 0, (num_tokens - 1) // bs * bs]
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 1)


def check_state_copy(ad: Any, req: Any, start: int) -> None:
    """Before a step's forward: where the state moves into a new block, the block it is copied
    from (the state after `start` tokens, block cdiv(start, b) - 1) must be in the request's
    table and hold exactly that state."""
    if start <= 0:
        return
    for g, (kind, bs, _) in enumerate(ad.groups):
        if kind != MAMBA:
            continue
        src = -(-start // bs) - 1
        table = ad._table(g, req.rid)
        b = table[src] if src < len(table) else None
        if b is None or b.is_null or ad.written.get(b.block_id) != ad._content(req, start):
            got = "missing" if b is None else ("the null block" if b.is_null else
                                               f"block #{b.block_id} holding other content")
            raise Violation("safety", "state_copy_sound",
                            f"{ad.layout} group {g} (mamba): request {req.rid} resumes its state at "
                            f"{start} tokens from table index {src}, which is {got}")


def stamp(ad: Any, req: Any, g: int, n: int) -> None:
    """After a step to n computed tokens: the forward wrote the state after n tokens into the
    request's last state block (only a block the request allocated is written)."""
    bs = ad.groups[g][1]
    table = ad._table(g, req.rid)
    i = -(-n // bs) - 1
    if 0 <= i < len(table):
        b = table[i]
        if b.block_id in req.owned[g] and not b.is_null:
            ad.written[b.block_id] = ad._content(req, n)


def apply_copies(ad: Any) -> None:
    """vLLM's queued block copies (copy-on-write of a partial Mamba hit: 0.33's
    take_kv_cache_block_copies) run before the forward: each source must hold content, and the
    copy gives the destination that content; the retained endpoints are released after the
    step, as the scheduler does."""
    take = getattr(ad.mgr, "take_kv_cache_block_copies", None)
    if take is None:
        return
    copies, retained = take()
    for c in copies:
        w = ad.written.get(c.src_block_id)
        if w is None:
            raise Violation("safety", "state_copy_sound",
                            f"{ad.layout}: vLLM copies block #{c.src_block_id} -> #{c.dst_block_id}, but the "
                            "source holds nothing written")
        ad.written[c.dst_block_id] = w
    if retained:
        ad.pool.free_blocks(retained)


def plant(ad: Any, stm: Any, older_state: bool, freed_early: bool) -> None:
    """The Mamba faults, planted in subclasses of vLLM's own MambaManager."""
    MM = stm.MambaManager
    if older_state:
        orig = MM.find_longest_cache_hit.__func__

        class OlderState(MM):  # type: ignore[misc, valid-type]
            @classmethod
            def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool,
                                       kv_cache_spec, *args, **kw):
                # Accept the longest boundary even without a state cached there: pad with nulls
                # and hand out the newest older state (a hit claims a boundary it has no state at).
                res = orig(cls, block_hashes, max_length, kv_cache_group_ids, block_pool,
                           kv_cache_spec, *args, **kw)
                with_len = isinstance(res[-1], int)      # newer releases also return the length
                blocks, hit = res if with_len else (res, 0)
                bs = kv_cache_spec.block_size
                want = max_length // bs
                if blocks and blocks[0] and len(blocks[0]) < want:
                    null = block_pool.null_block
                    blocks = tuple([null] * (want - 1) + [lst[-1]] for lst in blocks)
                    hit = want * bs
                return (blocks, hit) if with_len else blocks

        _swap(ad, MM, OlderState)
    if freed_early:
        class FreedEarly(MM):  # type: ignore[misc, valid-type]
            def remove_skipped_blocks(self, request_id, processed, *args, **kw):
                super().remove_skipped_blocks(request_id, processed, *args, **kw)
                # also retire the current state block once it is full, as if it were KV: the
                # next step has to copy the state out of it
                blocks = self.req_to_blocks.get(request_id, [])
                if request_id in getattr(self, "_allocated_block_reqs", ()) and blocks \
                        and not blocks[-1].is_null and len(blocks) * self.block_size <= processed:
                    self.block_pool.free_blocks([blocks[-1]])
                    blocks[-1] = self._null_block

        for m in ad.coord.single_type_managers:
            if type(m) is MM:
                m.__class__ = FreedEarly


def _swap(ad: Any, MM: type, new: type) -> None:
    """Route the coordinator's Mamba lookups through `new` (and the managers' own class)."""
    groups = getattr(ad.coord, "attention_groups", None)
    if groups is not None:        # NamedTuples in newer releases, (spec, ids, cls) tuples in older
        ad.coord.attention_groups = [
            (g._replace(manager_cls=new) if hasattr(g, "_replace") else (*g[:2], new, *g[3:]))
            if (g.manager_cls if hasattr(g, "manager_cls") else g[2]) is MM else g for g in groups]
    for m in ad.coord.single_type_managers:
        if type(m) is MM:
            m.__class__ = new
