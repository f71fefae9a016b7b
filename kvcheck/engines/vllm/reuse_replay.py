"""vLLM's side of the cross-release differential: the core's workloads (fuzz/reuse_workloads.py)
replayed on the installed release, one record per lookup.

Each workload runs on a fresh adapter (adapter.py: vLLM's real manager, its own checks after
every action) with one request per step: a send is submit, a lookup (`get_computed_blocks` +
admission) and the rest of the prompt in the workload's chunks (vLLM's own Mamba split decides
where a chunk may end; where it fits no chunk in the budget, as a Mamba block larger than the
chunk, the step is scheduled again with the whole prompt, as a larger budget would, and the
record says `chunk_refused`), then a decode per output token. The record keeps vLLM's hit, the spec's
usable hit (the adapter's oracle), the blocks served per group, and the check a step broke, with
the known defect of the release behind it if any (known.py; the replay of that workload stops
there: the manager's state is then undefined).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvcheck.fuzz.lockstep import Act
from kvcheck.fuzz.reuse_replay import Acts, replay

from . import known
from .adapter import VllmAdapter
from .layouts import LAYOUT_DATA, VOCAB, layout_scale, vllm_version


def sizes(layout: str) -> dict[str, int]:
    """The scheduler block, the longest request the adapter admits, the vocabulary."""
    if layout not in LAYOUT_DATA:
        raise ValueError(f"unknown vLLM layout {layout!r}")
    return {"block": LAYOUT_DATA[layout][2], "max_tokens": layout_scale(layout)[1] * 3 // 4 - 1, "vocab": VOCAB}


def pool_blocks(layout: str) -> int:
    """Blocks for six requests of the longest length in every group (release-independent)."""
    groups = LAYOUT_DATA[layout][1]
    per_req = layout_scale(layout)[1] // min(bs for _, bs, _ in groups) + 2
    return 6 * per_req * len(groups) + 8


def replay_reuse(layout: str, workloads: list[dict[str, Any]], fault: str | None = None) -> list[dict[str, Any]]:
    """Every workload's records, each workload on a fresh cache; `fault`: a planted vLLM fault
    (tests: a release that serves what it must not)."""
    return [rec for w in workloads for rec in _workload(layout, w, fault)]


def _served(res: Any) -> list[int] | None:
    """Blocks per group a lookup handed out (null blocks, a sliding window's or a Mamba group's
    skipped ones, not counted); None where the release's answer has no such shape."""
    try:
        return [sum(1 for b in g if not getattr(b, "is_null", False)) for g in res[0].blocks]
    except Exception:  # noqa: BLE001 - informational only
        return None


def _known(ad: VllmAdapter, broken: tuple[str, str, str], action: str, params: dict[str, Any]) -> str | None:
    """The known defect of this release (known.py, the campaigns' one rule) behind a broken check."""
    v = SimpleNamespace(check=broken[1], message=broken[2], size=None)
    return known.of_violation(ad, v, Act(action, params), vllm_version())


def _workload(layout: str, w: dict[str, Any], fault: str | None = None) -> list[dict[str, Any]]:
    ad = VllmAdapter(layout, pool_blocks(layout), fault)
    known.install(ad, vllm_version())            # (a broken check then names its known defect)
    seen: dict[str, Any] = {}
    lookup = ad.mgr.get_computed_blocks

    def spy(o: Any) -> Any:
        res = lookup(o)
        seen["served"] = _served(res)
        return res
    ad.mgr.get_computed_blocks = spy            # (this adapter's manager only)

    def on_broken(rec: dict[str, Any], action: str) -> None:
        if action == "lookup":
            rec.update(hit=int(ad.last_hit or 0), served=seen.get("served"), decision="violation")
    act = Acts(ad, lambda broken, action, params: _known(ad, broken, action, params), on_broken)

    def send(rec: dict[str, Any], st: dict[str, Any]) -> None:
        r, toks = st["r"], st["tokens"]
        seen.clear()
        ad.last_hit = None
        obs = act("lookup", {"r": r, "chunk": st.get("chunk") or len(toks)}, rec)
        if obs is not None and not obs.get("admitted") and st.get("chunk"):
            rec["chunk_refused"] = True          # no aligned chunk fits the budget: a larger one
            obs = act("lookup", {"r": r, "chunk": len(toks)}, rec)
        rec.update(hit=int(ad.last_hit or 0), served=seen.get("served"))
        if obs is None:
            return
        rec["usable"] = obs.get("usable")
        if not obs.get("admitted"):
            return
        rec["decision"] = "hit" if rec["hit"] else "miss"
        _compute(ad, r, st, rec, act)
    return replay(w, act, send)


def _compute(ad: VllmAdapter, r: str, st: dict[str, Any], rec: dict[str, Any], act: Any) -> None:
    """The rest of the prompt in the step's chunks (all at once when a chunk is not scheduled),
    then one decode per output token."""
    o = ad.reqs[r].obj
    while o.num_tokens - o.num_computed_tokens > 1:
        rem = o.num_tokens - o.num_computed_tokens
        got = act("prefill", {"r": r, "chunk": st.get("chunk") or rem}, rec)
        if not (got or {}).get("allocated") and (st.get("chunk") or rem) < rem:
            got = act("prefill", {"r": r, "chunk": rem}, rec)
        if not (got or {}).get("allocated"):
            rec["completed"] = False
            return
    for tok in st.get("output") or []:
        if o.num_tokens - o.num_computed_tokens != 1 or o.num_tokens >= ad.max_tokens:
            break
        act("decode", {"r": r, "tok": tok}, rec)

