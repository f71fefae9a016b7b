"""The differential's step loop (fuzz/reuse_replay.py) on a tiny fake adapter: one record per
send, a refused submit is `rejected`, a broken check is recorded with its known defect and ends
the workload (nothing after it is replayed)."""
from __future__ import annotations

from typing import Any

from kvcheck.fuzz.reuse_replay import Acts, replay
from kvcheck.spec.sut import ActionRejected


class Fake:
    """Submits up to 3 tokens; a `lookup` of a prompt starting with 9 breaks `hit_sound`."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.broken: tuple[str, str, str] | None = None

    def apply(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        self.log.append(action)
        if action == "submit" and len(params["tokens"]) > 3:
            raise ActionRejected("too long")
        if action == "submit":
            self.tokens = params["tokens"]
        if action == "lookup" and self.tokens[0] == 9:
            self.broken = ("safety", "hit_sound", "served a slot it does not hold")
        return {"admitted": True}

    def extra_checks(self, action: str, params: dict[str, Any]) -> tuple[str, str, str] | None:
        b, self.broken = self.broken, None
        return b


def _run(tokens: list[list[int]]) -> tuple[Fake, list[dict[str, Any]]]:
    ad = Fake()
    steps: list[dict[str, Any]] = []
    for i, t in enumerate(tokens):
        steps += [{"op": "send", "r": f"q{i}", "tokens": t, "output": [], "chunk": None}, {"op": "finish", "r": f"q{i}"}]
    act = Acts(ad, lambda broken, action, params: f"known-{broken[1]}" if action == "lookup" else None,
               lambda rec, action: rec.update(decision="violation"))

    def send(rec: dict[str, Any], st: dict[str, Any]) -> None:
        if act("lookup", {"r": st["r"]}, rec) is not None:
            rec.update(hit=1, decision="hit")
    return ad, replay({"name": "w", "steps": steps}, act, send)


def test_one_record_per_send_and_a_refused_submit_is_rejected() -> None:
    _, recs = _run([[1, 2], [1, 2, 3, 4], [1, 2, 3]])
    assert [(r["step"], r["request"], r["prompt_tokens"], r["decision"]) for r in recs] == \
        [(0, "q0", 2, "hit"), (2, "q1", 4, "rejected"), (4, "q2", 3, "hit")]
    assert all(r["violation"] is None for r in recs)


def test_a_broken_check_is_recorded_with_its_known_defect_and_ends_the_workload() -> None:
    ad, recs = _run([[1, 2], [9, 2], [1, 2, 3]])
    assert [r["decision"] for r in recs] == ["hit", "violation"]
    assert recs[1]["violation"] == {"kind": "safety", "check": "hit_sound", "known": "known-hit_sound",
                                    "message": "served a slot it does not hold"}
    assert ad.log[-1] == "lookup"                 # nothing replayed after the broken check
