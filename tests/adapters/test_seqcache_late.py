"""A late publisher on the hash-chain base class (kvcheck issue 35's leftovers): the sequence-level
manager of tests/adapters/seqcache.py publishing a sequence's blocks only when it is freed. With
`publish = "release"` and `duplicates = "allow"` its campaigns run clean (its copies of blocks
another running request computed are `append_copy`, reusing a copy's memory `evict_copy`, a
release that leaves a copy no hash names frees it); without them the spec publishes at append
and the campaign diverges; its planted bugs are still caught with their check leading."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcheck.fuzz.campaign import Budget, run_campaign
from kvcheck.spec.config import Config
from kvcheck.spec.severity import lead

HERE = Path(__file__).resolve().parent
SUT = "seqcache:LatePublishAdapter"
EAGER = {"layers": [{"kind": "full"}], "blocks": 3, "requests": 2, "tiers": ["device"],
         "capacity": {"swa_window": 2}, "salt": False, "alloc": "evict", "eviction": "drop_hash"}
LATE = {**EAGER, "duplicates": "allow", "publish": "release"}


@pytest.fixture(autouse=True)
def _path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))        # MODULE:CLASS resolves seqcache


def _campaign(tmp_path, cfg, fault=None, steps=8000):
    return run_campaign(Config.from_dict(cfg), SUT, Budget(steps=steps), seed=0, fault=fault,
                        out=tmp_path, shrink_seconds=4)


@pytest.mark.parametrize("prompts", [1, 3])
def test_the_late_publisher_runs_clean(tmp_path, prompts) -> None:
    res = _campaign(tmp_path, {**LATE, "prompts": prompts})
    assert res["exit_code"] == 0, res["findings"] or res["coverage"]
    acts = res["coverage"]["actions"]
    assert min(acts.get(a, 0) for a in ("append_copy", "append_fail")) > 0, acts


@pytest.mark.parametrize("prompts", [1, 3])
def test_with_the_spec_publishing_at_append_it_diverges(tmp_path, prompts) -> None:
    res = _campaign(tmp_path, {**EAGER, "prompts": prompts}, steps=4000)
    assert res["exit_code"] == 13 and res["findings"][0]["kind"] == "conformance", res["findings"]


@pytest.mark.parametrize("fault,prompts", [("late_key_without_parent", 1), ("wrong_block_hit", 3)])
def test_a_late_publishers_bug_is_still_caught(tmp_path, fault, prompts) -> None:
    from seqcache import LatePublishAdapter
    res = _campaign(tmp_path, {**LATE, "prompts": prompts}, fault=fault)
    assert res["exit_code"] == 10, res["findings"]
    assert lead(res["findings"][0]["checks"]) == LatePublishAdapter.faults[fault] == "hit_sound_content"


def test_prompts_without_an_evict_callback_are_refused_in_one_line() -> None:
    from seqcache import LatePublishAdapter

    class NoEvict(LatePublishAdapter):
        evict = None

    with pytest.raises(ValueError, match="needs an evict callback") as e:
        NoEvict().reset(Config.from_dict({**LATE, "prompts": 2}))
    assert "\n" not in str(e.value)
    NoEvict().reset(Config.from_dict(LATE))                 # prompts = 1: none needed


def test_the_published_copys_memory_reused_while_the_other_is_held() -> None:
    """Both requests compute block 0 (r1's is a copy: r0's is unpublished); r1 finishes and
    publishes its copy; r0's block 1 finds the pool full and the manager's LRU reuses r1's copy:
    the spec's evict_copy and drop_hash (before the write), then r0's release publishes its own."""
    from kvcheck.fuzz.guard import GuardedLockstep, ValuedSpecModel
    from kvcheck.spec.system import Spec
    from seqcache import LatePublishAdapter
    cfg = Config.from_dict(LATE)
    model, sut = ValuedSpecModel(Spec(cfg)), LatePublishAdapter()
    core = GuardedLockstep(model, sut)
    sut.reset(cfg)
    run = lambda r, n: [("submit", {"r": r, "n": n}), ("lookup", {"r": r}), ("bind", {"r": r}),  # noqa: E731
                        ("use", {"r": r})]
    prog = run(0, 2) + run(1, 1) + [("append", {"r": 0, "j": 0}), ("append_copy", {"r": 1, "j": 0}),
                                    ("finish", {"r": 1}), ("append_evict_copy", {"r": 0, "j": 1, "v": 0})]
    f = core.run([model.step(a, p) for a, p in prog] + [model.step("finish", {"r": 0})])
    assert f is None, f.message
    assert core.trail[-2] == ("append", {"r": 0, "j": 1})          # what the manager did instead
    assert sut.published == {0, 1} and len(sut.m.table) == 2
