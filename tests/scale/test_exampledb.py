"""The example database of a campaign: a failure is saved as it is found and the next run
replays it before generating (Hypothesis's @seed had silently turned the database off), kept
apart per SUT and fault."""
from __future__ import annotations

from pathlib import Path

from kvcheck.fuzz.campaign import Budget, run_campaign
from kvcheck.fuzz.exampledb import namespace, open_database
from kvcheck.spec.config import Config

FAULT = "refcount_double_decrement"


def test_a_directory_database_is_written_and_replayed_first(tmp_path) -> None:
    db = tmp_path / "db"
    first = run_campaign(Config(), "spec", Budget(seconds=60), 0, FAULT, str(db), tmp_path / "a",
                         shrink_seconds=8)
    assert first["exit_code"] == 10
    space = db / namespace("spec", FAULT).replace(":", "-")
    assert space.is_dir() and any(space.rglob("*")), "nothing was saved"
    again = run_campaign(Config(), "spec", Budget(seconds=60), 99, FAULT, str(db), tmp_path / "b",
                         shrink_seconds=8)
    assert again["exit_code"] == 10
    assert again["steps_to_first_failure"] < first["steps_to_first_failure"]
    # the control: the same second seed without the database needs longer
    fresh = run_campaign(Config(), "spec", Budget(seconds=60), 99, FAULT, None, tmp_path / "c",
                         shrink_seconds=8)
    assert again["steps_to_first_failure"] < fresh["steps_to_first_failure"]


def test_spaces_keep_suts_and_faults_apart(tmp_path) -> None:
    assert namespace("spec", None) == "spec:clean" != namespace("spec", FAULT)
    assert namespace("my.mod:Cls", None) == "my.mod:Cls:clean"
    assert open_database(None) is None
    d = open_database(str(tmp_path), namespace("spec", FAULT))
    d.save(b"k", b"v")
    assert list(open_database(str(tmp_path), namespace("spec", FAULT)).fetch(b"k")) == [b"v"]
    assert list(open_database(str(tmp_path), namespace("spec", None)).fetch(b"k")) == []
    assert Path(tmp_path, "spec-" + FAULT).is_dir()
