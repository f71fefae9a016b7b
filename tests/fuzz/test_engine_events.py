"""Engine-initiated events (spec/events.py): an engine that evicts on its own inside allocation
runs clean in lockstep; one that evicts a pinned block, frees a held one, or drops hashes the
config says it keeps is caught by the expected check."""
from __future__ import annotations

import random

import pytest

from kvcheck.fuzz.lockstep import Finding, Lockstep, SpecModel
from kvcheck.fuzz.suts import SutError
from kvcheck.spec.config import Config
from kvcheck.spec.objects import READY, WRITING
from kvcheck.spec.sut import ActionRejected, SpecSUT
from kvcheck.spec.system import Spec

CFG = Config()
CORE = ("submit", "lookup", "bind", "use", "append", "finish", "compress", "indexer_sync")


def _live_walk(sut, cfg: Config, steps: int, seed: int) -> Lockstep:
    """A walk chosen live from the model's state (the SUT's events move it), seeded."""
    spec = Spec(cfg)
    ls = Lockstep(SpecModel(spec), sut, follow=False)
    sut.reset(cfg)
    rng = random.Random(seed)
    for _ in range(steps):
        en = spec.enabled(ls.s)
        if not en:
            break
        core = [x for x in en if x.action in CORE]
        ls.step(rng.choice(core if core and rng.random() < 0.8 else en))
    ls.end()
    return ls


def _objects(sut, want_held: bool, not_block: int):
    """Live objects of other blocks in the SUT's own observed state, held or unheld."""
    lay, s = sut.lay, sut.observe()
    for o in lay.objects:
        if o.block == not_block or s[lay.o(o.group, o.kind, o.block, "st")] not in (WRITING, READY):
            continue
        if (s[lay.o(o.group, o.kind, o.block, "ref")] > 0) == want_held:
            yield {"g": o.group, "kind": o.kind, "j": o.block}


def _reference():
    pytest.importorskip("torch")
    from kvcheck.engines.reference.sut import ReferenceSUT
    return ReferenceSUT


def _evicts_on_alloc(base, pinned: bool):
    class EvictsOnAlloc(base):
        """Inside `append`, first evicts an object of another block on its own (LRU-like:
        the first its own evictor allows), and says so: events_before."""

        name = "evicts-on-alloc"
        evicted = 0

        def apply(self, action, params):
            if action != "append":
                return super().apply(action, params)
            events = []
            for p in _objects(self, pinned, params["j"]):
                try:
                    super().apply("evict", p)
                except ActionRejected:
                    continue
                events.append(("evict", p))
                type(self).evicted += 1
                break
            out = super().apply(action, params)
            return {**out, "events_before": events}
    return EvictsOnAlloc


def test_an_engine_that_evicts_on_its_own_inside_allocation_runs_clean() -> None:
    sut = _evicts_on_alloc(_reference(), pinned=False)()
    for seed in range(2):
        _live_walk(sut, CFG, 400, seed)          # raises a Finding on any divergence
    assert type(sut).evicted > 5                  # the engine did evict on its own, often
    sut.close()


def test_an_engine_that_evicts_a_pinned_block_on_its_own_is_caught() -> None:
    ref = _reference()
    sut = _evicts_on_alloc(ref, pinned=True)(fault="engine_pinned_object_evicted")
    with pytest.raises(Finding) as e:
        for seed in range(5):
            _live_walk(sut, CFG, 400, seed)
    sut.close()
    assert e.value.kind == "invariant" and "toctou_bound_stable" in e.value.checks, e.value
    assert "SUT's own evict" in e.value.message


class _Says(SpecSUT):
    """The spec as engine, reporting one event after each finish (a planted claim)."""

    def __init__(self, event) -> None:
        super().__init__()
        self.event = event

    def apply(self, action, params):
        out = super().apply(action, params)
        if action in ("finish", "append"):
            out["events"] = [self.event(params)]
        return out


def test_true_claims_and_evictions_after_the_action_run_clean() -> None:
    # after append(r, j) block j is published; after a finish block 0 is (tombstones stay)
    _live_walk(_Says(lambda p: ("publish", p.get("j", 0))), CFG, 300, 0)

    class EvictsFreed(SpecSUT):
        """Evicts, right after a finish, every object nobody holds any more (events)."""
        evicted = 0

        def apply(self, action, params):
            out = super().apply(action, params)
            if action == "finish":
                out["events"] = []
                for p in _objects(self, False, -1):
                    inst = self.spec.instance("evict", p)
                    if inst.guard(self.state):
                        self.state = inst.effect(self.state)
                        out["events"].append(("evict", p))
                        EvictsFreed.evicted += 1
            return out

        @property
        def lay(self):
            return self.spec.lay
    _live_walk(EvictsFreed(), CFG, 400, 1)
    assert EvictsFreed.evicted > 5


def test_freeing_a_held_block_is_a_use_after_free() -> None:
    with pytest.raises(Finding) as e:
        _live_walk(_Says(lambda p: ("free", p.get("j", 0))), CFG, 300, 0)
    assert e.value.checks == ["toctou_bound_stable"] and "still held" in e.value.message


def test_dropping_a_hash_needs_the_drop_hash_semantic() -> None:
    with pytest.raises(Finding) as e:
        _live_walk(_Says(lambda p: ("drop_hash", p.get("j", 0))), CFG, 300, 0)
    assert e.value.checks == ["sut_accepted_disabled_action"] and 'eviction = "drop_hash"' in e.value.message
    # with the semantic on, the same engine is in lockstep (its state is the spec's after it)
    cfg = Config(eviction="drop_hash")

    class Drops(SpecSUT):
        def apply(self, action, params):
            out = super().apply(action, params)
            if action == "finish":
                j = 0
                if self.state[self.spec.lay.b(j, "hashed")]:
                    self.state = self.spec.instance("drop_hash", {"j": j}).effect(self.state)
                out["events"] = [("drop_hash", j)]
            return out
    _live_walk(Drops(), cfg, 300, 0)


@pytest.mark.parametrize("event", [("melt", 0), ("evict", 99), "evict", ("evict", {"j": 0})])
def test_a_malformed_event_is_a_clear_adapter_error(event) -> None:
    with pytest.raises(SutError, match="event"):
        _live_walk(_Says(lambda p: event), CFG, 100, 0)


class _MakesRoom(SpecSUT):
    """The spec as an engine whose allocation evicts an unpinned page when the pool is full
    (and says so: events_before); with `pinned`, it takes a pinned one instead."""

    def __init__(self, pinned: bool = False) -> None:
        super().__init__()
        self.pinned = pinned

    def apply(self, action, params):
        if action != "append" or self.spec.instance(action, params).guard(self.state):
            return super().apply(action, params)
        lay = self.spec.lay
        for o in lay.objects:
            st, ref = (self.state[lay.o(o.group, o.kind, o.block, f)] for f in ("st", "ref"))
            if st == READY and (ref > 0) == self.pinned and o.block != params["j"]:
                t = list(self.state)
                t[lay.o(o.group, o.kind, o.block, "st")] = 3        # evicted
                self.state = tuple(t)
                out = super().apply(action, params)
                return {**out, "events_before": [("evict", o.block)]}
        raise ActionRejected("pool full")


def _full_pool(sut) -> tuple[Lockstep, object]:
    """One SWA group (a window of one block), a pool of 2 pages: the request at block 2 holds
    block 1, block 0 is unpinned; appending block 2 needs a third page."""
    from kvcheck.spec.config import LayerSpec
    cfg = Config(layers=(LayerSpec("swa", window=2),), blocks=3, requests=1, tiers=("device",),
                 capacity={"swa_window": 2})
    spec = Spec(cfg)
    sut.reset(cfg)
    ls = Lockstep(SpecModel(spec), sut, follow=False)
    for a, p in (("submit", {"r": 0, "n": 3}), ("lookup", {"r": 0}), ("bind", {"r": 0}), ("use", {"r": 0}),
                 ("append", {"r": 0, "j": 0}), ("append", {"r": 0, "j": 1}), ("slide", {"r": 0})):
        ls.step(spec.instance(a, p))
    x = spec.instance("append", {"r": 0, "j": 2})
    assert not x.guard(ls.s)                     # the spec alone: no room
    return ls, x


def test_an_allocation_that_evicts_to_make_room_stays_in_lockstep() -> None:
    ls, x = _full_pool(_MakesRoom())
    assert ls.probe(x) and ls.diverged is None and ls.s == ls.sut.state
    assert ls.s[ls.model.spec.lay.r(0, "rpos")] == 3


def test_an_allocation_that_evicts_a_pinned_page_to_make_room_is_caught() -> None:
    ls, x = _full_pool(_MakesRoom(pinned=True))
    with pytest.raises(Finding) as e:             # not a lockstep step: a probe taken, judged
        ls.probe(x)
    assert e.value.kind == "invariant" and "toctou_bound_stable" in e.value.checks, e.value


class _OwnVictim(SpecSUT):
    """The spec as an engine with its own choice inside allocation (alloc = evict): the victim
    of append_evict is the lowest evictable block (LRU-like), the request append_fail preempts
    the highest slot; what differs from the step sent is returned as {"instead": ...}. `bad`
    names a victim the spec forbids (a block still held)."""

    def __init__(self, bad: bool = False) -> None:
        super().__init__()
        self.bad, self.instead = bad, 0

    def apply(self, action, params):
        if action not in ("append_evict", "append_fail"):
            return super().apply(action, params)
        key = "v" if action == "append_evict" else "x"
        n = self.spec.cfg.blocks if key == "v" else self.spec.cfg.requests
        cands = [c for c in range(n) if key == "x" or c != params["j"]]
        ok = [c for c in cands if self.spec.instance(action, {**params, key: c}).guard(self.state)]
        if self.bad and key == "v":
            ok = [c for c in cands if c not in ok] or ok
            inst = self.spec.instance(action, {**params, key: ok[0]})
            self.state = inst.effect(self.state)
            return {"instead": {key: ok[0]}}
        c = ok[0] if key == "v" else ok[-1]
        super().apply(action, {**params, key: c})
        self.instead += c != params[key]
        return {"instead": {key: c}} if c != params[key] else {}


def test_an_engine_choosing_its_own_victim_runs_clean_in_lockstep() -> None:
    from kvcheck.checker.explore import _ALLOC
    from dataclasses import replace
    cfg = replace(_ALLOC, requests=2, max_active=2)
    sut = _OwnVictim()
    for seed in range(6):
        ls = _live_walk(sut, cfg, 300, seed)
    assert sut.instead > 0 and ls.diverged is None


def test_an_engine_choosing_a_forbidden_victim_is_caught() -> None:
    """Evicting a held block in place of the spec's victim: the divergence is followed, and what
    it breaks is the finding."""
    from kvcheck.checker.explore import _ALLOC
    from dataclasses import replace
    cfg = replace(_ALLOC, requests=2, max_active=2)
    with pytest.raises(Finding) as e:
        for seed in range(20):
            _live_walk(_OwnVictim(bad=True), cfg, 300, seed)
    assert "toctou_bound_stable" in e.value.checks, e.value


def test_a_malformed_instead_is_a_sut_error() -> None:
    class Bad(SpecSUT):
        def apply(self, action, params):
            out = super().apply(action, params)
            return {**out, "instead": {"nope": 1}} if action == "submit" else out
    with pytest.raises(SutError, match="must map some of the step's parameters"):
        _live_walk(Bad(), CFG, 20, 0)


class _Copies(SpecSUT):
    """The spec as an engine that never shares a block it computes: an append of a block that is
    cached meanwhile makes its own copy. With duplicates = allow it says so ({"instead":
    {"action": "append_copy"}} and a ("duplicate", j) claim); with forbid it can only claim it."""

    copies = 0

    def apply(self, action, params):
        if action != "append":
            return super().apply(action, params)
        j, allow = params["j"], self.spec.cfg.duplicates == "allow"
        cached = self.state[self.spec.lay.o(0, "swa_window", j, "st")] == READY
        if cached and allow and self.spec.instance("append_copy", params).guard(self.state):
            out = {**super().apply("append_copy", params), "instead": {"action": "append_copy"}}
        else:           # (allow: no room for a copy, or one exists already; it shares)
            out = super().apply(action, params)
            if not cached or allow:
                return out
        type(self).copies += 1
        return {**out, "events": [("duplicate", j)]}


def test_an_engine_keeping_duplicate_copies_runs_clean_when_they_are_allowed() -> None:
    from kvcheck.checker.explore import _DUP
    _Copies.copies = 0
    for seed in range(20):
        ls = _live_walk(_Copies(), _DUP, 300, seed)
        assert ls.diverged is None
    assert _Copies.copies >= 5         # appends the engine turned into copies, in lockstep


def test_a_duplicate_copy_is_a_finding_when_the_config_forbids_them() -> None:
    from dataclasses import replace
    from kvcheck.checker.explore import _DUP
    with pytest.raises(Finding) as e:
        for seed in range(6):
            _live_walk(_Copies(), replace(_DUP, duplicates="forbid"), 300, seed)
    assert e.value.checks == ["sut_accepted_disabled_action"], e.value
    assert 'duplicates = "forbid"' in e.value.message and "second physical copy" in e.value.message
