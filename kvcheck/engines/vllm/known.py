"""Known vLLM defects (docs/findings-vllm.md), recognised by their fix so they do not stop or
fill a campaign.

A known defect is recognised only *counterfactually*: at every lookup of a layout the defect
can touch, the coordinator's lookup is run a second time, on the same state, with the defect's
upstream fix applied (a copy of the release's own code with the fix, or a wrapper doing what
the fixed release does). A finding of the defect's check at that lookup is the known defect
when the fixed lookup gives exactly what the checks demand: lost reuse, the spec-usable hit;
``hit_length_equal``, the same hit with every group holding the right number of blocks;
``hit_exceeds_spec``, the spec-usable hit; and the fixed result passes every hit check. Anything else (another cause of the same check, a
planted fault, a release outside the defect's range) is reported as before. A recognised
finding is counted under ``known:NAME`` in the campaign's coverage (so that the shrinker never
trades a finding for a known defect and the campaign goes on looking); what it means for the
verdict is the core's rule (kvcheck/fuzz/known.py): reported as a finding unless the team
acknowledged it. ``STRICT`` (code only: tests) turns recognition off. The defects themselves:
catalogue.py.
"""
from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

from kvcheck.fuzz.known import KnownDefect

from .build import make_adapter
from .catalogue import KNOWN, Known, version_key  # noqa: F401 (the catalogue, read through this module)
from .layouts import register_layout, vllm_version

_ver = version_key     # (a release string as a comparable tuple)
STRICT = False        # recognition off: every finding reported under its own check (tests)


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


LOST_CHECKS = ("lost_reuse", "lost_reuse_retention")   # the map-based check and the dense twin's


def recognise(ad: Any, check: str, act: Any, size: dict | None = None, last: Any = None) -> str | None:
    """The known defect that explains a finding of `check` at the lookup `act` (None: not one).
    Lost reuse (either check; `size` is its record's): the fixed lookup reaches the spec-usable
    hit exactly (map-based check) or the retention policy's promise (the dense twin's check);
    hit_length_equal: the fixed lookup keeps the hit. Either way it passes every hit check.
    On the scheduler drive a step makes many lookups: `last` is the one the record was made at
    (a raised check's is the step's latest lookup: raising ends the step)."""
    last = last if last is not None else getattr(ad, "known_last", None)
    if last is None or (act.action != "step" and (act.action != "lookup" or act.params.get("r") != last[0])):
        return None
    size = size or {}
    for k, hit, ok in last[2]:
        if not ok:
            continue
        if check in LOST_CHECKS and k.check == "lost_reuse":
            if hit == size.get("usable", -1) or hit >= size.get("promised", hit + 1):
                return k.name
        elif check == "hit_exceeds_spec" and check in k.also:
            if hit == size.get("usable", getattr(ad, "last_usable", -1)):     # the fix gives what the spec allows
                return k.name
        elif k.check == check and hit == last[1]:
            return k.name
    return None


def of_violation(ad: Any, v: Any, act: Any, version: str) -> str | None:
    """The known defect behind one violation or lost-reuse record `v` (check, message, size)
    of the step `act`: the one rule campaigns, the shrinker and explain_trace share."""
    return recognise(ad, v.check, act, getattr(v, "size", None), getattr(v, "known_last", None)) \
        or by_signature(ad, version, v.check, v.message)


def sort_lost(ad: Any, n_lost: int, act: Any, version: str) -> tuple[list[str], list]:
    """The lost-reuse records the step `act` added (past `n_lost`; a lookup may add the
    map-based one and the dense twin's): (the known defects explaining some, the records no
    known defect explains)."""
    names, rest = [], []
    for v in ad.lost[n_lost:]:
        name = of_violation(ad, v, act, version)
        if name is None:
            rest.append(v)
        elif name not in names:
            names.append(name)
    return names, rest


def explain_trace(path: str) -> dict:
    """Replay a saved finding step by step with every known defect of the installed release
    watched (recognition on, whatever STRICT says): which known defect, if any,
    explains the finding at its step. The evidence behind a finding's classification."""
    from kvcheck.spec.trace import Trace
    global STRICT
    t = Trace.load(path)
    layout = t.meta["layout"]
    if "layout_file" in t.meta:
        kind, _, where = layout.partition(":")
        layout = register_layout(t.meta["layout_file"], where, prefix=kind)
    strict, STRICT = STRICT, False
    try:
        from .engine_gen import knobs_of         # (a scheduler-drive trace: its scheduler's knobs)
        ad = make_adapter(layout, int(t.meta.get("num_blocks", 24)), t.fault, False, bool(t.meta.get("dense_twin")),
                          knobs_of(t.meta) or t.meta.get("sched_policy", "fcfs"))
        install(ad, vllm_version())
        check, at = t.violation["check"], t.violation["step"]
        found, name = None, None
        from kvcheck.spec.sut import ActionRejected
        for i, s in enumerate(t.steps):
            n_lost = len(ad.lost)
            try:
                ad.apply(s.action, dict(s.params))
            except ActionRejected:        # this release refuses a step: the trace does not replay here
                break
            got = next((v for v in ([ad.broken] if ad.broken else ad.lost[n_lost:]) if v.check == check), None)
            ad.broken = None
            if got is not None and i == at:
                found = i
                name = of_violation(ad, got, SimpleNamespace(action=s.action, params=s.params), vllm_version())
                break
        return {"trace": path, "vllm_version": vllm_version(), "check": check, "step": at,
                "reproduced": found is not None, "known": name,
                "active": [k.name for k in active(ad, vllm_version())]}
    finally:
        STRICT = strict


def by_signature(ad: Any, version: str, check: str, message: str) -> str | None:
    """The known defect outside the lookup whose signature a finding of `check` matches."""
    for k in active(ad, version):
        if k.message and (k.check == check or check in k.also) and re.search(k.message, message):
            return k.name
    return None


def of_finding(ad: Any, f: Any, version: str) -> str | None:
    """The known defect behind a finding the core raised (its last step), if any; a lost reuse
    is judged on the adapter's record of it (its check's size)."""
    if not f.program or not f.checks:
        return None
    v: Any = SimpleNamespace(check=f.checks[0], message=f.message, size=None)
    if f.kind == "lost_reuse":
        v = next((x for x in reversed(ad.lost) if x.check == f.checks[0]), None)
        if v is None:
            return None
    return of_violation(ad, v, f.program[-1], version)


def defects() -> dict[str, KnownDefect]:
    """The catalogue in the core's terms (fuzz/known.py): each defect's check and its kind."""
    from .layouts import BOOKKEEPING_CHECKS
    return {k.name: KnownDefect(k.name, k.check, "lost_reuse" if k.check == "lost_reuse" else
                                "bookkeeping" if k.check in BOOKKEEPING_CHECKS else "safety",
                                k.first, k.last, k.upstream, k.repro) for k in KNOWN}
