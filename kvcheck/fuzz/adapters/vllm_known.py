"""Known vLLM defects (docs/findings-vllm.md), recognised by their fix so they do not stop or
fill a campaign.

A known defect is recognised only *counterfactually*: at every lookup of a layout the defect
can touch, the coordinator's lookup is run a second time, on the same state, with the defect's
upstream fix applied (a copy of the release's own code with the fix, or a wrapper doing what
the fixed release does). A finding of the defect's check at that lookup is the known defect
when the fixed lookup gives exactly what the checks demand: lost reuse, the spec-usable hit;
``hit_length_equal``, the same hit with every group holding the right number of blocks, and
the fixed result passes every hit check. Anything else (another cause of the same check, a
planted fault, a release outside the defect's range) is reported as before. A recognised
finding is counted under ``known:NAME`` in the campaign's coverage; ``KVCHECK_VLLM_STRICT=1``
turns recognition off (every finding is reported).
"""
from __future__ import annotations

import inspect
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

from .vllm_layouts import _cdiv, _vllm

STRICT = os.environ.get("KVCHECK_VLLM_STRICT") == "1"


@dataclass(frozen=True)
class Known:
    name: str
    check: str                    # the check the defect makes fire
    first: str                    # releases whose code has the defect (inclusive)
    last: str
    upstream: str                 # public issue / PR, or "none found"
    repro: str                    # standalone reproducer under docs/repro/
    applies: Callable[[Any], bool]              # does the layout reach the defect's code?
    fixed: Callable[[Any, Callable, Any, int], tuple] | None = None   # (ad, find, hashes, max) -> (blocks, hit)
    message: str = ""             # no `fixed`: the finding's message must match this regex


def _ver(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


# ---- the fixes ---------------------------------------------------------------------------
def _full_spec() -> type:
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    return FullAttentionSpec


def _truncate_all(ad: Any, find: Callable, hashes: Any, m: int) -> tuple:
    """vLLM 0.33.0 (kv_cache_coordinator.py: "Truncate every full-attention group"): the
    groups after the first full-attention one are truncated to the reconciled hit too."""
    out = find(hashes, m)
    blocks, hit = [list(b) for b in out[0]], out[1]
    for g in ad.coord.attention_groups[1:]:
        spec, gids = g[0], g[1]
        if isinstance(spec, _full_spec()):
            for gid in gids:
                del blocks[gid][_cdiv(hit, spec.block_size):]
    return blocks, hit


_PATCHED: dict[tuple, Any] = {}


def _patched(cls: type, meth: str, old: str, new: str) -> Any:
    """`cls.meth` (from the first class of its MRO that defines it) compiled from the
    release's own source with the regex `old` replaced by `new` (exactly one match); None
    where the source differs, so nothing is recognised on a release whose code moved."""
    key = (cls, meth, old)
    if key not in _PATCHED:
        owner = next(c for c in cls.__mro__ if meth in c.__dict__)
        fn = owner.__dict__[meth]
        src = textwrap.dedent(inspect.getsource(getattr(fn, "__func__", fn)))
        fixed, n = re.subn(old, new, src)
        if n != 1:
            _PATCHED[key] = None
        else:
            ns = dict(vars(sys.modules[owner.__module__]))
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


def _realign(ad: Any, find: Callable, hashes: Any, m: int) -> tuple:
    coord = ad.coord
    SWM = _vllm()["stm"].SlidingWindowManager
    saved = coord.attention_groups
    coord.attention_groups = [g._replace(manager_cls=_realigned(g.manager_cls))
                              if issubclass(g.manager_cls, SWM) and _realigned(g.manager_cls) else g for g in saved]
    try:
        out = find(hashes, m)
    finally:
        coord.attention_groups = saved
    return out[0], out[1]


def _margin_to_hashed(ad: Any, find: Callable, hashes: Any, m: int) -> tuple:
    """vLLM 0.33.0's EAGLE margin: the peek block may lie past ``num_tokens - 1`` as long as it
    is hashed (``min(curr + margin, len(block_hashes) * hash_block_size)``); 0.23.0 and 0.28.0
    cap it at ``max_cache_hit_length``, so an aligned resend loses a block. The release's own
    loop with that one bound changed (0.14.1, 0.18.1: with #32802's fix too)."""
    coord = ad.coord
    if not hasattr(coord.attention_groups[0], "_replace"):        # 0.14.1, 0.18.1: no margin at all
        return _drop_once(ad, find, hashes, m, to_hashed=True)
    fn = _patched(type(coord), "find_longest_cache_hit",
                  r"(curr_hit_length \+ (?:spec\.block_size|eagle_margin)),\s*max_cache_hit_length",
                  r"\1, len(block_hashes) * self.hash_block_size")
    if fn is None:
        return [], -1
    out = fn(coord, hashes, m)
    return out[0], out[1]


def _unitary_margin(ad: Any, find: Callable, hashes: Any, m: int) -> tuple:
    """What the hybrid coordinator does for an EAGLE group (kv_cache_coordinator.py,
    ``eagle_margin``): match up to one block past the candidate, within the hashed tokens."""
    out = find(hashes, min(m + ad.groups[0][1], len(hashes) * ad.hb))
    return out[0], out[1]


def _drop_once(ad: Any, find: Callable, hashes: Any, m: int, to_hashed: bool = False) -> tuple:
    """vLLM 0.23.0's fixed-point loop (its comment: "Each eagle group applies the drop at most
    once per candidate length (see issue #32802)", and "Eagle needs to match one more block and
    then pop the last"), on this release's managers. In 0.14.1 and 0.18.1 every EAGLE group
    drops a block from the candidate that an earlier group already dropped (0.14.1 again on
    every fixed-point iteration: the spiral of #32802)."""
    coord, ku = ad.coord, _vllm()["ku"]
    Full = _full_spec()
    hb = coord.hash_block_size

    def hashes_of(spec: Any) -> Any:
        return hashes if spec.block_size == hb else ku.BlockHashListWithBlockSize(hashes, hb, spec.block_size)

    groups = coord.attention_groups
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
            drop = coord.use_eagle and idx not in verified
            got = mcls.find_longest_cache_hit(
                block_hashes=hashes_of(spec), max_length=min(curr + spec.block_size, bound) if drop else curr,
                kv_cache_group_ids=gids, block_pool=coord.block_pool, kv_cache_spec=spec,
                use_eagle=drop, alignment_tokens=coord.lcm_block_size)
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
            n = _cdiv(cut, kw["kv_cache_spec"].block_size)
            return tuple(list(b)[:n] for b in blocks), cut
        _AT_CANDIDATE[cls] = type(f"AtCandidate{cls.__name__}", (cls,),
                                  {"find_longest_cache_hit": classmethod(find_longest_cache_hit), "candidate": 0})
    return _AT_CANDIDATE[cls]


def _full_at_candidate(ad: Any, find: Callable, hashes: Any, m: int) -> tuple:
    """A full-attention group is downward-closed (the coordinator's own comment; it trims a
    longer hit to the reduced candidate and keeps the block the hit ends inside, copied on
    write): looked up at the lookup's candidate `m` rather than at one an earlier group already
    cut, it finds a block keyed past the cut (under fine-grained lookup only a prompt's final
    hash boundary gets an interior key, so at the cut it finds nothing). Every non-dropping
    full-attention group looked up so, and trimmed back to the loop's candidate."""
    coord, Full = ad.coord, _full_spec()
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


# ---- where each defect can act -------------------------------------------------------------
def _hybrid(ad: Any) -> bool:
    return hasattr(ad.coord, "attention_groups")


def _two_full(ad: Any) -> bool:
    return _hybrid(ad) and sum(isinstance(g[0], _full_spec()) for g in ad.coord.attention_groups) >= 2


def _swa_eagle_mixed(ad: Any) -> bool:
    return _hybrid(ad) and any(k in ("swa", "swa_mla") and g in ad.eagle_groups and bs != ad.align
                               for g, (k, bs, _) in enumerate(ad.groups))


def _fine_wide_full(ad: Any) -> bool:
    """Fine-grained hits and a full-attention group whose block holds several hash blocks."""
    return _hybrid(ad) and len(ad.coord.attention_groups) > 1 and bool(getattr(ad.coord, "enable_partial_hash_hits", False)) \
        and any(isinstance(g.spec, _full_spec()) and g.spec.block_size > ad.hb for g in ad.coord.attention_groups)


def _mamba_drafter(ad: Any, fine: bool = False) -> bool:
    return ad.drafter and any(k == "mamba" and (bs > ad.hb or not fine) for k, bs, _ in ad.groups)


# A defect outside the lookup (a chunk split, a step's copies, the scheduler's preemption) has
# no lookup to rerun: it is matched by its signature (check, layout, release range and the
# finding's message), each signature checked against the defect's standalone reproducer.
KNOWN: tuple[Known, ...] = (
    Known("second_full_group_truncation", "hit_length_equal", "0.18.1", "0.28.0", "none found (fixed in 0.33.0)",
          "docs/repro/vllm_second_full_group_truncation.py", _two_full, _truncate_all),
    Known("swa_eagle_realign", "lost_reuse", "0.23.0", "0.33.0", "none found",
          "docs/repro/vllm_swa_eagle_realign.py", _swa_eagle_mixed, _realign),
    Known("unitary_eagle_margin", "lost_reuse", "0.14.1", "0.33.0", "none found",
          "docs/repro/vllm_unitary_eagle_margin.py", lambda ad: ad.drafter and not _hybrid(ad), _unitary_margin),
    Known("eagle_redrop_32802", "lost_reuse", "0.14.1", "0.18.1", "vllm-project/vllm#32802",
          "docs/repro/vllm_eagle_redrop_32802.py", lambda ad: ad.drafter and _hybrid(ad), _drop_once),
    Known("eagle_margin_capped", "lost_reuse", "0.14.1", "0.28.0", "none found (fixed in 0.33.0)",
          "docs/repro/vllm_eagle_margin_capped.py", lambda ad: ad.drafter and _hybrid(ad), _margin_to_hashed),
    Known("fine_block_past_candidate", "lost_reuse", "0.33.0", "0.33.0", "none found (new)",
          "docs/repro/vllm_fine_block_past_candidate.py", _fine_wide_full, _full_at_candidate),
    Known("mamba_eagle_unaligned_chunk", "hash_map_sound", "0.18.1", "0.23.0",
          "vllm-project/vllm#43559, fixed by PR #51113", "docs/repro/vllm_mamba_eagle_unaligned_chunk.py",
          _mamba_drafter, message=r"stale prefix-cache entry"),
    Known("fine_cow_same_step", "state_copy_sound", "0.28.0", "0.33.0", "none found (new)",
          "docs/repro/vllm_fine_cow_same_step.py", lambda ad: _mamba_drafter(ad, fine=True),
          message=r"source's bytes are not (written yet|what the copy claims) \(published at schedule time"),
    Known("priority_preempt_unwritten", "read_before_write", "0.14.1", "0.33.0",
          "vllm-project/vllm PR #43569 (open)", "docs/repro/vllm_priority_preempt_unwritten.py",
          lambda ad: getattr(ad, "sched_policy", "fcfs") == "priority", message=r""),
)


def active(ad: Any, version: str) -> list[Known]:
    """The known defects of this release that this adapter's layout can reach."""
    if STRICT or ad.fault:
        return []
    v = _ver(version)
    return [k for k in KNOWN if _ver(k.first) <= v <= _ver(k.last) and k.applies(ad)]


def install(ad: Any, version: str) -> None:
    """Run every active defect's fixed lookup beside each lookup of the campaign's manager
    (same state, before the admission changes it); `recognise` reads the results."""
    ks = [k for k in active(ad, version) if k.fixed is not None]
    ad.known_last = None
    if not ks:
        return
    mgr, coord = ad.mgr, ad.coord
    orig_gcb = mgr.get_computed_blocks

    def gcb(request: Any, *a: Any, **kw: Any) -> Any:
        seen: list = []
        find = coord.find_longest_cache_hit

        def spy(hashes: Any, m: int) -> Any:
            out = find(hashes, m)
            seen.append((hashes, m, out))
            return out
        own = coord.__dict__.get("find_longest_cache_hit")
        coord.find_longest_cache_hit = spy
        try:
            res = orig_gcb(request, *a, **kw)
        finally:
            if own is None:
                del coord.find_longest_cache_hit      # back to the class's method
            else:
                coord.find_longest_cache_hit = own
        if seen:
            hashes, m, out = seen[0]
            ad.known_last = (request.request_id, out[1], [(k, *_safe(ad, request, *k.fixed(ad, find, hashes, m)))
                                                          for k in ks])
        return res
    mgr.get_computed_blocks = gcb


def _safe(ad: Any, request: Any, blocks: list, hit: int) -> tuple[int, bool]:
    """(hit, does the fixed result pass every hit check?), judged on the lookup's own state."""
    req = ad.reqs.get(request.request_id)
    try:
        ad._check_hit(req, SimpleNamespace(blocks=blocks), hit)
    except Exception:
        return hit, False
    return hit, req is not None


def recognise(ad: Any, check: str, act: Any, usable: int | None = None) -> str | None:
    """The known defect that explains a finding of `check` at the lookup `act` (None: not one).
    Lost reuse: the fixed lookup reaches `usable`; hit_length_equal: the fixed lookup keeps the
    hit and passes every hit check."""
    last = getattr(ad, "known_last", None)
    if last is None or act.action != "lookup" or act.params.get("r") != last[0]:
        return None
    for k, hit, ok in last[2]:
        if k.check == check and ok and hit == (usable if check == "lost_reuse" else last[1]):
            return k.name
    return None


def explain_trace(path: str) -> dict:
    """Replay a saved finding step by step with every known defect of the installed release
    watched (recognition on, whatever KVCHECK_VLLM_STRICT says): which known defect, if any,
    explains the finding at its step. The evidence behind a finding's classification."""
    from kvcheck.spec.trace import Trace
    from . import vllm as V
    global STRICT
    t = Trace.load(path)
    layout = t.meta["layout"]
    if "layout_file" in t.meta:
        kind, _, where = layout.partition(":")
        layout = V.register_layout(t.meta["layout_file"], where, prefix=kind)
    strict, STRICT = STRICT, False
    try:
        ad = V._adapter(layout, int(t.meta.get("num_blocks", 24)), t.fault, False, bool(t.meta.get("dense_twin")),
                        t.meta.get("sched_policy", "fcfs"))
        install(ad, V.vllm_version())
        check, at = t.violation["check"], t.violation["step"]
        found, name = None, None
        for i, s in enumerate(t.steps):
            n_lost = len(ad.lost)
            obs = ad.apply(s.action, dict(s.params))
            got = ad.broken.check if ad.broken else next((v.check for v in ad.lost[n_lost:]), None)
            msg = ad.broken.message if ad.broken else ""
            ad.broken = None
            if got == check and i == at:
                found = i
                act = SimpleNamespace(action=s.action, params=s.params)
                name = recognise(ad, check, act, obs.get("usable")) \
                    or by_signature(ad, V.vllm_version(), check, msg)
                break
        return {"trace": path, "vllm_version": V.vllm_version(), "check": check, "step": at,
                "reproduced": found is not None, "known": name,
                "active": [k.name for k in active(ad, V.vllm_version())]}
    finally:
        STRICT = strict


def by_signature(ad: Any, version: str, check: str, message: str) -> str | None:
    """The known defect outside the lookup whose signature a finding of `check` matches."""
    for k in active(ad, version):
        if k.fixed is None and k.check == check and re.search(k.message, message):
            return k.name
    return None


def of_finding(ad: Any, f: Any, version: str) -> str | None:
    """The known defect behind a finding the core raised (its last step), if any."""
    if not f.program or not f.checks:
        return None
    usable = ad.lost[-1].size.get("usable") if f.kind == "lost_reuse" and ad.lost and ad.lost[-1].size else None
    return recognise(ad, f.checks[0], f.program[-1], usable) or by_signature(ad, version, f.checks[0], f.message)
