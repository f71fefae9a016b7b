"""The action table in docs/adapters.md is the one generated from the spec's declarations,
and every action has its guard and effect in words: neither can drift from spec/actions.py."""
from __future__ import annotations

from pathlib import Path

from kvcheck.checker import action_table as T
from kvcheck.spec.actions import ACTIONS

DOC = Path(__file__).resolve().parents[2] / "docs" / "adapters.md"


def test_every_action_has_prose_and_no_stale_entry() -> None:
    assert set(T.PROSE) == set(ACTIONS)


def test_docs_table_matches_the_declarations() -> None:
    text = DOC.read_text()
    assert T.splice(text, T.render()) == text, "run: python scripts/action-table.py --write"


def test_generated_fields_come_from_the_bodies() -> None:
    rows = {r["action"]: r for r in T.rows()}
    assert "`blk.hashed`" in rows["append"]["writes"] and "`obj.ref`" in rows["evict"]["reads"]
    assert rows["submit"]["params"] == "`r` 0..requests-1, `n` 1..blocks"
    assert rows["offload_start"]["full"] == "absent" and rows["evict"]["full"] == "yes"


def test_a_drifted_table_is_detected() -> None:
    text = DOC.read_text()
    drifted = text.replace("| `evict` |", "| `evict_block` |", 1)
    assert drifted != text and T.splice(drifted, T.render()) != drifted
