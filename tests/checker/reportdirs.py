"""Report directories for the report tests, made from real engine output kept as fixtures.

fixtures/report/clean: `kvcheck gate --out DIR` (seed 0); fixtures/report/fault: `kvcheck gate
--fault shared_free_list`; fuzz-reference.json: `kvcheck fuzz --sut reference --fault
engine_refcount_double_decrement --budget 20s --json` (its trace is in fault/); mutants.json:
`kvcheck mutants --budget-per-fault 4s --fault shared_free_list engine_refcount_double_decrement
no_revalidation_at_use window_off_by_one engine_tail_check_skipped --json`. The paths recorded in
them point at the /tmp directories they were written to; `copy` points them at a directory
that does not exist, so the report must find each trace next to the report, as it must for a
report directory copied elsewhere (a CI artifact).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

FIX = Path(__file__).parent / "fixtures" / "report"
WRITTEN_IN = ("/tmp/rep-report-fault/", "/tmp/rep-report/", "/tmp/rep-fuzz/")


def moved(text: str, dest: Path, home: bool = False) -> str:
    """The recorded paths pointed at a directory that is gone (or, `home`, at `dest` itself)."""
    for old in WRITTEN_IN:
        text = text.replace(old, f"{dest}/" if home else f"{dest.parent}/moved-away/")
    return text


def copy(name: str, dest: Path, home: bool = False) -> Path:
    shutil.copytree(FIX / name, dest)
    for p in dest.glob("*.json"):
        p.write_text(moved(p.read_text(), dest, home))
    return dest


def with_reference_finding(dest: Path, home: bool = False) -> Path:
    """The clean gate's directory with the reference fuzz campaign that found a planted engine
    bug in place of the clean one (what the gate writes when the reference engine has that bug),
    plus the mutants matrix saved next to it."""
    copy("clean", dest, home)
    shutil.copy(FIX / "fault" / "fuzz-reference-engine_refcount_double_decrement-seed0.json", dest)
    shutil.copy(FIX / "mutants.json", dest)
    rep = json.loads((dest / "report.json").read_text())
    fz = json.loads(moved((FIX / "fuzz-reference.json").read_text(), dest, home))
    rep["engines"]["fuzz_reference"] = {k: fz[k] for k in ("steps", "seconds", "steps_per_s", "coverage",
                                                           "findings", "exit_code")}
    rep["verdict"], rep["exit_code"] = f"failed (fuzz --sut reference: exit {fz['exit_code']})", fz["exit_code"]
    (dest / "report.json").write_text(json.dumps(rep))
    return dest
