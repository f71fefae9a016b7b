"""vLLM's replay for the cross-release differential (engines/vllm/reuse_replay.py) on the
installed release: records per lookup, the shared prefix a one-shot prompt leaves in align mode
(0.34.0 keeps the state at the block edge inside it; 0.15.1-0.24.0 do not: docs/differential.md),
and a planted unsound hit reported as such by the comparison."""
from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")
from kvcheck.checker.differential import Side, compare  # noqa: E402
from kvcheck.engines.vllm.engine import ENGINE  # noqa: E402
from kvcheck.engines.vllm.layouts import vllm_modules  # noqa: E402
from kvcheck.engines.vllm.reuse_replay import replay_reuse  # noqa: E402
from kvcheck.fuzz.reuse_workloads import generate  # noqa: E402

pytestmark = pytest.mark.skipif("MambaSpec.mamba_cache_mode" not in vllm_modules()["features"],
                                reason="no align mode in this release")
LAYOUT = "full+mamba"
# the shrunk difference of docs/differential.md: 8 tokens computed at once, then their first 5
SHRUNK = {"name": "resend-s0-1-shrunk", "steps": [
    {"op": "send", "r": "q2", "tokens": [16, 7, 31, 28, 30, 24, 13, 6], "output": [], "chunk": None},
    {"op": "send", "r": "q3", "tokens": [16, 7, 31, 28, 30], "output": [], "chunk": None}]}


def test_records_one_per_lookup_within_kvchecks_usable_hit() -> None:
    ws = generate(0, 4, ENGINE.reuse_sizes(LAYOUT))
    recs = ENGINE.replay_reuse(LAYOUT, ws)
    assert len(recs) == sum(1 for w in ws for s in w["steps"] if s["op"] == "send")
    assert {r["trace"] for r in recs} == {w["name"] for w in ws}
    assert all(r["violation"] is None and r["hit"] == r["usable"] and r["hit"] < r["prompt_tokens"] for r in recs)
    assert any(r["hit"] for r in recs) and all(len(r["served"]) == 2 for r in recs)


def test_the_shrunk_difference_on_this_release() -> None:
    first, second = ENGINE.replay_reuse(LAYOUT, [SHRUNK])
    assert first["hit"] == 0 and second["usable"] == second["hit"]
    if vllm.__version__ == "0.34.0":
        assert second["hit"] == 4                 # the state at token 4, kept inside the one-shot prompt


def test_a_release_serving_a_state_it_does_not_hold_is_unsound_not_more_reuse() -> None:
    ws = generate(1, 16, ENGINE.reuse_sizes(LAYOUT))     # (long-s1-11: a sibling past the last kept state)
    clean = replay_reuse(LAYOUT, ws)
    planted = replay_reuse(LAYOUT, ws, fault="mamba_hit_older_state")
    cmp = compare([Side("clean", "py", clean), Side("planted", "py", planted)])
    assert cmp["unsound"] and {u["check"] for u in cmp["unsound"]} == {"hit_sound_recurrent_state"}
    assert all(u["release"] == "planted" and u["more_than"] == ["clean"] for u in cmp["unsound"])
    assert compare([Side("a", "py", clean), Side("b", "py", replay_reuse(LAYOUT, ws))])["unsound"] == []
