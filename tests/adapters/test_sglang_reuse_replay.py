"""SGLang's replay for the cross-release differential (engines/sglang/reuse_replay.py): the sizes
without SGLang; on an installed release (a side environment: the main venv has no SGLang, so
those tests skip there; run them with e.g. `.venv-sglang-newest/bin/python -m pytest`), records
per lookup on the scheduler path, the shrunk UnifiedRadixCache FULL+SWA difference of
docs/differential.md (0.5.23 frees a chunked request's out-of-window SWA KV when it publishes the
chunk; 0.5.11-0.5.15.post1 do not), and a planted over-reaching match reported as unsound."""
from __future__ import annotations

import pytest

from kvcheck.engines.sglang.engine import ENGINE
from kvcheck.engines.sglang.layouts import LayoutError
from kvcheck.fuzz.reuse_workloads import check_sizes, generate

# the shrunk difference: 8 tokens, the first 7 published as a chunk, then a prompt of their first 2
SHRUNK = {"name": "system-s0-2-shrunk", "steps": [
    {"op": "send", "r": "q0", "tokens": [0, 2, 1, 5, 4, 1, 4, 0], "output": [], "chunk": 7},
    {"op": "send", "r": "q3", "tokens": [0, 2], "output": [], "chunk": None}]}


def _installed() -> str:
    """The installed release (kvcheck imports it with its CPU stand-ins: no plain `import sglang`)."""
    v = ENGINE.release()
    if v is None:
        pytest.skip("SGLang is not installed here (run with a side environment's python)")
    return v


def test_sizes_are_kvchecks_own_data_without_sglang() -> None:
    assert ENGINE.has_replay_reuse()
    for lay in ("radix", "radix-page4", "swa", "unified-swa"):
        sz = check_sizes(ENGINE.reuse_sizes(lay))
        assert sz["block"] % (4 if lay.endswith("page4") else 1) == 0 and sz["block"] >= 4
        assert all(2 <= len(s["tokens"]) < 40 for w in generate(0, 8, sz) for s in w["steps"] if s["op"] == "send")
    with pytest.raises(LayoutError, match="unknown SGLang layout 'nope'"):
        ENGINE.reuse_sizes("nope")


@pytest.mark.parametrize("layout", ["radix", "radix-page4", "unified-swa"])
def test_records_one_per_lookup_within_kvchecks_usable_hit(layout: str) -> None:
    _installed()
    if layout in ENGINE.unsupported():
        pytest.skip(f"this release cannot express {layout}")
    ws = generate(0, 8, ENGINE.reuse_sizes(layout))
    recs = ENGINE.replay_reuse(layout, ws)
    assert len(recs) == sum(1 for w in ws for s in w["steps"] if s["op"] == "send")
    assert {r["trace"] for r in recs} == {w["name"] for w in ws}
    assert all(r["violation"] is None and r["decision"] in ("hit", "miss") for r in recs)
    assert all(r["hit"] == r["usable"] and r["hit"] < r["prompt_tokens"] for r in recs)
    assert sum(r["decision"] == "hit" for r in recs) >= len(recs) // 2


def test_the_shrunk_unified_swa_difference_on_this_release(monkeypatch: pytest.MonkeyPatch) -> None:
    v = _installed()
    if "unified-swa" in ENGINE.unsupported():
        pytest.skip("no UnifiedRadixCache FULL+SWA in this release")
    first, second = ENGINE.replay_reuse("unified-swa", [SHRUNK])
    assert first["hit"] == 0 and second["usable"] == second["hit"]
    if v in ("0.5.11", "0.5.14", "0.5.15.post1"):
        assert second["hit"] == 1
    if v == "0.5.23":
        assert second["hit"] == 0                 # position 0's SWA KV freed when the chunk was published
        monkeypatch.setenv("SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS", "false")
        assert ENGINE.replay_reuse("unified-swa", [SHRUNK])[1]["hit"] == 1


def test_a_release_serving_slots_it_does_not_hold_is_unsound_not_more_reuse() -> None:
    _installed()
    from kvcheck.checker.differential import Side, compare
    from kvcheck.engines.sglang.reuse_replay import replay_reuse
    ws = generate(0, 4, ENGINE.reuse_sizes("radix"))
    clean = replay_reuse("radix", ws)
    planted = replay_reuse("radix", ws, fault="match_overreach")
    cmp = compare([Side("clean", "py", clean), Side("planted", "py", planted)])
    assert cmp["unsound"] and {u["check"] for u in cmp["unsound"]} == {"hit_sound"}
    assert all(u["release"] == "planted" and u["more_than"] == ["clean"] and u["known"] is None
               for u in cmp["unsound"])
    assert all(r["decision"] == "violation" for r in planted if r["violation"])
    assert compare([Side("a", "py", clean), Side("b", "py", replay_reuse("radix", ws))])["unsound"] == []
