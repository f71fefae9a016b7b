"""Z3: every invariant inductive on the default config (with the auxiliary invariants), the
hit-soundness theorem, BMC finding planted faults with their expected invariant."""
from __future__ import annotations

import json

import pytest

from kvcheck.checker import cli
from kvcheck.checker.explore import fault_config
from kvcheck.checker.prove import Prover
from kvcheck.checker.prove_aux import aux_for
from kvcheck.checker.replay import replay_trace
from kvcheck.spec import faults as faultlib
from kvcheck.spec.config import Config
from kvcheck.spec.invariants import invariants_for
from kvcheck.spec.trace import Trace


@pytest.fixture(scope="module")
def default_prover():
    return Prover(Config())


def test_default_config_every_invariant_inductive(default_prover):
    res = default_prover.induction()
    cfg = default_prover.cfg      # the invariants and auxiliaries of its semantics only
    assert set(res) == set(invariants_for(cfg)) | set(aux_for(cfg))
    bad = {n: (o.status, o.note) for n, o in res.items() if o.status != "proved"}
    assert not bad


def test_hit_soundness_theorem(default_prover):
    assert default_prover.hit_soundness().status == "proved"


def test_bmc_clean_finds_nothing():
    pv = Prover(Config(blocks=2))
    checked, path, viol = pv.bmc(3)
    assert checked == 3 and path is None and not viol


def test_aux_needed_cti_is_readable():
    """Without the auxiliary invariants, hit soundness is not inductive: a CTI names the action."""
    import kvcheck.checker.prove as P
    saved = dict(P.AUX)
    try:
        P.AUX.clear()
        P.AUX["type_ok"] = saved["type_ok"]
        pv = Prover(Config(blocks=2))
        res = pv.induction(only={"hit_sound_swa_window"})
    finally:
        P.AUX.clear()
        P.AUX.update(saved)
    o = res["hit_sound_swa_window"]
    assert o.status == "unknown" and o.cti["action"]
    assert o.cti["pre"] and o.cti["changed"]


# Shortest counterexample length of every spec fault on its explorer config (the BFS of
# `kvcheck explore` finds the same lengths). The deep ones (11-13 steps) were out of reach of
# BMC over integers; over bit-vectors each takes seconds.
SHORTEST = {"no_revalidation_at_use": 5, "shared_free_list": 5, "eviction_ignores_pins": 6,
            "refcount_double_decrement": 6, "admission_ignored": 6, "graph_pages_migrated": 8,
            "abi_ignored": 9, "window_off_by_one": 10, "tail_junction_not_checked": 11,
            "decision_ignores_indexer_version": 13, "prefetch_counted_as_hit": 13,
            "compressed_version_ignored": 13, "stale_hash_after_evict": 7, "hash_ignores_parent": 16,
            "stale_hash_after_reuse": 11, "hash_missing_salt": 9, "decode_publishes_partial": 6,
            "alloc_evicts_referenced": 6, "copy_ignores_capacity": 10, "restore_under_stale_key": 18,
            "slide_one_window": 7, "late_publish_reused_slot": 13}
# A fault that breaks an auxiliary invariant before its named one: BMC reports that first (a
# stale hash is reachable in 11 steps; the unsafe hit it enables in 15, found by the explorer).
BMC_FIRST = {"stale_hash_after_reuse": "hash_names_content", "decode_publishes_partial": "blocks_whole",
             "restore_under_stale_key": "hash_names_content", "late_publish_reused_slot": "hash_names_content"}


def test_every_spec_fault_has_a_depth():
    assert set(SHORTEST) == {f.name for f in faultlib.spec_faults()}


@pytest.mark.parametrize("fault", list(SHORTEST))
def test_bmc_finds_fault(fault, tmp_path):
    pv = Prover(fault_config(fault), fault)
    checked, path, viol = pv.bmc(SHORTEST[fault])
    assert path is not None, f"BMC found nothing to depth {checked}"
    assert BMC_FIRST.get(fault, faultlib.get(fault).expected) in {inv for inv, _ in viol}
    assert len(path) == SHORTEST[fault]
    assert checked == len(path) - 1           # shortest: every shallower depth was clean


def test_bitvector_reading_is_wide_enough():
    """In BMC's bit-vector reading, the sum of every slot at its largest value (the worst count
    or refcount) is still that number, positive: nothing wraps (a wrap would make BMC miss or
    invent violations). Checked by z3 on the encoding itself."""
    import z3
    from kvcheck.checker.prove import bv_width
    from kvcheck.spec.logic import Z3Logic
    for cfg in (Config(), fault_config(None), fault_config("admission_ignored")):
        pv = Prover(cfg)
        B = Z3Logic(bv_width(pv.lay))
        xs = [B.var(f"x{i}") for i in range(pv.lay.size)]
        his = [h for _, h in pv.lay.domains()]
        total = B.Sum(xs)
        s = z3.Solver()
        s.add(*[x == h for x, h in zip(xs, his)])
        s.add(z3.Not(z3.And(total == B.val(sum(his)), total >= 0, total > xs[0] - 1)))
        assert s.check() == z3.unsat
        # and the narrowest width that would wrap is caught by the same check (it can fail)
        narrow = Z3Logic(max(sum(his), 1).bit_length())
        ys = [narrow.var(f"y{i}") for i in range(pv.lay.size)]
        s2 = z3.Solver()
        s2.add(*[y == h for y, h in zip(ys, his)])
        s2.add(z3.Not(narrow.Sum(ys) >= 0))
        assert s2.check() == z3.sat


def test_cli_prove_fault_exit_12_with_replayable_trace(tmp_path, capsys):
    code = cli.main(["prove", "--fault", "no_revalidation_at_use", "--out", str(tmp_path), "--json"])
    assert code == 12
    rep = json.loads(capsys.readouterr().out)
    assert rep["fault_result"]["caught"]
    v = rep["bmc"]["violation"]
    tr = Trace.load(v["trace"])
    assert tr.engine == "bmc"
    rcode, out = replay_trace(tr)
    assert rcode == 10 and "toctou_bound_stable" in out["violation"]["invariants"]
    assert (tmp_path / "prove.json").exists()
    statuses = {o["name"]: o["status"] for o in rep["invariants"]}
    assert statuses["toctou_bound_stable"] == "violated"


def test_cli_bad_input(tmp_path, capsys):
    assert cli.main(["prove", "--fault", "nope"]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert cli.main(["prove", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 2


@pytest.mark.parametrize("fault", ["hash_ignores_parent", "restore_under_stale_key"])
def test_kvcheck_prove_reaches_the_deepest_faults_at_its_default_depth(fault, tmp_path):
    """`kvcheck prove --fault NAME` searches deep enough for every spec fault's shortest
    counterexample (the content faults need 16 and 18 steps; the clean default stops at 14)."""
    from kvcheck.checker.prove import run_prove
    code, rep = run_prove(fault_config(fault), tmp_path, fault)
    v = rep["bmc"]["violation"]
    assert v is not None and len(v["steps"]) == SHORTEST[fault]
    assert BMC_FIRST.get(fault, faultlib.get(fault).expected) in v["invariants"]
    assert code == 12                     # a Z3 counterexample
