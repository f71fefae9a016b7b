"""The fault matrix on a subset: detections count only by the expected check; the clean
control reports nothing."""
from __future__ import annotations

from kvcheck.checker.mutants import run_mutants
from kvcheck.spec.config import Config


def test_mutants_subset_scores_and_control_is_clean() -> None:
    res = run_mutants(Config(), budget_s=30, only=["shared_free_list", "refcount_double_decrement"])
    assert res["negative_control_clean"]
    assert res["mutation_score"] == 1.0 and res["exit_code"] == 0
    for row in res["faults"]:
        assert row["status"] == "killed"
        assert "walk" in row["caught_by_expected"] and "fuzz" in row["caught_by_expected"]
        assert row["engines"]["fuzz"]["trace_len"] >= 1


def test_cli_accepts_engine_fault_names(capsys) -> None:
    """Engine faults are registered before names are checked: only the unknown one is refused."""
    from kvcheck.checker.cli import main
    assert main(["mutants", "--fault", "engine_pinned_object_evicted", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown fault 'nope'" in err and "engine_pinned" not in err


def test_mutants_in_worker_processes_keep_the_order_and_verdicts() -> None:
    rows = []
    res = run_mutants(Config(), budget_s=20, only=["refcount_double_decrement", "engine_shared_free_list"],
                      workers=2, on_row=rows.append)
    assert [r["fault"] for r in res["faults"]] == ["refcount_double_decrement", "engine_shared_free_list"]
    assert sorted(r["fault"] for r in rows) == sorted(r["fault"] for r in res["faults"])
    assert res["mutation_score"] == 1.0 and res["negative_control_clean"] and res["exit_code"] == 0
    assert set(res["negative_control"]) == {"spec:walk", "spec:fuzz", "spec:explore", "spec:prove",
                                            "engine:fuzz", "engine:diff"}
