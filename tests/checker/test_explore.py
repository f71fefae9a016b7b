"""Explicit-state exploration: counts against an independent brute force, symmetry soundness,
planted faults found with their expected invariant, graph export."""
from __future__ import annotations

import json
import random

import networkx as nx
import pytest

from kvcheck.checker import cli
from kvcheck.checker.explore import (Canon, FAULT_CONFIG, concrete_steps, explore, fault_config,
                                     run_explore)
from kvcheck.spec.config import Config, LayerSpec
from kvcheck.spec.faults import spec_faults
from kvcheck.spec.system import Spec
from kvcheck.spec.trace import Trace
from kvcheck.checker.replay import replay_trace

TINY = Config(layers=(LayerSpec("swa", window=1),), blocks=1, requests=1, max_version=0,
              reserve=0, capacity={"swa_window": 1}, max_inflight=1, max_active=1)
TWO = Config(layers=(LayerSpec("swa", window=1),), blocks=1, requests=2, max_version=0,
             tiers=("device",), reserve=0, capacity={"swa_window": 1}, max_inflight=1, max_active=2)


def brute_force(spec: Spec, max_depth: int | None = None) -> set[tuple]:
    """Plain BFS without symmetry, written independently of explore()."""
    init = spec.init()
    seen, frontier, depth = {init}, [init], 0
    while frontier and (max_depth is None or depth < max_depth):
        nxt = []
        for s in frontier:
            for inst in spec.instances:
                if inst.guard(s):
                    t = inst.effect(s)
                    if t not in seen:
                        seen.add(t)
                        nxt.append(t)
        frontier, depth = nxt, depth + 1
    return seen


def test_exhaustive_count_matches_brute_force():
    spec, res, _ = explore(TINY)
    assert res.exhaustive and res.violation is None
    assert res.states == len(brute_force(Spec(TINY)))
    assert res.report["deadlocks"] == 0


def test_symmetry_reduction_counts_orbits():
    depth = 7
    spec, res, _ = explore(TWO, max_depth=depth, liveness=False)
    full = brute_force(Spec(TWO), depth)
    canon = Canon(spec)
    assert res.states == len({canon(s) for s in full})
    assert res.states < len(full)
    _, plain, _ = explore(TWO, max_depth=depth, liveness=False, symmetry=False)
    assert plain.states == len(full)


def test_symmetry_commutes_with_successors_and_invariants():
    """Swapping request slots maps successors to successors and keeps every verdict."""
    spec = Spec(TWO, "refcount_double_decrement")
    canon = Canon(spec)
    lo, w = canon.lo, canon.w
    swap = lambda s: s[:lo] + s[lo + w:lo + 2 * w] + s[lo:lo + w] + s[lo + 2 * w:]  # noqa: E731
    states = list(brute_force(spec, 6))
    random.Random(0).shuffle(states)
    for s in states[:400]:
        succ = {canon(i.effect(s)) for i in spec.instances if i.guard(s)}
        succ_sw = {canon(i.effect(swap(s))) for i in spec.instances if i.guard(swap(s))}
        assert succ == succ_sw
        assert bool(spec.check(s)) == bool(spec.check(swap(s)))
        assert {spec.decide(s, r)["kind"] for r in (0, 1)} == {spec.decide(swap(s), r)["kind"] for r in (0, 1)}


FAST = ["window_off_by_one", "tail_junction_not_checked", "eviction_ignores_pins", "abi_ignored",
        "no_revalidation_at_use", "refcount_double_decrement", "admission_ignored",
        "shared_free_list", "graph_pages_migrated", "stale_hash_after_evict", "hash_ignores_parent",
        "stale_hash_after_reuse", "hash_missing_salt", "decode_publishes_partial", "alloc_evicts_referenced",
        "copy_ignores_capacity", "restore_under_stale_key", "slide_one_window", "late_publish_reused_slot"]


@pytest.mark.parametrize("fault", [f.name for f in spec_faults()])
def test_fault_found_with_expected_invariant(fault, tmp_path):
    if fault not in FAST:
        pytest.skip("BFS needs 0.4-0.8 M states for this fault (~10-25 s): run with -m slow "
                    "(test_slow_faults)")
    _check_fault(fault, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["decision_ignores_indexer_version", "prefetch_counted_as_hit",
                                   "compressed_version_ignored"])
def test_slow_faults(fault, tmp_path):
    _check_fault(fault, tmp_path)


def _check_fault(fault, tmp_path):
    code, rep = run_explore(fault_config(fault), tmp_path, fault)
    assert code == 10
    assert rep["fault_result"]["caught"], rep["fault_result"]
    tr = Trace.load(rep["violation"]["trace"])
    assert tr.engine == "explore" and len(tr.steps) == rep["violation"]["depth"]
    rcode, out = replay_trace(tr)
    assert rcode == 10 and set(out["violation"]["invariants"]) == set(rep["violation"]["invariants"])


def test_shortest_counterexample():
    """BFS depth = the shortest violating path: no shorter path exists (brute force)."""
    spec = Spec(FAULT_CONFIG, "no_revalidation_at_use")
    _, res, _ = explore(FAULT_CONFIG, "no_revalidation_at_use", liveness=False)
    d = res.violation["depth"]
    assert not any(spec.check(s) for s in brute_force(spec, d - 1))
    steps = concrete_steps(spec, res.violation["path"])
    assert len(steps) == d


def test_cli_graph_export_and_exit_codes(tmp_path, capsys):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY.to_dict()))
    g = tmp_path / "g.graphml"
    assert cli.main(["explore", "--config", str(cfg), "--graph", str(g), "--out", str(tmp_path / "o"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    graph = nx.read_graphml(g)
    assert graph.number_of_nodes() == rep["states"]
    assert (tmp_path / "o" / "explore.json").exists()
    assert any((tmp_path / "o").glob("states-swa_window.*"))
    # budget hit before exhaustion with coverage incomplete: exit 3
    assert cli.main(["explore", "--config", str(cfg), "--max-states", "5"]) == 3
    assert cli.main(["explore", "--fault", "no-such-fault"]) == 2
    assert "unknown fault" in capsys.readouterr().err
