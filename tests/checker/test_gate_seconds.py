"""The default profile's per-check records carry the seconds of the reference diff and of the
mutants smoke (the terminal summary printed 0.00 s for both)."""
from __future__ import annotations

from kvcheck.checker.gate_checks import default_checks


def test_diff_and_mutants_smoke_checks_carry_their_seconds():
    rep = {"engines": {
        "diff_reference": {"scenarios": 30, "mismatches": [], "exit_code": 0, "seconds": 1.25},
        "mutants_smoke": {"faults": {"shared_free_list": "killed"}, "negative_control_clean": True, "seconds": 4.0,
                          "matrix": [{"fault": "shared_free_list", "engines": {"walk": {"seconds": 1.0},
                                                                                "explore": {"seconds": 2.0}}}]}}}
    got = {(c["engine"], c["check"]): c["seconds"] for c in default_checks(rep)}
    assert got[("diff", "reuse_equals_recompute")] == 1.25
    assert got[("smoke", "expected_fault:shared_free_list")] == 3.0
    assert got[("smoke", "negative_control")] == 1.0
