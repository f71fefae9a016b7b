"""SGLang's side of the cross-release differential: the core's workloads (fuzz/reuse_workloads.py)
replayed on the installed release, one record per lookup.

Each workload runs on a fresh adapter of the layout's class (drivers.make_adapter: SGLang's real
cache and pools, every check after every action) on the scheduler path the campaigns drive
(sched.py): a send is submit, then `chunk` actions (the first is the lookup: `match_prefix` on all
but the last token, lock, allocation; every chunk that leaves the prompt unfinished is published
by SGLang's own `cache_unfinished_req` / `checkpoint_kv_cache`), then a decode per output token;
a finish is SGLang's own `cache_finished_req` / `release_kv_cache`. The pool holds six requests of
the longest length (release-independent), so a lookup's hit is the cache's matching, not its
eviction under pressure. The record keeps SGLang's match length, kvcheck's usable hit (the
adapter's oracle: the no-eviction twin, or for a sliding window the longest prefix with a live
window behind it), and the check a step broke, naming the release's known defect behind it
(layouts.KNOWN_FINDINGS); the replay of that workload stops there (fuzz/reuse_replay.py: the
step loop and the records, shared with vLLM's).
"""
from __future__ import annotations

from typing import Any

from kvcheck.fuzz.reuse_replay import Acts, replay

from .layouts import KNOWN_FINDINGS, MAX_TOKENS, VOCAB, get_layout, known_finding


UNIT = 4       # tokens the workloads are cut in at least: page 1 would make 1-2 token prompts


def sizes(layout: str) -> dict[str, int]:
    """The unit the workloads are cut in (whole pages, at least UNIT tokens: the sliding windows'
    W), the longest request the adapter takes (prompt and output), the vocabulary."""
    ps = get_layout(layout).page_size
    return {"block": -(-UNIT // ps) * ps, "max_tokens": MAX_TOKENS - 1, "vocab": VOCAB}


def capacity(layout: str) -> int:
    """Token slots for six requests of the longest length (whole pages; release-independent)."""
    ps = get_layout(layout).page_size
    return -(-(6 * MAX_TOKENS + 8) // ps) * ps


def replay_reuse(layout: str, workloads: list[dict[str, Any]], fault: str | None = None) -> list[dict[str, Any]]:
    """Every workload's records, each workload on a fresh cache; `fault`: a planted SGLang fault
    (tests: a release that serves what it must not)."""
    return [rec for w in workloads for rec in _workload(layout, w, fault)]


def _usable(ad: Any, tokens: list[int]) -> int | None:
    """kvcheck's oracle (what its lost_reuse check holds the match to), read before the match
    changes anything: the longest prefix with a live window behind it (sliding-window classes),
    else the no-eviction twin's (with Mamba: ending at a kept state)."""
    try:
        if "swa" in ad.lay.components and hasattr(ad, "usable_hit"):
            return int(ad.usable_hit(tokens)[0])
        return int(ad.twin_hit(tokens))             # (Mamba: the states the twin kept)
    except Exception:  # noqa: BLE001 - informational only (a core without Python nodes)
        return None


def _known(ad: Any, check: str) -> str | None:
    """The release's known SGLang defect behind a broken check (layouts.KNOWN_FINDINGS)."""
    from .install import sglang_version
    if known_finding(ad.lay, sglang_version()) != check:
        return None
    return KNOWN_FINDINGS[(ad.lay.cls, ad.lay.components)][2]


def _workload(layout: str, w: dict[str, Any], fault: str | None = None) -> list[dict[str, Any]]:
    from .drivers import make_adapter
    ad = make_adapter(get_layout(layout), fault, capacity(layout))
    one = getattr(ad, "py", ad)          # a lockstep layout: its Python core's (the cores must agree)
    seen: dict[str, Any] = {}
    real_check = one.check_hit

    def spy(req: Any, hit: int, path: Any) -> Any:      # every class's match passes its hit here
        seen.update(hit=int(hit), usable=_usable(one, req.tokens))
        return real_check(req, hit, path)
    one.check_hit = spy                                  # (this adapter only)

    def on_broken(rec: dict[str, Any], action: str) -> None:
        if "hit" in seen and rec["decision"] == "refused":     # the lookup itself broke a check
            rec.update(hit=seen["hit"], usable=seen["usable"], decision="violation")
    act = Acts(ad, lambda broken, action, params: _known(ad, broken[1]), on_broken)

    def send(rec: dict[str, Any], st: dict[str, Any]) -> None:
        r = st["r"]
        seen.clear()
        obs = act("chunk", {"r": r, "n": st.get("chunk") or len(st["tokens"])}, rec)
        rec.update(hit=seen.get("hit", 0), usable=seen.get("usable"))
        if obs is None or not obs.get("admitted", True):
            return
        rec["decision"] = "hit" if rec["hit"] else "miss"
        _compute(one, r, st, rec, act)
    return replay(w, act, send)


def _compute(ad: Any, r: str, st: dict[str, Any], rec: dict[str, Any], act: Any) -> None:
    """The rest of the prompt in the step's chunks, then one decode per output token."""
    s = ad.sched[r]
    while s.computed < s.prompt:
        got = act("chunk", {"r": r, "n": st.get("chunk") or s.prompt}, rec)
        if got is None or got.get("allocated") is False:
            rec["completed"] = False
            return
    for tok in st.get("output") or []:
        if len(ad.reqs[r].tokens) >= MAX_TOKENS:
            break
        if not (act("decode", {"r": r, "tok": tok}, rec) or {}).get("allocated"):
            break

