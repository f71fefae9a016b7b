"""The vLLM adapter on other releases than the one in kvcheck's venv.

Each python named in KVCHECK_VLLM_PYTHONS (os.pathsep-separated; `.ci/run` builds the oldest
supported release with `scripts/install-vllm.sh VERSION DIR`) runs kvcheck against its own vLLM
in a subprocess: every layout that release can express runs clean, a planted fault is caught by
its check, and a layout it cannot express is refused in one line naming the release. Without
the variable the tests skip (saying how to enable them).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHONS = [p for p in os.environ.get("KVCHECK_VLLM_PYTHONS", "").split(os.pathsep) if p]
pytestmark = pytest.mark.skipif(not PYTHONS, reason="set KVCHECK_VLLM_PYTHONS to side-venv pythons "
                                "(scripts/install-vllm.sh VERSION DIR) to test other vLLM releases")


def _kvcheck(py: str, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu")
    return subprocess.run([py, "-m", "kvcheck", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


_BATCH = r"""
import json, sys
from kvcheck.checker.matrix_driver import cli
print(json.dumps([cli(*argv) for argv in json.loads(sys.argv[1])]))
"""


def _batch(py: str, argvs: list[list[str]]) -> list[dict]:
    """`kvcheck ARGV` for each argv, in one process of that release (its command line's own
    parser, exit codes and stderr, as `kvcheck matrix` runs its cells): vLLM imported once."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu")
    r = subprocess.run([py, "-c", _BATCH, json.dumps(argvs)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _layouts(py: str) -> dict:
    r = _kvcheck(py, "fuzz", "--sut", "vllm", "--list-layouts", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("py", PYTHONS)
def test_every_expressible_layout_runs_clean(py, tmp_path):
    info = _layouts(py)
    ok = [k for k in info["layouts"] if k not in info["unsupported"]
          and k != "generated" and not k.endswith(("+eagle", "+mtp"))]   # drafters: test_vllm_presets
    assert "full" in ok and "full+swa" in ok, info
    # the manager drive's actions on every layout (pinned: the default, auto, runs vLLM's own
    # scheduler, whose run on that release is test_the_scheduler_drive_on_that_release's)
    runs = _batch(py, [["fuzz", "--sut", "vllm", "--layout", layout, "--budget", "600", "--json",
                        "--drive", "mixed", "--out", str(tmp_path)] for layout in ok])
    for layout, r in zip(ok, runs):
        assert r["traceback"] is None, (layout, r)
        res = json.loads(r["stdout"])
        assert res["vllm_version"] == info["vllm_version"]
        assert res["exit_code"] == 0 and not res["missing_actions"], (layout, res["findings"], r["stderr"][-500:])


@pytest.mark.parametrize("py", PYTHONS)
def test_planted_faults_are_caught_on_that_release(py, tmp_path):
    for fault, check in (("drop_ref_on_free", "refcount_equals_holders"), ("evict_keeps_hash", "hash_map_sound")):
        r = _kvcheck(py, "fuzz", "--sut", "vllm", "--layout", "full+swa", "--fault", fault,
                     "--budget", "60s", "--json", "--out", str(tmp_path))
        res = json.loads(r.stdout)
        assert r.returncode == 10 and res["caught"], (fault, res)
        f = next(f for f in res["findings"] if f["check"] == check)
        rep = _kvcheck(py, "replay", f["trace"], "--sut", "vllm", "--json")
        assert json.loads(rep.stdout)["reproduced"], rep.stdout


@pytest.mark.parametrize("py", PYTHONS)
def test_what_a_release_lacks_is_one_line_exit_2(py, tmp_path):
    info = _layouts(py)
    lacks = list(info["unsupported"].items())
    runs = _batch(py, [["fuzz", "--sut", "vllm", "--layout", layout, "--budget", "10", "--out", str(tmp_path)]
                       for layout, _ in lacks])
    for (layout, why), r in zip(lacks, runs):
        assert r["code"] == 2 and r["traceback"] is None and "Traceback" not in r["stderr"], (layout, r)
        line = r["stderr"].strip().splitlines()[-1]
        assert info["vllm_version"] in line and why in line, line


@pytest.mark.parametrize("py", PYTHONS)
def test_mamba_groups_on_that_release(py, tmp_path):
    """A release with align mode runs the Mamba preset and catches a planted Mamba fault; one
    without it refuses the preset in one line naming MambaSpec.mamba_cache_mode."""
    info = _layouts(py)
    if "qwen3-next" in info["unsupported"]:
        assert "MambaSpec.mamba_cache_mode" in info["unsupported"]["qwen3-next"]
        return
    r = _kvcheck(py, "fuzz", "--sut", "vllm", "--layout", "qwen3-next", "--fault", "mamba_state_freed_early",
                 "--budget", "60s", "--json", "--out", str(tmp_path))
    res = json.loads(r.stdout)
    assert r.returncode == 10 and res["caught"] and res["findings"][-1]["check"] == "state_copy_sound", res
    rep = _kvcheck(py, "replay", res["findings"][-1]["trace"], "--sut", "vllm", "--json")
    assert json.loads(rep.stdout)["reproduced"], rep.stdout


@pytest.mark.parametrize("py", PYTHONS)
def test_the_scheduler_drive_on_that_release(py, tmp_path):
    """vLLM's own Scheduler of that release drives (docs/adapters-vllm.md, "The scheduler drive"):
    layouts run without a finding kvcheck would be wrong about (lost reuse is the release's, known
    defects are recognised), and a planted fault is caught through it and replays."""
    for layout in ("gemma3+eagle",):             # (full + 5 SWA groups + an EAGLE drafter)
        r = _kvcheck(py, "fuzz", "--sut", "vllm", "--layout", layout, "--drive", "engine", "--budget", "3000",
                     "--json", "--out", str(tmp_path))
        res = json.loads(r.stdout)
        # (exit 10 only for catalogued defects: under async scheduling with the drafter, 0.14-0.26 meet
        # async_stale_rejection_rollback, async_reset_spec_overdiscard, async_swa_free_in_flight)
        assert "cannot_drive" not in res and res["exit_code"] in (0, 10), (layout, res.get("findings"), r.stderr[-500:])
        assert not res["findings"] and (res["exit_code"] == 0) == (not [k for k in res["known"] if k.get("recognised")]), \
            (layout, res["findings"], res["known"])
        assert res["coverage"]["step"] > 0 and not res["missing_actions"]
    r = _kvcheck(py, "fuzz", "--sut", "vllm", "--layout", "full", "--drive", "engine", "--fault", "drop_ref_on_free",
                 "--budget", "3000", "--json", "--out", str(tmp_path / "f"))
    res = json.loads(r.stdout)
    assert r.returncode == 10 and res["caught"], res
    rep = _kvcheck(py, "replay", res["findings"][0]["trace"], "--sut", "vllm", "--json")
    assert json.loads(rep.stdout)["reproduced"], rep.stdout


@pytest.mark.parametrize("py", PYTHONS)
def test_the_async_reset_defect_where_that_release_has_it(py):
    """vllm#42043 (0.14.1-0.21.0; PR #42117's fix from 0.22): the async drive's trace replays there,
    caught where vLLM drops the token, and its message is the known defect's signature."""
    import re

    from kvcheck.engines.vllm.known import KNOWN, _ver
    r = _kvcheck(py, "replay", "docs/repro/traces/vllm_async_reset_drops_token.trace.json", "--sut", "vllm", "--json")
    res = json.loads(r.stdout[r.stdout.index("\n{") + 1:] if not r.stdout.startswith("{") else r.stdout)
    k = next(k for k in KNOWN if k.name == "async_reset_drops_token")
    buggy = _ver(k.first) <= _ver(res["vllm_version"]) <= _ver(k.last)
    assert res["reproduced"] == buggy, (res, r.stderr[-500:])
    if buggy:
        assert re.search(k.message, res["violation"]["message"]), res["violation"]
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    script = subprocess.run([py, k.repro], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert script.returncode == (1 if buggy else 0), script.stdout[-1500:]


_EXPLAIN = r"""
import json, sys
from kvcheck.engines.vllm.known import explain_trace
print(json.dumps(explain_trace(sys.argv[1])))
"""


@pytest.mark.parametrize("py", PYTHONS)
def test_a_scheduler_drive_lost_reuse_is_named_by_its_counterfactual_fix(py):
    """The release matrix's qwen3-next+mtp lost reuse (0.15.1, 8 steps: a 256-token resend hits 128
    of 192): the EAGLE margin capped at the candidate (eagle_margin_capped, fixed by 0.32), recognised
    by rerunning the lookup with the fix on that release (its Mamba manager does not pop the EAGLE
    block: no margin for it); not a finding where vLLM has the fix."""
    from kvcheck.engines.vllm.known import KNOWN, _ver
    if "qwen3-next+mtp" in _layouts(py)["unsupported"]:
        pytest.skip("this release cannot express qwen3-next+mtp")
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu")
    r = subprocess.run([py, "-c", _EXPLAIN, "docs/repro/traces/vllm_eagle_margin_capped_mamba.trace.json"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    k = next(k for k in KNOWN if k.name == "eagle_margin_capped")
    if _ver(got["vllm_version"]) <= _ver(k.last):
        assert got["reproduced"] and got["known"] == k.name, got
    else:
        assert not got["reproduced"], got


@pytest.mark.parametrize("py", PYTHONS)
def test_a_regrown_eagle_hit_is_named_by_the_mamba_margin_fix(py):
    """The 30 s matrix's open 0.20.2 `generated` cell (6 steps: vLLM hit 8, spec-usable 0): the
    Mamba group's EAGLE margin grows the hit back past the candidate an SWA-MLA EAGLE group
    dropped, and that group, marked verified, is not looked up again. Recognised as
    eagle_mamba_hit_mismatch by rerunning the lookup with 0.26.0's fix (no margin for Mamba);
    not a finding where vLLM has the fix."""
    from kvcheck.engines.vllm.known import KNOWN, _ver
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu")
    r = subprocess.run([py, "-c", _EXPLAIN, "docs/repro/traces/vllm_eagle_mamba_hit_regrows.trace.json"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if r.returncode and "cannot express this layout" in r.stderr:
        pytest.skip("this release cannot express the trace's layout")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    k = next(k for k in KNOWN if k.name == "eagle_mamba_hit_mismatch")
    if _ver(k.first) <= _ver(got["vllm_version"]) <= _ver(k.last):
        assert got["reproduced"] and got["known"] == k.name, got
    else:
        assert not got["reproduced"], got


_DRAWN = r"""
import json, random, sys
from kvcheck.engines.vllm.engine_gen import draw_knobs
from kvcheck.engines.vllm.sched_build import build
out = {}
for layout in sys.argv[1:]:
    knobs = [draw_knobs(random.Random(i), layout) for i in range(12)]
    for k in knobs:
        s = build(layout, k).scheduler
        assert s.vllm_config.scheduler_config.async_scheduling is k.async_sched, (layout, k)
    out[layout] = sum(k.async_sched for k in knobs)
print(json.dumps(out))
"""


@pytest.mark.parametrize("py", PYTHONS)
def test_every_drawn_scheduler_configuration_is_one_that_release_accepts(py):
    """Async scheduling is drawn only where the release's own VllmConfig turns it on by default
    (0.16.0: not with Mamba prefix caching, whose explicit request it refuses): every drawn episode
    builds, and its config says what the episode runs."""
    unsupported = _layouts(py)["unsupported"]
    layouts = [x for x in ("full", "full+mamba", "qwen3-next", "full+mamba-fine") if x not in unsupported]
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu")
    r = subprocess.run([py, "-c", _DRAWN, *layouts], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    drawn = json.loads(r.stdout.strip().splitlines()[-1])
    assert drawn["full"] > 0, drawn


@pytest.mark.parametrize("py", PYTHONS)
def test_the_async_fine_tail_defect_where_that_release_has_it(py):
    """async_fine_tail_republish (0.26.0-0.31.0): the scheduler drive's trace replays there under
    its signature, and the standalone script exits 1 there (0 with --sync), 0 on a release without
    it, 2 on one without fine-grained hits."""
    import re

    from kvcheck.engines.vllm.known import KNOWN, _ver
    k = next(k for k in KNOWN if k.name == "async_fine_tail_republish")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    script = subprocess.run([py, k.repro], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if "full+mamba-fine" in _layouts(py)["unsupported"]:
        assert script.returncode in (0, 2), script.stdout[-1500:]
        return
    r = _kvcheck(py, "replay", "docs/repro/traces/vllm_async_fine_tail_republish.trace.json", "--sut", "vllm", "--json")
    res = json.loads(r.stdout[r.stdout.index("\n{") + 1:] if not r.stdout.startswith("{") else r.stdout)
    buggy = _ver(k.first) <= _ver(res["vllm_version"]) <= _ver(k.last)
    assert res["reproduced"] == buggy, (res, r.stderr[-500:])
    if buggy:
        assert re.search(k.message, res["violation"]["message"]), res["violation"]
    assert script.returncode == (1 if buggy else 0), script.stdout[-1500:]
    sync = subprocess.run([py, k.repro, "--sync"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert sync.returncode == 0, sync.stdout[-1500:]


@pytest.mark.parametrize("py", PYTHONS)
def test_the_async_abort_double_finish_where_that_release_has_it(py):
    """async_abort_double_finish (0.14.1-0.15.1, found by the release matrix): an aborted request's
    in-flight frame finishes it a second time; the trace replays there, named by its signature
    (vLLM's assertion, located in the function that raised it), and not from 0.16.0 on."""
    from kvcheck.engines.vllm.known import KNOWN, _ver
    k = next(k for k in KNOWN if k.name == "async_abort_double_finish")
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu")
    r = subprocess.run([py, "-c", _EXPLAIN, "docs/repro/traces/vllm_async_abort_double_finish.trace.json"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    buggy = _ver(k.first) <= _ver(got["vllm_version"]) <= _ver(k.last)
    assert got["reproduced"] == buggy, got
    if buggy:
        assert got["known"] == k.name, got
    script = subprocess.run([py, k.repro], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert script.returncode == (1 if buggy else 0), script.stdout[-1500:]


@pytest.mark.parametrize("py", PYTHONS)
def test_a_forced_reset_with_a_frame_in_flight_raises_where_frees_are_deferred(py):
    """The forced prefix-cache reset kvcheck's async drive refuses (docs/findings-vllm.md): with async
    scheduling and a consumer connector, vLLM 0.24.0+ defers a preempted request's blocks behind its
    in-flight frame, and reset_prefix_cache(reset_running_requests=True) raises although no transfer
    exists; 0.14.1-0.23.0 free at once (no raise); synchronous scheduling never raises."""
    from kvcheck.engines.vllm.known import _ver
    script = "docs/repro/vllm_async_reset_deferred_free_raises.py"
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    run = subprocess.run([py, script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    v = _ver(run.stdout.split("vLLM ", 1)[1].split(":", 1)[0]) if "vLLM " in run.stdout else None
    assert v is not None, run.stdout[-1500:] + run.stderr[-1500:]
    assert run.returncode == (1 if v >= (0, 24, 0) else 0), run.stdout[-1500:]
    sync = subprocess.run([py, script, "--sync"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert sync.returncode == 0, sync.stdout[-1500:]


@pytest.mark.parametrize("py", PYTHONS)
def test_an_in_flight_forward_landing_on_a_reallocated_block_where_frees_are_immediate(py):
    """async_free_under_inflight_write (PR #45357's race, found by the drive once an in-flight forward
    may land after the next frame's connector loads): a request finished at frame N's output has its
    blocks freed while N+1 still writes them, and one reaches a request whose load fills it. The trace
    replays and is named on 0.14.1-0.23.0; releases that defer the free (0.24.0+) never hand the
    block on: not reproduced."""
    from kvcheck.engines.vllm.known import KNOWN, _ver
    k = next(k for k in KNOWN if k.name == "async_free_under_inflight_write")
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu")
    r = subprocess.run([py, "-c", _EXPLAIN, "docs/repro/traces/vllm_async_free_under_inflight_write.trace.json"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    buggy = _ver(got["vllm_version"]) <= _ver(k.last)
    if buggy:
        assert got["reproduced"] and got["known"] == k.name, got
    else:
        assert not got["reproduced"], got
    script = subprocess.run([py, k.repro], capture_output=True, text=True, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"),
                            cwd=ROOT, timeout=600)
    assert script.returncode == (1 if buggy else 0), script.stdout[-1500:] + script.stderr[-1500:]


@pytest.mark.parametrize("py", PYTHONS)
def test_a_block_freed_out_of_window_under_an_in_flight_forward_until_0_26(py):
    """async_swa_free_in_flight (PR #47728's race, found by the 30 s matrix on 0.25.1 `full+swa`): a
    running request's block leaves its sliding window at a schedule that counts the in-flight frame's
    tokens as computed, is freed with that frame still writing it, and a connector load fills it for
    another request. The standalone script exits 1 on 0.14.1-0.25.1 and 0 from 0.26.0 (which frees on
    the processed-token basis); the matrix's trace replays and is named on 0.20.2-0.25.1, not 0.26.0."""
    from kvcheck.engines.vllm.known import KNOWN, _ver
    k = next(k for k in KNOWN if k.name == "async_swa_free_in_flight")
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu")
    script = subprocess.run([py, k.repro], capture_output=True, text=True, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"),
                            cwd=ROOT, timeout=600)
    assert "vLLM " in script.stdout, script.stdout[-1500:] + script.stderr[-1500:]
    v = _ver(script.stdout.split("vLLM ", 1)[1].split(":", 1)[0])
    assert script.returncode == (1 if v <= _ver(k.last) else 0), script.stdout[-1500:]
    r = subprocess.run([py, "-c", _EXPLAIN, "docs/repro/traces/vllm_async_swa_free_in_flight.trace.json"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if r.returncode and "CannotExpress" in r.stderr:
        return                          # (no hybrid layout through a connector on this release)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if v < (0, 20, 0) and not got["reproduced"]:
        return                          # (before 0.20 the trace takes another path: not a claim either way)
    if v <= _ver(k.last):
        assert got["reproduced"] and got["known"] == k.name, got
    else:
        assert not got["reproduced"], got


@pytest.mark.parametrize("trace", ["docs/repro/traces/vllm_fine_swa_partial_assert.trace.json",
                                   "docs/repro/traces/vllm_fine_chunked_partial_assert.trace.json"])
@pytest.mark.parametrize("py", PYTHONS)
def test_fine_grained_hits_with_a_wide_sliding_window_block_crash_until_0_28(py, trace):
    """fine_swa_partial_assert (the 30 s matrix, 0.26.0 and 0.27.1 `generated`, 2 steps): fine-grained
    hits on, a sliding-window (or chunked-local) group wider than the hash block, and vLLM's own finder
    asserts (its engine dies). Named on 0.26.0-0.27.1; 0.28.0 turns fine-grained hits off there: not
    reproduced."""
    from kvcheck.engines.vllm.known import KNOWN, _ver
    k = next(k for k in KNOWN if k.name == "fine_swa_partial_assert")
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu")
    r = subprocess.run([py, "-c", _EXPLAIN, trace], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if r.returncode and ("CannotExpress" in r.stderr or "cannot express this layout" in r.stderr):
        pytest.skip("this release has no fine-grained hits")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if _ver(k.first) <= _ver(got["vllm_version"]) <= _ver(k.last):
        assert got["reproduced"] and got["known"] == k.name, got
    else:
        assert not got["reproduced"], got


def _explain(py: str, trace: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu")
    r = subprocess.run([py, "-c", _EXPLAIN, trace], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-1500:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("py", PYTHONS)
def test_a_forced_reset_with_drafts_in_flight_drops_real_tokens_on_0_22_to_0_26(py):
    """async_reset_spec_overdiscard (found once the async drive ran drafters, 0.26.0 gemma3+eagle): the
    reset's discard counter counts placeholder tokens (1 + drafts) and drains by frames. The script exits
    1 on 0.22.1-0.26.0, 0 elsewhere and 0 with --no-drafts; the campaign's trace is named there, and does
    not reproduce elsewhere."""
    from kvcheck.engines.vllm.known import KNOWN, _ver
    k = next(k for k in KNOWN if k.name == "async_reset_spec_overdiscard")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    script = subprocess.run([py, k.repro], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert "vLLM " in script.stdout, script.stdout[-1500:] + script.stderr[-1500:]
    v = _ver(script.stdout.split("vLLM ", 1)[1].split(":", 1)[0])
    buggy = _ver(k.first) <= v <= _ver(k.last)
    assert script.returncode == (1 if buggy else 0), script.stdout[-1500:]
    assert subprocess.run([py, k.repro, "--no-drafts"], capture_output=True, env=env, cwd=ROOT,
                          timeout=600).returncode == 0
    got = _explain(py, "docs/repro/traces/vllm_async_reset_spec_overdiscard.trace.json")
    assert got["reproduced"] == buggy and (got["known"] == k.name) == buggy, got


@pytest.mark.parametrize("trace", ["docs/repro/traces/vllm_async_swa_free_in_flight_drafts.trace.json",
                                   "docs/repro/traces/vllm_async_chunked_free_in_flight_drafts.trace.json"])
@pytest.mark.parametrize("py", PYTHONS)
def test_a_window_freed_on_in_flight_drafts_is_the_async_swa_race_until_0_26(py, trace):
    """async_swa_free_in_flight's drafter symptom (no connector): the sliding-window (gemma3+eagle) or
    chunked-local (llama4+eagle) block is freed on a count that includes the in-flight frame's drafts,
    and the request's own next token needs it (toctou_bound_stable). Named up to 0.25.1; not reproduced
    from 0.26.0 (PR #47728: the coordinator frees on the processed tokens)."""
    from kvcheck.engines.vllm.known import KNOWN, _ver
    k = next(k for k in KNOWN if k.name == "async_swa_free_in_flight")
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu")
    r = subprocess.run([py, "-c", _EXPLAIN, trace], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if r.returncode and "cannot express this layout" in r.stderr:
        pytest.skip("this release cannot build the layout")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if _ver(got["vllm_version"]) <= _ver(k.last):
        assert got["reproduced"] and got["known"] == k.name, got
    else:
        assert not got["reproduced"], got


@pytest.mark.parametrize("py", PYTHONS)
def test_a_stale_frames_rejected_drafts_rewind_the_resumed_request_until_0_25(py):
    """async_stale_rejection_rollback (PR #46066): a frame with drafts in flight at a forced reset returns
    after its request was rescheduled; 0.14-0.24 take its rejected drafts back from the resumed count.
    The script exits 1 on 0.14.1-0.24.0, 0 from 0.25; the campaign's trace is named there only."""
    from kvcheck.engines.vllm.known import KNOWN, _ver
    k = next(k for k in KNOWN if k.name == "async_stale_rejection_rollback")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    script = subprocess.run([py, k.repro], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert "vLLM " in script.stdout, script.stdout[-1500:] + script.stderr[-1500:]
    v = _ver(script.stdout.split("vLLM ", 1)[1].split(":", 1)[0])
    buggy = v <= _ver(k.last)
    assert script.returncode == (1 if buggy else 0), script.stdout[-1500:]
    got = _explain(py, "docs/repro/traces/vllm_async_stale_rejection_rollback.trace.json")
    assert got["reproduced"] == buggy and (got["known"] == k.name) == buggy, got
