"""The one shrinker's passes (kvcheck/fuzz/shrink.py) on toy programs, and the adapters' sides
of shrinking that need no engine: SGLang's alternatives and request groups, vLLM's evictions."""
from __future__ import annotations

from kvcheck.fuzz.models import Act
from kvcheck.fuzz.shrink import budget, shrink, size


def _a(action: str, **params) -> Act:
    return Act(action, params)


# A failure that needs `a` and `b`, and either `c` or both of them at their smallest value (as an
# eviction can stand for the requests that filled the pool, but only once a prompt makes the
# locked node a leaf): no step can go, and neither change alone lets one go.
A2, A1, B2, B1, C = _a("a", v=2), _a("a", v=1), _a("b", v=2), _a("b", v=1), _a("c")


def _fails(p: list[Act]) -> list[Act] | None:
    va = next((x.params["v"] for x in p if x.action == "a"), None)
    vb = next((x.params["v"] for x in p if x.action == "b"), None)
    if va is None or vb is None:
        return None
    return p if C in p or (va == 1 and vb == 1) else None


def _alts(p: list[Act]) -> list[list[Act]]:
    return [[A1] if x == A2 else [B1] if x == B2 else [] for x in p]


def test_a_smaller_change_is_kept_so_that_a_second_one_can_delete() -> None:
    prog = [A2, B2, C]
    assert shrink(prog, _fails, 5.0) == prog                    # nothing deletes
    # the rule before this pass kept a change only when deleting after it gave a shorter
    # program: neither change does that by itself, so it stopped at three steps
    for i, x in ((0, A1), (1, B1)):
        changed = prog[:i] + [x] + prog[i + 1:]
        assert _fails(changed) is not None and len(shrink(changed, _fails, 5.0)) == 3
    # kept because the program is smaller (shortlex: same length, smaller integers), the first
    # change lets the second one through, and then `c` goes
    assert shrink(prog, _fails, 5.0, _alts) == [A1, B1]


def test_size_is_shortlex_steps_then_atoms_then_magnitude() -> None:
    assert size([A2, B2]) < size([A2, B2, C])
    assert size([A1, B2]) < size([A2, B2])
    assert size([_a("evict", n=48)]) < size([_a("match", r="r1", tokens=[1, 2])])   # fewer atoms first
    assert size([_a("x", t=[5, 5])]) == (1, 2, 10)


def test_each_distinct_candidate_runs_once() -> None:
    seen: list[tuple] = []

    def fails(p: list[int]) -> list[int] | None:
        seen.append(tuple(p))
        return p if 3 in p and 7 in p else None
    related = lambda p: [[i for i, x in enumerate(p) if x % 2 == 0]]    # noqa: E731
    assert shrink(list(range(12)), fails, 5.0, related=related) == [3, 7]
    assert len(seen) == len(set(seen))


def test_a_changed_step_is_tried_again_and_the_result_deleted_again() -> None:
    # 9 fails alone; 8 -> 9 needs 1 beside it (kept by deletion), 5 -> 4 -> 3 by smaller values
    def fails(p: list[int]) -> list[int] | None:
        return p if 9 in p or (8 in p and 1 in p) or (3 in p and 2 in p) else None

    def alts(p: list[int]) -> list[list[int]]:
        return [[9] if x == 8 else [x - 1] if x > 2 else [] for x in p]
    assert shrink([1, 8, 2], fails, 5.0, alts) == [9]
    assert shrink([5, 2], lambda p: p if 2 in p and any(x >= 3 for x in p) else None, 5.0, alts) == [3, 2]


def test_budget_counts_cpu_time() -> None:
    assert not budget(0.0)()
    left = budget(60.0)
    assert left() and left()


def test_sglang_alternatives_request_groups_and_parts() -> None:
    from kvcheck.engines.sglang.steps import (alternatives, fuse, requests, unfuse)
    prog = [_a("match", r="r0", tokens=[1, 2, 3]), _a("finish", r="r0"),
            _a("match", r="r1", tokens=[1, 5, 6, 7]), _a("match", r="r2", tokens=[4, 4]), _a("finish", r="r1")]
    alts = alternatives(48)(prog)
    evictions = [x.params["n"] for x in alts[3] if x.action == "evict"]
    assert evictions == [1, 2, 4, 8, 16, 32, 48]             # an eviction of 1, 2, 4, ... the pool
    assert alts[1] == []                                     # in place of a step that allocates only
    # r1 may become a next turn of r0 (r0's prompt, then r1's last token); r2 shares nothing
    assert _a("match", r="r1", tokens=[1, 2, 3, 7]) in alts[2]
    assert not [x for x in alts[3] if x.action == "match"]
    assert requests(prog) == [[0, 1], [2, 4], [3]]
    parts = unfuse(prog + [_a("decode", r="r2", toks=[1, 2])])
    assert [x.action for x in parts[:3]] == ["submit", "match", "finish"] and parts[-1] == _a("decode", r="r2", tok=2)
    assert fuse(parts) == prog + [_a("decode", r="r2", toks=[1, 2])]


def test_vllm_alternatives_offer_one_block_evictions() -> None:
    from kvcheck.engines.vllm.drivers import _alternatives
    prog = [_a("submit", r="r0", tokens=[1, 2, 3, 4], salt=None), _a("lookup", r="r0", chunk=2)]
    alts = _alternatives(5)(prog)
    assert _a("evict_blocks", block_ids=[4]) in alts[0] and _a("submit", r="r0", tokens=[1, 2], salt=None) in alts[0]
    assert alts[1][0] == _a("lookup", r="r0", chunk=10**6)
    assert [x.params["block_ids"] for x in alts[1][1:]] == [[1], [2], [3], [4]]
