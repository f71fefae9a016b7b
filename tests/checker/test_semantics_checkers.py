"""The explorer and Z3 on the configurable semantics: content (prompts > 1) explored
exhaustively and proved clean, and each fault of a semantic found by both with its own check."""
from __future__ import annotations

from dataclasses import replace

import pytest

from kvcheck.checker import explore
from kvcheck.spec import faults as F

pytest.importorskip("z3")
from kvcheck.checker import prove  # noqa: E402


@pytest.mark.parametrize("cfg", [explore._CONTENT, replace(explore._CONTENT, salted_prompts=1),
                                 explore._CONTENT_DISK], ids=["prompts", "salted", "prompts+disk"])
def test_content_semantics_explored_exhaustively_and_clean(cfg, tmp_path) -> None:
    code, rep = explore.run_explore(cfg, tmp_path, None, seconds=60)
    assert code == 0 and rep["exhaustive"] and rep.get("violation") is None and rep["states"] > 1000
    assert rep["verdict"] == "holds"


def test_alloc_semantics_explored_exhaustively_evicting_and_failing(tmp_path) -> None:
    code, rep = explore.run_explore(explore._ALLOC, tmp_path, None, seconds=60)
    assert code == 0 and rep["exhaustive"] and rep.get("violation") is None
    assert rep["actions"]["append_evict"] > 0 and rep["actions"]["append_fail"] > 0


def test_duplicates_explored_to_the_copy_eviction_inside_allocation() -> None:
    spec, res, _ = explore.explore(explore._DUP, max_depth=12, liveness=False)
    assert res.violation is None and res.report["actions"]["append_evict_copy"] > 0
    assert res.report["actions"]["append_copy"] > 0 and res.report["actions"]["evict_copy"] > 0


def test_late_publishing_explored_exhaustively_and_clean(tmp_path) -> None:
    """publish = release (duplicates.py's config): the second request copies what the first has
    not published, both copies are evicted and reused; and over a window, with two prompts, a
    release never publishes a slot another prompt rewrote."""
    code, rep = explore.run_explore(replace(explore._DUP, publish="release"), tmp_path, None, seconds=60)
    assert code == 0 and rep["exhaustive"] and rep["verdict"] == "holds"
    assert min(rep["actions"][a] for a in ("append_copy", "evict_copy", "append_evict_copy")) > 0
    swa = F.get("late_publish_reused_slot").config_for(explore.FAULT_CONFIG)
    _, res, _ = explore.explore(swa, max_depth=16, liveness=False)
    assert res.violation is None and res.report["actions"]["append_copy"] > 0


@pytest.mark.slow
def test_duplicates_explored_exhaustively_and_clean(tmp_path) -> None:
    code, rep = explore.run_explore(explore._DUP, tmp_path, None, seconds=300)
    assert code == 0 and rep["exhaustive"] and rep["verdict"] == "holds"     # 89,178 states


@pytest.mark.parametrize("cfg", [explore._CONTENT, replace(explore._CONTENT, prompts=1, eviction="drop_hash"),
                                 replace(explore._CONTENT, prompts=3, salted_prompts=1),
                                 replace(explore._CONTENT, tiers=("device", "disk")),
                                 replace(explore._CONTENT, decode=True, block_size=2), explore._ALLOC,
                                 replace(explore._ALLOC, eviction="drop_hash", requests=2), explore._DUP,
                                 replace(explore._DUP, publish="release")],
                         ids=["prompts", "drop_hash", "salted", "prompts+disk", "decode+prompts", "alloc", "alloc+drop_hash",
                              "duplicates", "late_publish"])
def test_z3_proves_the_semantics_inductive(cfg, tmp_path) -> None:
    code, rep = prove.run_prove(cfg, tmp_path, None, profile=prove.ProveProfile(depth=4))
    assert code == 0 and rep["verdict"] == "proved", [o for o in rep["invariants"] if o["status"] != "proved"]
    names = {o["name"] for o in rep["invariants"]}
    assert ({"hit_content_sound", "hash_names_content"} if cfg.prompts > 1 else
            {"published_hash_resident"} if cfg.eviction == "drop_hash" else set()) <= names
    assert not cfg.decode or {"hit_full_blocks", "blocks_whole"} <= names
    assert cfg.duplicates == "forbid" or "copies_cached" in names


@pytest.mark.parametrize("fault", [f.name for f in F.SPEC_FAULTS if f.needs])
def test_each_semantic_fault_is_found_by_bfs_with_its_check(fault) -> None:
    r = explore.mutant_engine(None, fault, 30, 0)
    assert r["detected"] and F.get(fault).expected in r["caught_by"], r


def test_z3_finds_the_unsafe_content_hit(tmp_path) -> None:
    code, rep = prove.run_prove(explore._CONTENT, tmp_path, "hash_ignores_parent",
                                profile=prove.ProveProfile(fault_depth=16, bmc_seconds=120))
    assert rep["fault_result"]["caught"], rep["bmc"]
