"""A known SGLang defect the scheduler drive rediscovers, on the release that has it.

`swa_free_group_stale_mapping` (sgl-project/sglang#36081, 0.5.18; scheduler/known.py): with the
python named in KVCHECK_SGLANG_KNOWN_PYTHON (a 0.5.18 side venv: `PYTHON=.venv/bin/python
scripts/install-sglang.sh 0.5.18 DIR`; `.ci/run` builds one) the committed trace reproduces the
finding on SGLang's own scheduler, the same steps run clean with 0.5.19's rule applied (the
counterfactual that recognises it), and a campaign that meets it fails with the defect named
unless the team acknowledges it. Without the variable the tests skip, saying how to run them.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = os.environ.get("KVCHECK_SGLANG_KNOWN_PYTHON", "")
TRACE = ROOT / "docs/repro/traces/sglang_sched_swa_free_group_stale_mapping.trace.json"
NAME = "swa_free_group_stale_mapping"
pytestmark = pytest.mark.skipif(not PY, reason="set KVCHECK_SGLANG_KNOWN_PYTHON to an SGLang 0.5.18 side-venv "
                                "python (scripts/install-sglang.sh 0.5.18 DIR) to test its known defect")


def _run(code: str) -> dict:
    p = subprocess.run([PY, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_trace_reproduces_and_the_fix_clears_it():
    out = _run(f"""
import json
from kvcheck.engines.sglang import drivers
from kvcheck.engines.sglang.scheduler import known
plain = drivers.replay({str(TRACE)!r})
with known.KNOWN[0].fixed():
    fixed = drivers.replay({str(TRACE)!r})
print(json.dumps({{"plain": plain, "fixed": fixed}}))
""")
    assert out["plain"]["sglang_version"] == "0.5.18"
    assert out["plain"]["reproduced"] and out["plain"]["violation"]["check"] == "kv_read_sound"
    assert "SWA slot 0" in out["plain"]["violation"]["message"]      # the padding slot, read as KV
    assert out["fixed"]["violation"] is None and out["fixed"]["exit_code"] == 0


def test_a_campaign_names_it_and_fails_unless_acknowledged(tmp_path):
    out = _run(f"""
import json
from kvcheck.engines.sglang import drivers
from kvcheck.fuzz.known import Acknowledgement
runs = {{}}
ack = None
for key in ("plain", "ack"):
    r = drivers.run_campaign("gpt-oss@sched", budget_s=None, steps=12000, seed=2, out_dir={str(tmp_path)!r},
                             acknowledged=ack)
    runs[key] = {{k: r[k] for k in ("exit_code", "known", "findings", "coverage")}}
    # the team acknowledges every known defect the campaign met (0.5.18 has two on this layout)
    ack = {{row["name"]: Acknowledgement(row["name"], "pinned to 0.5.18 until the upgrade") for row in r["known"]
           if row["status"] == "finding"}}
print(json.dumps(runs))
""")
    plain, ack = out["plain"], out["ack"]
    assert plain["coverage"].get(f"known:{NAME}", 0) >= 1
    row = next(r for r in plain["known"] if r["name"] == NAME)
    assert row["status"] == "finding" and row["fails"] and plain["exit_code"] == 10
    assert not plain["findings"]            # counted as the defect, not saved as another finding
    assert ack["exit_code"] == 0 and next(r for r in ack["known"] if r["name"] == NAME)["status"] == "acknowledged"
