"""The upstream fixes the known vLLM defects (known.py) are recognised by: each a
counterfactual lookup ``(ad, find, hashes, max) -> (blocks per group, hit)`` that reruns the
coordinator's lookup on the same state with the defect's fix applied (a copy of the release's
own code with the fix, or a wrapper doing what the fixed release does)."""
from __future__ import annotations

import inspect
import re
import sys
import textwrap
from typing import Any, Callable

from .layouts import cdiv, vllm_modules


def full_spec() -> type:
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    return FullAttentionSpec


def truncate_all(ad: Any, find: Callable, hashes: Any, m: int) -> tuple:
    """vLLM 0.33.0 (kv_cache_coordinator.py: "Truncate every full-attention group"): the
    groups after the first full-attention one are truncated to the reconciled hit too."""
    out = find(hashes, m)
    blocks, hit = [list(b) for b in out[0]], out[1]
    for g in ad.coord.attention_groups[1:]:
        spec, gids = g[0], g[1]
        if isinstance(spec, full_spec()):
            for gid in gids:
                del blocks[gid][cdiv(hit, spec.block_size):]
    return blocks, hit


_PATCHED: dict[tuple, Any] = {}


def _patched(cls: type, meth: str, old: str, new: str, extra: dict | None = None) -> Any:
    """`cls.meth` (from the first class of its MRO that defines it) compiled from the
    release's own source with the regex `old` replaced by `new` (exactly one match; `extra`:
    names the new text uses); None where the source differs, so nothing is recognised on a
    release whose code moved."""
    key = (cls, meth, old)
    if key not in _PATCHED:
        owner = next(c for c in cls.__mro__ if meth in c.__dict__)
        fn = owner.__dict__[meth]
        src = textwrap.dedent(inspect.getsource(getattr(fn, "__func__", fn)))
        fixed, n = re.subn(old, new, src)
        if n != 1:
            _PATCHED[key] = None
        else:
            ns = {**vars(sys.modules[owner.__module__]), **(extra or {})}
            exec(compile(fixed, f"<{owner.__name__}.{meth}, fixed>", "exec"), ns)
            _PATCHED[key] = ns[meth]
    return _PATCHED[key]


_REALIGNED: dict[type, type | None] = {}


def _realigned(cls: type) -> type | None:
    """The release's sliding-window manager with its finder's no-full-window path fixed: with
    the EAGLE drop it pops first and aligns once (as its match path does), instead of aligning,
    popping and aligning again (the one changed line: the first alignment loop skips EAGLE)."""
    if cls not in _REALIGNED:
        fn = _patched(cls, "find_longest_cache_hit", re.escape("block_size != alignment_tokens  # Faster for common case."),
                      "not drop_eagle_block and block_size != alignment_tokens")
        _REALIGNED[cls] = fn and type(f"Realigned{cls.__name__}", (cls,), {"find_longest_cache_hit": fn})
    return _REALIGNED[cls]


def realign(ad: Any, find: Callable, hashes: Any, m: int) -> tuple:
    coord = ad.coord
    SWM = vllm_modules()["stm"].SlidingWindowManager
    saved = coord.attention_groups
    coord.attention_groups = [g._replace(manager_cls=_realigned(g.manager_cls))
                              if issubclass(g.manager_cls, SWM) and _realigned(g.manager_cls) else g for g in saved]
    try:
        out = find(hashes, m)
    finally:
        coord.attention_groups = saved
    return out[0], out[1]


def margin_to_hashed(ad: Any, find: Callable, hashes: Any, m: int) -> tuple:
    """vLLM 0.33.0's EAGLE margin: the peek block may lie past ``num_tokens - 1`` as long as it
    is hashed (``min(curr + margin, len(block_hashes) * hash_block_size)``); 0.23.0 and 0.28.0
    cap it at ``max_cache_hit_length``, so an aligned resend loses a block. The release's own
    loop with that one bound changed (0.14.1, 0.18.1: with #32802's fix too)."""
    coord = ad.coord
    if not hasattr(coord.attention_groups[0], "_replace"):        # 0.14.1, 0.18.1: no margin at all
        return drop_once(ad, find, hashes, m, to_hashed=True)
    fn = _patched(type(coord), "find_longest_cache_hit",
                  r"(curr_hit_length \+ (?:spec\.block_size|eagle_margin)),\s*max_cache_hit_length",
                  r"\1, len(block_hashes) * self.hash_block_size")
    if fn is None:
        return [], -1
    out = fn(coord, hashes, m)
    return out[0], out[1]


def no_mamba_margin(ad: Any, find: Callable, hashes: Any, m: int) -> tuple:
    """vLLM 0.26.0's EAGLE margin: none for a Mamba group (its comment: "its finder never drops
    (draft models have no mamba layers), so the hit would grow past the candidate"). In
    0.20.0-0.25.1 a Mamba EAGLE group is looked up one block past the candidate, so after an
    earlier EAGLE group dropped the candidate the hit grows back past it, and that group, marked
    verified, is never looked up with its drop at the grown length. The release's own loop with
    the margin zero for Mamba."""
    from vllm.v1.kv_cache_interface import MambaSpec
    fn = _patched(type(ad.coord), "find_longest_cache_hit",
                  r"curr_hit_length \+ spec\.block_size,",
                  "curr_hit_length + (0 if isinstance(spec, _MambaSpec) else spec.block_size),",
                  {"_MambaSpec": MambaSpec})
    if fn is None:
        return [], -1
    out = fn(ad.coord, hashes, m)
    return out[0], out[1]


def unitary_margin(ad: Any, find: Callable, hashes: Any, m: int) -> tuple:
    """What the hybrid coordinator does for an EAGLE group (kv_cache_coordinator.py,
    ``eagle_margin``): match up to one block past the candidate, within the hashed tokens."""
    out = find(hashes, min(m + ad.groups[0][1], len(hashes) * ad.hb))
    return out[0], out[1]


def drop_once(ad: Any, find: Callable, hashes: Any, m: int, to_hashed: bool = False) -> tuple:
    """vLLM 0.23.0's fixed-point loop (its comment: "Each eagle group applies the drop at most
    once per candidate length (see issue #32802)", and "Eagle needs to match one more block and
    then pop the last"), on this release's managers. In 0.14.1 and 0.18.1 every EAGLE group
    drops a block from the candidate that an earlier group already dropped (0.14.1 again on
    every fixed-point iteration: the spiral of #32802)."""
    coord, ku = ad.coord, vllm_modules()["ku"]
    Full = full_spec()
    hb = coord.hash_block_size

    def hashes_of(spec: Any) -> Any:
        return hashes if spec.block_size == hb else ku.BlockHashListWithBlockSize(hashes, hb, spec.block_size)

    groups = coord.attention_groups
    marked = getattr(coord, "eagle_attn_group_indices", None)     # 0.20-0.22: EAGLE per group

    def eagle(idx: int) -> bool:
        return idx in marked if marked is not None else bool(coord.use_eagle)
    by: list = [None] * len(ad.groups)
    simple = len(groups) == 2 and isinstance(groups[0][0], Full)
    hit, verified = m, set()
    bound = len(hashes) * hb if to_hashed else m
    while True:
        curr = hit
        for idx, (spec, gids, mcls, *_) in enumerate(groups):
            if isinstance(spec, Full) and by[gids[0]] is not None:
                curr = curr // spec.block_size * spec.block_size
                continue
            drop = eagle(idx) and idx not in verified

            def look(n: int) -> Any:
                return mcls.find_longest_cache_hit(
                    block_hashes=hashes_of(spec), max_length=n, kv_cache_group_ids=gids, block_pool=coord.block_pool,
                    kv_cache_spec=spec, use_eagle=drop, alignment_tokens=coord.lcm_block_size)
            got = look(min(curr + spec.block_size, bound) if drop else curr)
            new = len(got[0]) * spec.block_size
            if drop and new > curr:     # a manager that does not pop the EAGLE block (0.15's Mamba): no margin
                got = look(curr)
                new = len(got[0]) * spec.block_size
            if drop:
                verified.add(idx)
            elif new < curr:
                verified.clear()
            curr = new
            for gid, b in zip(gids, got):
                by[gid] = list(b)
        if curr >= hit:
            break
        hit = curr
        if simple:
            break
    for spec, gids, *_ in groups:
        if isinstance(spec, Full):
            for gid in gids:
                if by[gid] is not None:
                    del by[gid][hit // spec.block_size:]
    return [b if b is not None else [] for b in by], hit


_AT_CANDIDATE: dict[type, type] = {}


def _at_candidate(cls: type) -> type:
    """`cls` whose finder, asked below the lookup's candidate (class attribute `candidate`),
    looks up at the candidate and trims a longer hit back to what it was asked for."""
    if cls not in _AT_CANDIDATE:
        def find_longest_cache_hit(k: type, *a: Any, **kw: Any) -> tuple:
            cut = kw["max_length"]
            if kw.get("drop_eagle_block") or cut >= k.candidate:
                return cls.find_longest_cache_hit(*a, **kw)
            blocks, hit = cls.find_longest_cache_hit(*a, **{**kw, "max_length": k.candidate})
            if hit <= cut:
                return blocks, hit
            n = cdiv(cut, kw["kv_cache_spec"].block_size)
            return tuple(list(b)[:n] for b in blocks), cut
        _AT_CANDIDATE[cls] = type(f"AtCandidate{cls.__name__}", (cls,),
                                  {"find_longest_cache_hit": classmethod(find_longest_cache_hit), "candidate": 0})
    return _AT_CANDIDATE[cls]


def full_at_candidate(ad: Any, find: Callable, hashes: Any, m: int) -> tuple:
    """A full-attention group is downward-closed (the coordinator's own comment; it trims a
    longer hit to the reduced candidate and keeps the block the hit ends inside, copied on
    write): looked up at the lookup's candidate `m` rather than at one an earlier group already
    cut, it finds a block keyed past the cut (under fine-grained lookup only a prompt's final
    hash boundary gets an interior key, so at the cut it finds nothing). Every non-dropping
    full-attention group looked up so, and trimmed back to the loop's candidate."""
    coord, Full = ad.coord, full_spec()
    saved = coord.attention_groups
    wide = {g.manager_cls: _at_candidate(g.manager_cls) for g in saved if isinstance(g.spec, Full)}
    for w in wide.values():
        w.candidate = m
    coord.attention_groups = [g._replace(manager_cls=wide[g.manager_cls]) if isinstance(g.spec, Full) else g
                              for g in saved]
    try:
        out = find(hashes, m)
    finally:
        coord.attention_groups = saved
    return out[0], out[1]
