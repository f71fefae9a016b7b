"""The incremental SGLang checks (sglang_incremental.py) against the full scan after every
step: on the same programs they report the same finding (check, step, message) for every
planted fault on every layout of the installed release that it applies to, each fault is
caught by its expected check in both modes, clean programs stay clean in both, and the
incremental check never raised a violation the full scan did not confirm. A change no step
announces (a tree node's values edited in place) is caught by the periodic full scan and
re-located by the shrinker. Skipped (with the reason) where SGLang is not importable: run
from a side venv built with scripts/install-sglang.sh.
"""
from __future__ import annotations

import random

import pytest

from kvcheck.engines.sglang.layouts import (FAULTS, LAYOUTS, fault_applies, known_finding)

from test_sglang import _sglang, _supported as _all_supported  # noqa: F401  (the release or a skip; tests/adapters is on sys.path)


def _supported() -> list[str]:
    """The cache-level layouts (the incremental checks are theirs; the scheduler drive checks each step)."""
    return [x for x in _all_supported() if LAYOUTS[x].drive == "cache"]

NEVER = 10 ** 9         # incremental, no periodic full scan: what the incremental check sees alone




def _program(lay, fault, seed):
    """One generated episode, as run_campaign draws it (exact mode): its steps, capacity, finding."""
    from kvcheck.engines.sglang import drivers as sg
    from kvcheck.fuzz.lockstep import Act, Finding, FreeModel, Lockstep
    rng = random.Random(seed)
    gen = sg._Gen(rng)
    capacity = rng.choice([1, 2, 3]) * lay.capacity // 2 // lay.page_size * lay.page_size
    ad = sg.make_adapter(lay, fault, capacity)
    core = Lockstep(FreeModel(), ad)
    for _ in range(rng.randint(20, 120)):
        try:
            core.step(Act(*gen.next(ad)))
        except Finding:
            break
    return core.program, capacity


def _run(lay, fault, capacity, program, every):
    """The program on a fresh cache with the checks in the given mode: (finding, coverage)."""
    from kvcheck.engines.sglang import drivers as sg
    from kvcheck.fuzz.lockstep import FreeModel, Lockstep
    ad = sg.make_adapter(lay, fault, capacity)
    ad.full_scan_every = every
    f = Lockstep(FreeModel(), ad).run(program)
    return (None if f is None else (f.checks, len(f.program), f.message)), ad.coverage


def _same_in_both_modes(lay, fault, seed):
    program, capacity = _program(lay, fault, seed)
    exact, _ = _run(lay, fault, capacity, program, 1)
    for every in (NEVER, 8):
        incr, cov = _run(lay, fault, capacity, program, every)
        assert incr == exact, (lay.name, fault, seed, every, exact, incr)
        assert not cov.get("state:incremental_false_alarm"), (lay.name, fault, seed, cov)
        assert not cov.get("state:full_scan_only"), (lay.name, fault, seed, cov)
    return exact


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_incremental_reports_what_the_full_scan_reports_on_every_planted_fault(fault):
    lays = [x for x in _supported() if fault_applies(fault, LAYOUTS[x])]
    if not lays:
        pytest.skip(f"{fault} needs a class this release lacks")
    for name in lays:
        lay = LAYOUTS[name]
        for seed in range(4):                   # the first episodes, whatever they find
            _same_in_both_modes(lay, fault, 7_000_003 + seed)
        for seed in range(4, 400):              # and the first in which its own check fires
            program, capacity = _program(lay, fault, 7_000_003 + seed)
            exact, _ = _run(lay, fault, capacity, program, 1)
            if exact is not None and exact[0][0] == FAULTS[fault].expected:
                assert _same_in_both_modes(lay, fault, 7_000_003 + seed) == exact
                break
        else:
            pytest.fail(f"{fault} on {name}: {FAULTS[fault].expected} never fired in 400 episodes")


def test_clean_programs_are_clean_in_both_modes():
    from kvcheck.engines.sglang.install import sglang_version
    for name in _supported():
        known = known_finding(LAYOUTS[name], sglang_version())     # a real bug of this release
        for seed in range(3):
            got = _same_in_both_modes(LAYOUTS[name], None, 9_000_011 + seed)    # (the modes agree)
            assert got is None or (known is not None and got[0] == [known]), (name, got)


def test_a_change_no_step_announces_is_caught_by_the_periodic_full_scan_and_relocated(monkeypatch):
    """A bug that edits a node's values in place at a submit (no cache call, no slot changes
    state): the incremental check alone does not see it; the periodic full scan does (counted),
    and the shrinker re-locates the finding in the exact mode."""
    from kvcheck.engines.sglang import drivers as sg
    from kvcheck.engines.sglang.adapter import SglangAdapter
    name = next((x for x in _supported() if LAYOUTS[x].cls == "RadixCache" and LAYOUTS[x].page_size == 1), None)
    if name is None:
        pytest.skip("no page-1 RadixCache layout")
    orig = SglangAdapter._a_submit

    def submit(self, r, tokens):
        out = orig(self, r, tokens)
        if not getattr(self, "_edited", False):
            for node, _ in self.tree():
                if len(node.value) >= 2:    # swap two slots in place: each holds the other's prefix
                    node.value[0], node.value[1] = int(node.value[1]), int(node.value[0])
                    self._edited = True
                    break
        return out
    monkeypatch.setattr(SglangAdapter, "_a_submit", submit)
    lay = LAYOUTS[name]
    for seed in range(30):
        program, capacity = _program(lay, None, 5_000_000 + seed)
        exact, _ = _run(lay, None, capacity, program, 1)
        if exact is not None and exact[0] == ["tree_content_matches"]:
            break
    else:
        pytest.fail("the in-place edit never showed")
    from kvcheck.fuzz.lockstep import Act, Finding
    program = program[:exact[1]] + [Act("submit", {"r": f"x{i}", "tokens": [1, 2, 3]}) for i in range(8)]
    blind, cov = _run(lay, None, capacity, program, NEVER)
    assert blind is None or blind[1] > exact[1]          # the incremental check alone is late (or blind)
    late, cov = _run(lay, None, capacity, program, 4)
    assert late is not None and late[0] == exact[0] and late[1] >= exact[1]
    assert cov["state:full_scan_only"] == 1 or late[1] == exact[1]
    f = Finding("bookkeeping", late[0], late[2])
    f.program = program[:late[1]]
    small = sg.shrink_small(f, lay, capacity, None, 5)     # re-located in the exact mode, then shrunk
    assert small.checks == exact[0] and len(small.program) <= exact[1]
