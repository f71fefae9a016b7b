"""Generated standalone reproducers on any layout (issue 16, item 5): presets at their real block
sizes, drafters, Mamba groups (fine-grained, copy-on-write), scheduler steps. The script
rebuilds the manager from the adapter's own objects and needs only vLLM. Needs vllm."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from kvcheck.engines.vllm import known as vllm_known  # noqa: E402
from kvcheck.engines.vllm.drivers import _save, execute  # noqa: E402
from kvcheck.engines.vllm.reproducer import reproducer_source, write_reproducer  # noqa: E402
from kvcheck.fuzz.lockstep import Act  # noqa: E402
from kvcheck.spec.trace import Trace  # noqa: E402

TRACES = Path(__file__).resolve().parents[2] / "docs" / "repro" / "traces"


def _shared_prefix(n: int) -> list[Act]:
    toks = list(range(1, n + 1))
    return [Act("submit", {"r": "A", "tokens": toks}), Act("lookup", {"r": "A", "chunk": n}),
            Act("decode", {"r": "A", "tok": 3}), Act("submit", {"r": "B", "tokens": toks[:n - 4] + [7, 7, 7, 7]}),
            Act("lookup", {"r": "B", "chunk": n}), Act("finish", {"r": "B"}), Act("finish", {"r": "A"})]


@pytest.mark.parametrize("layout", ["gemma3+eagle", "llama4"])
def test_scaled_and_drafter_presets_get_a_script(layout, tmp_path, run_script, monkeypatch):
    """A preset at its real block size (16; with an EAGLE drafter group) and a planted fault:
    the script exits 1, and 0 on clean vLLM (--clean)."""
    monkeypatch.setattr(vllm_known, "STRICT", True)
    _, f = execute(layout, 64, "drop_ref_on_free", _shared_prefix(40))
    assert f is not None and f.checks == ["refcount_equals_holders"]
    info = _save(layout, 64, "drop_ref_on_free", 0, f, False, str(tmp_path), "t")
    src = Path(info["reproducer"]).read_text()
    group_kw = next(x for x in src.splitlines() if x.startswith("GROUP_KW = "))
    assert "'block_size': 16" in src and ("is_eagle_group" in group_kw) == layout.endswith("+eagle")
    code, out = run_script(info["reproducer"])
    assert code == 1 and "BUG: block #" in out and "ref_cnt 0" in out, out
    code, out = run_script(info["reproducer"], "--clean")
    assert code == 0 and "OK:" in out, out


def _saved(name: str) -> Trace:
    t = Trace.load(TRACES / name)
    if t.meta.get("vllm_version") != vllm.__version__:
        pytest.skip(f"{name} was recorded on vLLM {t.meta.get('vllm_version')}")
    return t


@pytest.mark.parametrize("name, check, evidence", [
    ("vllm_fine_cow_same_step.json", "state_copy_sound", "bytes are not written yet"),
    ("vllm_priority_preempt_unwritten.json", "read_before_write", "never written by a forward"),
])
def test_real_findings_get_a_script_that_exits_1(name, check, evidence, tmp_path, run_script):
    """Real vLLM defects found by campaigns (a Mamba + drafter preset with fine-grained hits and
    scheduler steps; the PRIORITY preemption): the generated script shows each on vLLM alone."""
    t = _saved(name)
    assert t.violation["check"] == check
    path = tmp_path / name
    path.write_text((TRACES / name).read_text())
    info = write_reproducer(Trace.load(path), str(path))
    code, out = run_script(info["reproducer"])
    assert code == 1 and evidence in out, out
    # negative control: the same script without the finding's last step holds on every step
    src = Path(info["reproducer"]).read_text()
    line = next(x for x in src.splitlines() if x.startswith("STEPS = "))
    steps = eval(line[len("STEPS = "):])                       # noqa: S307 (our own repr)
    ctrl = tmp_path / "ctrl.py"
    ctrl.write_text(src.replace(line, f"STEPS = {steps[:-1]!r}"))
    code, out = run_script(ctrl)
    assert code == 0 and "OK:" in out, out


def test_lost_reuse_script_lists_the_entries_it_checks(tmp_path, run_script, monkeypatch):
    """A lost reuse on a scaled drafter preset: the script lists every entry the usable hit reads,
    finds each in vLLM's map, and exits 1 on the short hit; standalone (no kvcheck on the path)."""
    monkeypatch.setattr(vllm_known, "STRICT", True)
    toks = list(range(1, 91))
    prog = [Act("submit", {"r": "A", "tokens": toks}), Act("lookup", {"r": "A", "chunk": 90}), Act("finish", {"r": "A"}),
            Act("evict_blocks", {"block_ids": [7]}),         # (the block before B's window: the fault needs it)
            Act("submit", {"r": "B", "tokens": toks[:86] + [7, 7, 7, 7]}), Act("lookup", {"r": "B", "chunk": 90})]
    _, f = execute("gemma3+eagle", 64, "swa_overstrict", prog, strict=True)
    assert f is not None and f.checks == ["lost_reuse"], f and f.message
    info = _save("gemma3+eagle", 64, "swa_overstrict", 0, f, True, str(tmp_path), "lr")
    code, out = run_script(info["reproducer"])
    assert code == 1 and "cached as #" in out and "resume reads is in the prefix-cache map" in out, out
    assert run_script(info["reproducer"], "--clean")[0] == 0
    alone = subprocess.run([sys.executable, info["reproducer"]], capture_output=True, text=True, timeout=300,
                           cwd=str(tmp_path), env={"PATH": "/usr/bin:/bin"})
    assert alone.returncode == 1, alone.stderr[-2000:]


def test_a_trace_that_does_not_reproduce_gets_the_replay_command(tmp_path):
    data = json.loads((TRACES / "vllm_priority_preempt_unwritten.json").read_text())
    data["steps"] = data["steps"][:3]
    data["violation"]["step"] = 2          # (a recorded step must lie inside the trace)
    p = tmp_path / "short.json"
    p.write_text(json.dumps(data))
    out = write_reproducer(Trace.load(p), str(p))
    assert out["reproducer"] is None and "kvcheck replay" in out["reproducer_note"]
    assert reproducer_source(Trace.load(p), str(p)) is None
