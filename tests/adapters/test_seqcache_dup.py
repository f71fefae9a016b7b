"""Legal duplicates (kvcheck issue 35, E): two physical copies of one block's content are engine
behaviour, not a finding. The fixed sequence-level manager publishing late (tests/adapters/
seqcache.py, late_publish) computes block 0 twice while two requests run; reusing one copy's
memory while the other is held evicts nothing the spec tracks. A manager that overwrites a held
copy is still a TOCTOU break."""
from __future__ import annotations

import sys
from pathlib import Path

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


# ---- D: prompts > 1 with an engine that evicts only inside allocation (no evict callback) ----

PROMPTS = Config.from_dict({**CFG.to_dict(), "prompts": 3})


def test_prompts_without_evict_callback_runs_clean_and_bugs_are_caught(tmp_path) -> None:
    from kvcheck.fuzz.campaign import Budget, run_campaign
    from kvcheck.spec.severity import lead
    from seqcache import BUGS, SeqAdapter
    assert getattr(SeqAdapter, "evict", None) is None
    sut = SeqAdapter()
    sut.reset(PROMPTS)                                  # no longer refused
    assert "evict" not in sut.actions
    for fault in (None, *sorted(BUGS)):
        res = run_campaign(PROMPTS, "seqcache:SeqAdapter", Budget(steps=4000), seed=0, fault=fault,
                           out=tmp_path, shrink_seconds=4)
        if fault is None:
            assert res["exit_code"] == 0, res["findings"]
            assert res["coverage"]["actions"].get("append_fail", 0) > 0
        else:
            assert lead(res["findings"][0]["checks"]) == BUGS[fault], res["findings"][0]


def test_another_prompts_copy_left_cached_is_not_counted() -> None:
    """Prompt 1 rewrites block 1 (its edit); prompt 0's copy stays in the manager (room for it,
    no evict callback). Prompt 0's next lookup hits both blocks in the manager, sound content;
    the spec's one slot per position counts block 0 only, and so does the base class."""
    from seqcache import SeqAdapter
    cfg = Config.from_dict({**CFG.to_dict(), "prompts": 2, "capacity": {"swa_window": 3}})
    model = ValuedSpecModel(Spec(cfg))
    sut = SeqAdapter()
    core = GuardedLockstep(model, sut)
    sut.reset(cfg)
    run = lambda r, p: [("submit", {"r": r, "n": 2, "p": p}), ("lookup", {"r": r}), ("bind", {"r": r}),  # noqa: E731
                        ("use", {"r": r})]
    prog = run(0, 0) + [("append", {"r": 0, "j": 0}), ("append", {"r": 0, "j": 1}), ("finish", {"r": 0})]
    prog += run(1, 1) + [("append", {"r": 1, "j": 1}), ("finish", {"r": 1})] + run(0, 0)
    f = core.run([model.step(a, p) for a, p in prog])
    assert f is None, f.message
    _, toks = sut.prompts[0]
    assert len(sut.m.match(toks[:2 * sut.B])) == 2      # the manager still has prompt 0's block 1
    assert sut.req[0]["k"] == 1                         # counted as the spec counts it
