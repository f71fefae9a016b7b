"""Legal duplicates (kvcheck issue 35, E): two physical copies of one block's content are engine
behaviour, not a finding. The fixed sequence-level manager publishing late (tests/adapters/
seqcache.py, late_publish) computes block 0 twice while two requests run; reusing one copy's
memory while the other is held evicts nothing the spec tracks. A manager that overwrites a held
copy is still a TOCTOU break."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvcheck.fuzz.guard import GuardedLockstep, ValuedSpecModel
from kvcheck.spec.config import Config
from kvcheck.spec.system import Spec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from seqcache import LatePublishAdapter  # noqa: E402

CFG = Config.from_dict({"layers": [{"kind": "full"}], "blocks": 3, "requests": 2, "tiers": ["device"],
                        "capacity": {"swa_window": 2}, "salt": False, "alloc": "evict",
                        "eviction": "drop_hash"})
# both requests decide before either computes block 0; r1 computes its own copy (r0's is not
# published yet), finishes (publishing it), and r0's next block reuses that copy's memory
RACE = [("submit", {"r": 0, "n": 2}), ("lookup", {"r": 0}), ("bind", {"r": 0}), ("use", {"r": 0}),
        ("submit", {"r": 1, "n": 1}), ("lookup", {"r": 1}), ("bind", {"r": 1}), ("use", {"r": 1}),
        ("append", {"r": 0, "j": 0}), ("append", {"r": 1, "j": 0}), ("finish", {"r": 1}),
        ("append", {"r": 0, "j": 1}), ("finish", {"r": 0})]


def _run(sut, prog=RACE):
    model = ValuedSpecModel(Spec(CFG))
    core = GuardedLockstep(model, sut)
    sut.reset(CFG)
    return core, core.run([model.step(a, p) for a, p in prog])


def test_a_legal_duplicate_is_no_finding() -> None:
    sut = LatePublishAdapter()
    core, f = _run(sut)
    assert f is None, f and f.message
    assert core.lockstep == len(RACE)
    m = sut.m
    assert m.seqs == {} and sorted(m.ref) == [0, 0]
    # the duplicate existed: r1's block 0 was another physical block than r0's, then reused
    assert len({m.key[b] for b in range(2)}) == 2


def test_overwriting_a_held_duplicate_is_still_toctou() -> None:
    """The negative control: a manager that hands out a block another request holds."""

    class Steals(LatePublishAdapter):
        def allocate(self, req, block_hash, hit=None):
            b = super().allocate(req, block_hash, hit)
            if req == 0 and len(self.m.seqs.get(0, [])) == 2:      # r0's block 1: r0's own block 0
                self.m.seqs[0][-1] = b = self.m.seqs[0][0]
            return b

    _, f = _run(Steals())
    assert f is not None and f.checks == ["toctou_bound_stable"], f and f.message
