"""The reference engine implements the configurable semantics (prompts with content, decode,
drop_hash eviction, capacity-limited allocation that evicts or fails): it runs in lockstep with
the spec on each alone and combined, its reuse stays bitwise equal to a full recompute with
distinct prompts and decoded blocks, and a planted fault per semantic is caught by its check."""
from __future__ import annotations

import random

import pytest
import torch

from kvcheck.checker.mutants import fault_row
from kvcheck.engines.reference.diff import generate, run_scenario
from kvcheck.reference import faults as EF
from kvcheck.engines.reference.sut import IMPLEMENTS, ReferenceSUT
from kvcheck.spec.config import SEMANTIC_DEFAULTS, Config, ConfigError, LayerSpec
from kvcheck.spec.objects import R_PREEMPTED, R_RUNNING
from kvcheck.spec.system import Spec

torch.set_num_threads(1)

FULL, HYBRID = (LayerSpec("full"),), (LayerSpec("swa", window=4), LayerSpec("full"))
SWA = (LayerSpec("swa", window=4),)     # an allocation can evict only blocks outside every window
DEV = {"tiers": ("device",)}
CONFIGS = {
    "prompts": Config(layers=FULL, blocks=3, prompts=3, **DEV),
    "salted": Config(layers=FULL, blocks=3, prompts=3, salted_prompts=1, **DEV),
    "decode": Config(layers=HYBRID, blocks=3, block_size=2, decode=True, **DEV),
    "drop_hash": Config(blocks=3, eviction="drop_hash"),
    "alloc": Config(layers=SWA, blocks=4, capacity={"swa_window": 2}, reserve=0, alloc="evict", **DEV),
    "combined": Config(layers=SWA, blocks=4, block_size=2, capacity={"swa_window": 3}, reserve=0, prompts=2,
                       decode=True, eviction="drop_hash", alloc="evict", **DEV),
}
# the actions each semantic adds, and that its clean run must take
NEW = {"prompts": set(), "salted": set(), "decode": {"decode"}, "drop_hash": {"drop_hash"},
       "alloc": {"append_evict", "append_fail"},
       "combined": {"decode", "drop_hash", "append_evict", "append_fail"}}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_clean_engine_in_lockstep_on_each_semantic(name) -> None:
    """Themed scenarios (the reference diff's generator) run clean: every state, decision and
    reuse-vs-recompute comparison agrees; the semantic's own actions are taken."""
    cfg = CONFIGS[name]
    spec, taken, compared, prompts = Spec(cfg), set(), 0, set()
    for i in range(24):
        prog = generate(spec, random.Random(i), ["shared_prefix", "memory_pressure", "interrupt_resume"][i % 3], 48)
        f, sut, _ = run_scenario(spec, None, prog)
        assert f is None, f"scenario {i}: {f.kind} {f.checks}: {f.message}"
        compared += sut.compared
        s = spec.init()
        for x in prog:
            if x.guard(s):
                taken.add(x.action)
                prompts.add(x.params.get("p", 0))
                s = x.effect(s)
    assert compared > 0
    assert NEW[name] <= taken, NEW[name] - taken
    if cfg.prompts > 1:
        assert len(prompts) == cfg.prompts


def _run(sut: ReferenceSUT, steps: list[tuple[str, dict]]) -> list[dict]:
    out = []
    for a, p in steps:
        out.append(sut.apply(a, p))
        assert sut.differential_check(a, p) is None, (a, p)
    return out


def test_reuse_is_bitwise_with_distinct_prompts_and_decoded_blocks() -> None:
    """Prompt 1 decodes block 1 (it edits block 1 of prompt 0); a second request of prompt 1
    reuses it, bitwise equal to a full recompute; prompt 0 reuses only the shared block 0."""
    cfg = Config(layers=HYBRID, blocks=3, block_size=2, prompts=2, decode=True, **DEV)
    sut = ReferenceSUT()
    sut.reset(cfg)
    first = [("submit", {"r": 0, "n": 1, "p": 1}), ("lookup", {"r": 0}), ("bind", {"r": 0}), ("use", {"r": 0}),
             ("append", {"r": 0, "j": 0}), ("decode", {"r": 0, "j": 1}), ("decode", {"r": 0, "j": 1}),
             ("finish", {"r": 0})]
    _run(sut, first)
    got = _run(sut, [("submit", {"r": 1, "n": 2, "p": 1}), ("lookup", {"r": 1}), ("bind", {"r": 1}),
                     ("use", {"r": 1}), ("finish", {"r": 1})])
    assert got[1]["decision"]["kind"] == "REUSE" and got[1]["decision"]["k"] == 2
    got = _run(sut, [("submit", {"r": 0, "n": 2, "p": 0}), ("lookup", {"r": 0})])
    assert got[1]["decision"]["k"] == 1          # block 1 holds prompt 1's content: no hit on it
    spec = Spec(cfg)
    s = spec.init()
    for a, p in first:                           # the engine's state is the spec's, step by step
        s = spec.instance(a, p).effect(s)
    sut2 = ReferenceSUT()
    sut2.reset(cfg)
    _run(sut2, first)
    assert sut2.observe() == s
    sut.close()
    sut2.close()


class _Lockstep:
    """Steps applied to the engine and the spec side by side (with the engine's own choices,
    `instead`); the engine's state must be the spec's after each."""

    def __init__(self, cfg: Config) -> None:
        self.spec, self.sut = Spec(cfg), ReferenceSUT()
        self.sut.reset(cfg)
        self.s = self.spec.init()

    def __call__(self, a: str, p: dict) -> dict:
        assert self.spec.instance(a, p).guard(self.s), (a, p)
        out = self.sut.apply(a, p)
        x = self.spec.instance(a, {**p, **out.get("instead", {})})
        assert x.guard(self.s), (a, p, out)
        self.s = x.effect(self.s)
        assert self.sut.observe() == self.s, (a, p)
        return out


START = [("submit", {"r": 0, "n": 4}), ("lookup", {"r": 0}), ("bind", {"r": 0}), ("use", {"r": 0})]


def test_allocation_evicts_the_least_recently_used_unreferenced_block() -> None:
    # window 2 over blocks of 2: a request at position k holds block k-1 only (after a slide)
    cfg = Config(layers=(LayerSpec("swa", window=2),), blocks=5, block_size=2, capacity={"swa_window": 3},
                 reserve=0, alloc="evict", eviction="drop_hash", **DEV)
    step = _Lockstep(cfg)
    for a, p in START + [("append", {"r": 0, "j": j}) for j in range(3)] + [("slide", {"r": 0})]:
        step(a, p)
    assert step("append_evict", {"r": 0, "j": 3, "v": 1}) == {"instead": {"v": 0}}   # 0 is older
    mgr = step.sut.engine.mgr
    assert not mgr.slot_published(0) and mgr.slot_published(3)     # drop_hash: its hash went too
    step.sut.close()


def test_allocation_with_nothing_evictable_fails_and_preempts_the_newest() -> None:
    cfg = Config(layers=(LayerSpec("swa", window=2),), blocks=3, block_size=2, capacity={"swa_window": 1},
                 reserve=0, alloc="evict", **DEV)
    step = _Lockstep(cfg)
    for a, p in [("submit", {"r": 0, "n": 3})] + START[1:] + [("append", {"r": 0, "j": 0})]:
        step(a, p)
    for a, p in [("submit", {"r": 1, "n": 1}), ("lookup", {"r": 1}), ("bind", {"r": 1})]:
        step(a, p)                           # r1 hits block 0 and pins it: nothing is evictable
    assert step("append_fail", {"r": 0, "j": 1, "x": 0}) == {"instead": {"x": 1}}
    mgr = step.sut.engine.mgr
    assert mgr.requests[1].st == R_PREEMPTED and mgr.requests[0].st == R_RUNNING
    step.sut.close()


def test_implements_exactly_the_semantic_keys_and_refuses_others(monkeypatch) -> None:
    assert {"prompts", "decode", "eviction", "alloc"} <= set(IMPLEMENTS) <= set(SEMANTIC_DEFAULTS)
    monkeypatch.setattr(Config, "semantics", lambda self: {"prompts": 2, "salt": "tenant"})
    with pytest.raises(ConfigError, match="salt = \"tenant\": the reference engine does not implement"):
        ReferenceSUT().reset(Config())


NEW_FAULTS = [EF.HASH_IGNORES_PARENT, EF.STALE_HASH_AFTER_REUSE, EF.STALE_HASH_AFTER_EVICT,
              EF.DECODE_PUBLISHES_PARTIAL, EF.ALLOC_EVICTS_REFERENCED]


# Which check sees a parentless hash first depends on the walk: when the colliding block is
# live the engine serves it (hit_content_sound); when it was evicted the engine's first error is
# the lookup's logical count of it (decision_matches_spec: a true detection, counted as
# mis-attributed). Which seeds take which path moves whenever the fuzz machine draws differently:
# since the coverage steering (2026-12-05) seeds 0, 3, 4 and 5 are killed by the expected check
# and 1 and 2 take the second path (before it, seed 1 was killed and 0 was not). Every seed
# detects the fault (test below).
SEED = {EF.HASH_IGNORES_PARENT.name: 0}


@pytest.mark.parametrize("fault", [f.name for f in NEW_FAULTS])
def test_each_semantic_fault_caught_by_its_expected_check(fault) -> None:
    """The mutants row (the fuzz campaign and the reference diff, with the fault's semantic
    switched on): killed, by the expected check."""
    row = fault_row(Config(), fault, 8.0, SEED.get(fault, 0))
    assert row["status"] == "killed", row


def test_a_parentless_hash_is_detected_on_every_seed() -> None:
    row = fault_row(Config(), EF.HASH_IGNORES_PARENT.name, 8.0, 0)
    assert row["detected_by"] and row["status"] in ("killed", "mis-attributed"), row
    assert {c for e in row["engines"].values() for c in e["caught_by"]} <= {
        "hit_content_sound", "decision_matches_spec"}, row


def test_missing_salt_is_an_unsafe_hit_on_a_salted_prompt() -> None:
    """salted_prompts: prompt 2 is prompt 0's tokens under another tenant's salt. The engine
    whose hashes omit the salt serves prompt 0's blocks to it: hit_content_sound on a real
    request (not only the isolation probe's decision_matches_spec); the clean engine does not."""
    cfg = CONFIGS["salted"]
    spec, seen = Spec(cfg), set()
    for i in range(30):
        prog = generate(spec, random.Random(i), ["shared_prefix", "memory_pressure", "interrupt_resume"][i % 3], 48)
        f, _, _ = run_scenario(spec, EF.CACHE_SALT_MISSING.name, prog)
        if f is not None:
            seen.update(f.checks)
    assert "hit_content_sound" in seen, seen
