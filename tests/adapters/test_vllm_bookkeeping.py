"""The incremental bookkeeping check (vllm_bookkeeping.py) against the full scan per step:
the same finding, at the same step, on the same programs; a change no step announces is
still caught by the periodic full scan, and shrinking re-locates it where it happened."""
from __future__ import annotations

import random

import pytest

from kvcheck.engines.vllm import drivers as V

pytest.importorskip("vllm")

from kvcheck.engines.vllm.adapter import VllmAdapter  # noqa: E402
from kvcheck.fuzz.lockstep import Act, Finding, FreeModel, Lockstep  # noqa: E402


def _episode(layout, fault, seed, every, num_blocks=20):
    """One generated episode: (checks, step, message) of its finding, or None; the adapter."""
    rng = random.Random(seed)
    gen = V._Gen(rng, V.layout_scale(layout)[1])
    ad = VllmAdapter(layout, num_blocks, fault)
    ad.full_scan_every = every
    core = Lockstep(FreeModel(), ad)
    for _ in range(120):
        try:
            core.step(Act(*gen.next(ad)))
        except Finding as f:
            return (f.checks, len(f.program), f.message), ad, f
    return None, ad, None


@pytest.mark.parametrize("layout", ["full+swa", "gemma3"])
def test_incremental_reports_what_the_full_scan_reports(layout):
    found = 0
    for fault in (None, "drop_ref_on_free", "evict_keeps_hash"):
        for seed in range(2):
            exact, _, _ = _episode(layout, fault, seed, 1)
            incr, ad, _ = _episode(layout, fault, seed, 10**9)     # never a periodic full scan
            assert incr == exact, (fault, seed)
            found += exact is not None
            assert not ad.coverage["state:full_scan_only"]
    assert found >= 2          # the planted faults were there to be caught


def _unannounced(monkeypatch):
    """A bug no step announces: a submit silently strips the hash off a free cached block
    (its prefix-cache map entry stays): only a full scan looks at that block."""
    orig = VllmAdapter._a_submit

    def submit(self, tokens, salt=None, r=None):
        out = orig(self, tokens, salt, r)
        for b in self.pool.blocks:
            if b.block_hash is not None and b.ref_cnt == 0:
                getattr(self.pool, "cached_block_hashes_by_block", {}).pop(b.block_id, None)
                b.reset_hash()
                break
        return out
    monkeypatch.setattr(VllmAdapter, "_a_submit", submit)


def test_a_change_no_step_announces_is_caught_by_the_periodic_scan_and_relocated(monkeypatch):
    _unannounced(monkeypatch)
    for seed in range(20):
        exact, _, _ = _episode("full+swa", None, seed, 1)
        if exact is not None:
            break
    assert exact is not None and exact[0] == ["hash_map_sound"]
    blind, _, _ = _episode("full+swa", None, seed, 10**9)
    assert blind is None or blind[1] > exact[1]           # the incremental check alone is late
    late, ad, f = _episode("full+swa", None, seed, 4)     # (a reset in between may heal one)
    assert late[0] == exact[0] and exact[1] <= late[1]
    assert ad.coverage["state:full_scan_only"] == 1
    small = V._shrink("full+swa", 20, None, f, False, 10)   # re-located in the exact mode
    assert small.checks == exact[0] and len(small.program) <= exact[1]
