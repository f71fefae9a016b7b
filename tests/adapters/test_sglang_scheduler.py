"""The scheduler drive (layouts NAME@sched): SGLang's own Scheduler, Req and batches on CPU.

Runs under a Python with SGLang 0.5.15+ (`.ci/run` runs it with the newest release's side venv;
elsewhere it skips, saying why). What it shows: the objects stepped are SGLang's own (its
`Scheduler` subclass adds no scheduling code, requests are SGLang's `Req`, batches its
`ScheduleBatch`); admission, chunking and retraction happen (SGLang decides them); each check of
the worker model fails on a planted defect of the forward (not only of the cache); a release that
reads something kvcheck's CPU scheduler lacks, or a Triton kernel launched on CPU, is "cannot
drive", never a finding; bad parameters are refused with one line.
"""
from __future__ import annotations

import json

import pytest

from test_sglang import _sglang  # noqa: F401  (tests/adapters is on sys.path)


def _drive():
    _sglang()
    from kvcheck.engines.sglang.scheduler.build import gap
    why = gap()
    if why:
        pytest.skip(why)
    from kvcheck.engines.sglang import drivers as sg
    return sg


def _episode(sg, program):
    from kvcheck.fuzz.lockstep import FreeModel, Lockstep
    from kvcheck.fuzz.models import Act
    ad = sg.make_adapter(sg.LAYOUTS["dense@sched"])
    try:
        f = Lockstep(FreeModel(), ad).run([Act(a, p) for a, p in program])
        return ad, f
    finally:
        ad.close()


START = {"config": {"schedule_policy": "lpm", "chunked_prefill_size": 4, "max_running_requests": 2,
                    "enable_priority_scheduling": False, "max_prefill_tokens": 64, "capacity": 32,
                    "context_length": 96}}


def test_the_objects_stepped_are_sglangs_own():
    sg = _drive()
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from kvcheck.engines.sglang.scheduler.build import scheduler_class
    cls = scheduler_class()
    assert issubclass(cls, Scheduler)
    own = {k for k, v in vars(cls).items() if callable(v) and not k.startswith("__")}
    assert own == {"_record_step_counters", "maybe_send_health_check_signal"}, own   # the documented two
    seen = []
    from kvcheck.fuzz.lockstep import FreeModel, Lockstep
    from kvcheck.fuzz.models import Act
    ad = sg.make_adapter(sg.LAYOUTS["dense@sched"])
    core = Lockstep(FreeModel(), ad)
    try:
        core.step(Act("start", START))
        core.step(Act("submit", {"r": "a", "tokens": [3, 4, 5, 6, 7, 8, 9, 10, 11], "max_new": 3}))
        seen.append(type(ad.reqs["a"]))
        core.step(Act("step", {"toks": [5]}))        # chunked prefill: 4 of 9 tokens
        s = ad.built.sched
        assert s.chunked_req is ad.reqs["a"] and isinstance(s.last_batch, ScheduleBatch)
        core.step(Act("submit", {"r": "b", "tokens": [3, 4, 5, 6, 12], "max_new": 2}))
        core.step(Act("step", {"toks": [5], "times": 12}))
        assert ad.coverage["forward:extend_after_hit"] >= 1          # b reused a's published chunk
        assert ad.coverage["finished"] == 2 and not ad.reqs
    finally:
        ad.close()
    assert seen == [Req]


def test_a_forward_reading_a_wrong_slot_is_caught(monkeypatch):
    """A worker-table defect: the row a request reads is rewritten wrongly between scheduling and
    the forward (as a wrong req_to_token write would do): the worker's read check fires."""
    sg = _drive()
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    real = ScheduleBatch.prepare_for_extend

    def prepare(self):
        real(self)
        for i, r in enumerate(self.reqs):
            if int(self.prefix_lens[i]) > 0:            # a hit: point its first position elsewhere
                row = self.req_pool_indices[i]
                self.req_to_token_pool.req_to_token[row, 0] = self.out_cache_loc[0]
    monkeypatch.setattr(ScheduleBatch, "prepare_for_extend", prepare)
    _, f = _episode(sg, [("start", START), ("submit", {"r": "a", "tokens": [3, 4, 5, 6, 7, 8], "max_new": 1}),
                         ("step", {"toks": [5], "times": 4}),
                         ("submit", {"r": "b", "tokens": [3, 4, 5, 6, 7, 8, 9], "max_new": 1}),
                         ("step", {"toks": [5], "times": 4})])
    assert f is not None and f.checks == ["hit_sound_full"], f


def test_a_hit_whose_window_reads_another_swa_slot_is_caught(monkeypatch):
    """On a hybrid sliding-window model, the SWA slot behind the hit's last position is remapped
    to another one before the forward (a window the hit does not really have): the worker's
    window read fires, and on the SWA check, not the full one. (On SWARadixCache, 0.5.15, a
    node's SWA slots are what its full slots map to: the remap breaks the tree's own content
    first, and the tree check, run as the forward starts, names that.)"""
    sg = _drive()
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    real = ScheduleBatch.prepare_for_extend

    def prepare(self):
        real(self)
        m = self.token_to_kv_pool_allocator.full_to_swa_index_mapping
        for i, r in enumerate(self.reqs):
            pre = int(self.prefix_lens[i])
            if pre > 0:
                slot = int(self.req_to_token_pool.req_to_token[self.req_pool_indices[i], pre - 1])
                m[slot] = int(m[int(self.out_cache_loc[0])])       # the new token's SWA slot
    monkeypatch.setattr(ScheduleBatch, "prepare_for_extend", prepare)
    from kvcheck.fuzz.lockstep import FreeModel, Lockstep
    from kvcheck.fuzz.models import Act
    ad = sg.make_adapter(sg.LAYOUTS["hybrid-swa@sched"])
    try:
        f = Lockstep(FreeModel(), ad).run([Act(a, p) for a, p in [
            ("start", START), ("submit", {"r": "a", "tokens": [3, 4, 5, 6, 7, 8], "max_new": 1}),
            ("step", {"toks": [5], "times": 4}), ("submit", {"r": "b", "tokens": [3, 4, 5, 6, 7, 8, 9], "max_new": 1}),
            ("step", {"toks": [5], "times": 4})]])
        swa_tree = ad.tree.swa_tree
    finally:
        ad.close()
    want = "tree_content_matches" if swa_tree else "hit_sound_swa_window"
    assert f is not None and f.checks == [want], f


def test_a_write_into_a_cached_slot_is_caught(monkeypatch):
    sg = _drive()
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    real = ScheduleBatch.prepare_for_extend

    def prepare(self):
        real(self)
        from kvcheck.engines.sglang.scheduler.tree import Tree
        views = [v for v in Tree(self.tree_cache).views() if v.full]
        if views:                                    # the forward writes into a slot the tree holds
            self.out_cache_loc[0] = views[0].full[0]
    monkeypatch.setattr(ScheduleBatch, "prepare_for_extend", prepare)
    _, f = _episode(sg, [("start", START), ("submit", {"r": "a", "tokens": [3, 4, 5, 6], "max_new": 1}),
                         ("step", {"toks": [5], "times": 4}),
                         ("submit", {"r": "b", "tokens": [9, 9, 9], "max_new": 1}),
                         ("step", {"toks": [5], "times": 4})])
    assert f is not None and f.checks == ["no_write_into_cached"], f


def test_pool_pressure_retracts_through_sglang():
    """A pool too small for two decoding requests: SGLang's own retract_decode runs, and the
    drive stays clean."""
    sg = _drive()
    cfg = dict(START["config"], capacity=24, chunked_prefill_size=-1)
    ad, f = _episode(sg, [("start", {"config": cfg}),
                          ("submit", {"r": "a", "tokens": [3, 4, 5, 6, 7, 8, 9, 10], "max_new": 12}),
                          ("submit", {"r": "b", "tokens": [11, 12, 13, 14, 15, 3, 4, 5], "max_new": 12}),
                          ("step", {"toks": [6], "times": 40})])
    assert f is None, f
    assert ad.coverage["finished"] == 2


def test_what_kvchecks_scheduler_lacks_is_cannot_drive_not_a_finding(tmp_path, monkeypatch):
    sg = _drive()
    from kvcheck.engines.sglang.scheduler import build
    real = build.scheduler_class

    def lacking():
        cls = real()

        class Lacking(cls):        # a release reading an attribute kvcheck does not set
            def get_next_batch_to_run(self, *a, **k):
                return self.some_field_a_new_release_reads
        return Lacking
    monkeypatch.setattr(build, "scheduler_class", lacking)
    r = sg.run_campaign("dense@sched", steps=200, seed=1, out_dir=str(tmp_path))
    assert r["findings"] == [] and r["exit_code"] == 3, (r["steps"], r["coverage"], r.get("cannot_drive"))
    assert "some_field_a_new_release_reads" in r["cannot_drive"]["line"], r["cannot_drive"]


def test_a_triton_kernel_on_cpu_is_cannot_drive(tmp_path, monkeypatch):
    sg = _drive()
    if _kernel is None:
        pytest.skip("no triton here")
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    real = ScheduleBatch.prepare_for_extend

    def prepare(self):
        real(self)
        _kernel[(1,)](self.out_cache_loc)           # a GPU kernel on CPU tensors (no driver here)
    monkeypatch.setattr(ScheduleBatch, "prepare_for_extend", prepare)
    r = sg.run_campaign("dense@sched", steps=200, seed=1, out_dir=str(tmp_path))
    assert r["findings"] == [] and r["exit_code"] == 3, (r["steps"], r["coverage"], r.get("cannot_drive"))


def _kernel_body(x):
    pass


def _triton_kernel():
    """A compiled-mode kernel (the interpreter the tests set for kvcheck's own kernels would run it):
    launching it needs a GPU driver."""
    from triton.runtime.jit import JITFunction
    return JITFunction(_kernel_body)


try:
    _kernel = _triton_kernel()
except Exception:           # no triton: the test below skips
    _kernel = None


@pytest.mark.parametrize("bad", [{"config": {"capacity": "x"}}, {"config": {"nope": 1}}, {"config": 3}])
def test_a_bad_start_is_refused_with_one_line(bad):
    sg = _drive()
    from kvcheck.spec.sut import ActionRejected
    ad = sg.make_adapter(sg.LAYOUTS["dense@sched"])
    try:
        with pytest.raises(ActionRejected) as e:
            ad.apply("start", bad)
        assert "\n" not in str(e.value)
    finally:
        ad.close()


@pytest.mark.parametrize("ratio, refused", [(0.05, "cannot hold one request"), (1.5, "must be in [0, 1]"),
                                             (0.25, None)])
def test_an_swa_pool_the_server_refuses_is_refused_at_start(ratio, refused):
    """An operator's --swa-full-tokens-ratio: the server accepts any SWA pool above a window and a
    page (below one prefill chunk included: 0.25 of 512 is 128 slots, chunk 256), refuses the rest."""
    sg = _drive()
    from kvcheck.spec.sut import ActionRejected
    ad = sg.make_adapter(sg.LAYOUTS["hybrid-swa@sched"])
    cfg = dict(START["config"], capacity=512, context_length=1024, chunked_prefill_size=256,
               swa_full_tokens_ratio=ratio)
    try:
        if refused:
            with pytest.raises(ActionRejected, match=refused.replace("[", r"\[").replace("]", r"\]")):
                ad.apply("start", {"config": cfg})
        else:
            ad.apply("start", {"config": cfg})
            assert ad.built.alloc.swa_attn_allocator.size == 128
    finally:
        ad.close()


@pytest.mark.parametrize("bad", [{"max_new": "x"}, {"max_new": -1}, {"priority": "high"}, {"max_new": True}])
def test_a_bad_submit_is_refused_not_a_finding(bad):
    """A trace's bad submit parameters are the trace's fault (ActionRejected), never an error
    inside SGLang reported as its finding."""
    sg = _drive()
    from kvcheck.spec.sut import ActionRejected
    ad = sg.make_adapter(sg.LAYOUTS["dense@sched"])
    try:
        ad.apply("start", START)
        with pytest.raises(ActionRejected):
            ad.apply("submit", {"r": "r1", "tokens": [3, 4, 5], "max_new": 2, **bad})
        assert ad.broken is None
    finally:
        ad.close()


@pytest.mark.parametrize("action, bad", [
    ("step", {"toks": "abc"}), ("step", {"toks": [1], "times": "2"}), ("step", {"toks": [1], "nope": 1}),
    ("abort", {"r": ["r1"]}), ("abort", {}), ("submit", {"r": 7, "tokens": [3], "max_new": 1}),
    ("submit", {"r": "r2", "tokens": 5, "max_new": 1}), ("submit", {"r": "r2", "tokens": [3, "x"], "max_new": 1})])
def test_bad_parameters_of_any_action_are_refused_before_it_runs(action, bad):
    """Every action's parameter names and types are checked before it runs (a trace is user input),
    so nothing raised inside an action is a bad parameter passed off as a finding or a gap."""
    sg = _drive()
    from kvcheck.spec.sut import ActionRejected
    ad = sg.make_adapter(sg.LAYOUTS["dense@sched"])
    try:
        ad.apply("start", START)
        ad.apply("submit", {"r": "r1", "tokens": [3, 4, 5], "max_new": 2})
        with pytest.raises(ActionRejected, match=f"bad parameters for {action}|bad submit"):
            ad.apply(action, bad)
        assert ad.broken is None
    finally:
        ad.close()


def test_a_type_error_in_kvchecks_own_worker_is_cannot_drive(monkeypatch):
    """kvcheck's model worker stands where SGLang's runs; an exception raised in its frames during
    a step is kvcheck's side of the boundary ("cannot drive"), never a finding and never a "bad
    parameter" of the trace (it once was, for TypeError, KeyError and ValueError)."""
    sg = _drive()
    from kvcheck.fuzz.boundary import CannotDrive
    ad = sg.make_adapter(sg.LAYOUTS["dense@sched"])
    try:
        ad.apply("start", START)
        ad.apply("submit", {"r": "r1", "tokens": [3, 4, 5], "max_new": 2})

        def broken(*a, **k):
            raise TypeError("kvcheck's worker got an argument it does not take")
        monkeypatch.setattr(type(ad.worker), "_run", broken)
        with pytest.raises(CannotDrive) as e:
            ad.apply("step", {"toks": [1, 2, 3, 4]})
        assert "kvcheck" in str(e.value) and ad.broken is None
    finally:
        ad.close()


def test_a_request_the_release_refuses_to_build_is_cannot_drive(monkeypatch):
    """kvcheck builds the request the tokenizer manager would hand over; where the release's
    request type refuses it, that is kvcheck's side of the boundary (0.5.7 had no token_type_ids:
    its submits were once silently rejected as bad parameters)."""
    sg = _drive()
    import sglang.srt.managers.io_struct as io
    from kvcheck.fuzz.boundary import CannotDrive
    ad = sg.make_adapter(sg.LAYOUTS["dense@sched"])
    try:
        ad.apply("start", START)

        def refusing(*a, **k):
            raise TypeError("__init__() got an unexpected keyword argument 'rid'")
        monkeypatch.setattr(io, "TokenizedGenerateReqInput", type("T", (), {"__init__": refusing}))
        with pytest.raises(CannotDrive) as e:
            ad.apply("submit", {"r": "r1", "tokens": [3, 4, 5], "max_new": 2})
        assert "TokenizedGenerateReqInput refused" in str(e.value)
    finally:
        ad.close()


def test_the_cli_runs_it_and_prints_json(tmp_path, capsys):
    _drive()
    from kvcheck.checker.cli import main
    code = main(["fuzz", "--sut", "sglang", "--layout", "dense@sched", "--budget", "300", "--seed", "2",
                 "--json", "--out", str(tmp_path)])
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["exit_code"] == 0 and res["layout"] == "dense@sched", res
    assert res["missing_actions"] == [] and res["lookups_with_hit"] > 0


@pytest.mark.parametrize("fault", ["lock_ref_leak", "evict_locked", "evict_no_free", "insert_shifted_values"])
def test_planted_faults_are_caught_under_the_overlap_scheduler(tmp_path, monkeypatch, fault):
    """Every episode under SGLang's overlap scheduler (a batch launched before the previous
    result is processed): each planted fault still caught by its expected check."""
    sg = _drive()
    from kvcheck.engines.sglang.scheduler import generator
    monkeypatch.setattr(generator, "OVERLAP_SHARE", 1.0)
    r = sg.run_campaign("dense@sched", budget_s=30, steps=20_000, seed=1, fault=fault, out_dir=str(tmp_path),
                        shrink_s=5)
    assert r["coverage"].get("config:overlap") and not r["coverage"].get("config:no_overlap"), r["coverage"]
    assert r["caught"] and r["findings"][0]["check"] == sg.FAULTS[fault].expected, r["findings"]


def test_the_overlap_scheduler_runs_clean(tmp_path, monkeypatch):
    """Clean but for the release's own known defects (acknowledged here: 0.5.18's
    swa_free_group_stale_mapping is recognised on hybrid-swa@sched; anything else fails)."""
    sg = _drive()
    from kvcheck.engines.sglang.install import sglang_version
    from kvcheck.engines.sglang.scheduler import generator
    from kvcheck.engines.sglang.scheduler.known import DEFECTS
    from kvcheck.fuzz.known import Acknowledgement
    monkeypatch.setattr(generator, "OVERLAP_SHARE", 1.0)
    ack = {n: Acknowledgement(n, "this release's known defect") for n, d in DEFECTS.items()
           if d.in_release(sglang_version())}
    for lay in ("dense@sched", "hybrid-swa@sched"):
        r = sg.run_campaign(lay, steps=2000, seed=3, out_dir=str(tmp_path), acknowledged=ack)
        assert r["exit_code"] == 0 and r["findings"] == [], (lay, r["findings"], r.get("known"))
        assert r["coverage"].get("forward:extend_after_hit") and r["coverage"].get("state:evicted"), r["coverage"]


def test_the_tree_view_reads_each_nodes_swa_component():
    """A FULL+SWA node keeps its own SWA slots (`component_data`, a list indexed by component on
    every release); the view once read none of them, which left the SWA half of
    tree_content_matches blind. After a request longer than the window finishes, the nodes inside
    its window hold SWA slots, each the one its full slot maps to."""
    sg = _drive()
    from kvcheck.fuzz.lockstep import FreeModel, Lockstep
    from kvcheck.fuzz.models import Act
    ad = sg.make_adapter(sg.LAYOUTS["hybrid-swa@sched"])
    try:
        core = Lockstep(FreeModel(), ad)
        cfg = dict(START["config"], capacity=256, chunked_prefill_size=-1, context_length=192)
        core.step(Act("start", {"config": cfg}))
        core.step(Act("submit", {"r": "a", "tokens": [3 + i % 11 for i in range(40)], "max_new": 2}))
        core.step(Act("step", {"toks": [5], "times": 4}))
        assert not ad.reqs
        views = ad.tree.views()
        swa = [(v.full, v.swa) for v in views if v.swa]
        assert swa, [(len(v.key), v.full, v.swa) for v in views]
        ml = ad.built.alloc.full_to_swa_index_mapping.tolist()
        for full, own in swa:
            assert [ml[x] for x in full[-len(own):]] == own
    finally:
        ad.close()


def test_a_known_defect_is_recognised_only_by_its_fix_and_only_in_its_range(monkeypatch):
    """scheduler/known.py: a finding is the defect only when the same steps with the fix applied
    run clean, on a release in its range, on a layout it reaches, with no planted fault."""
    _drive()
    import contextlib
    from kvcheck.engines.sglang.layouts import LAYOUTS
    from kvcheck.engines.sglang.scheduler import known
    from kvcheck.fuzz.known import KnownDefect
    calls = []
    fake = known.SchedKnown(KnownDefect("d", "kv_read_sound", "safety", "0.5.18", "0.5.18", "x"),
                            ("kv_read_sound",), ("full", "swa"), lambda: contextlib.nullcontext(calls.append("fixed")))
    monkeypatch.setattr(known, "KNOWN", (fake,))
    swa, dense = LAYOUTS["hybrid-swa@sched"], LAYOUTS["dense@sched"]
    assert known.recognise(swa, None, "0.5.18", "kv_read_sound", lambda: None) == "d"
    assert calls == ["fixed"]
    assert known.recognise(swa, None, "0.5.18", "kv_read_sound", lambda: "still fails") is None   # another cause
    assert known.recognise(swa, None, "0.5.19", "kv_read_sound", lambda: None) is None      # fixed release
    assert known.recognise(dense, None, "0.5.18", "kv_read_sound", lambda: None) is None    # layout it cannot reach
    assert known.recognise(swa, "evict_locked", "0.5.18", "kv_read_sound", lambda: None) is None  # planted
    assert known.recognise(swa, None, "0.5.18", "lock_ref_equals_holders", lambda: None) is None
    monkeypatch.setattr(known, "STRICT", True)
    assert known.recognise(swa, None, "0.5.18", "kv_read_sound", lambda: None) is None
    assert len(calls) == 2


def test_sglangs_triton_allocator_kernel_runs_in_the_interpreter_as_its_torch_path():
    """Before 0.5.22 the paged allocator extends a request only through `alloc_extend_kernel`,
    which the drive runs in Triton's CPU interpreter; on random mixed batches (new requests,
    hits ending mid-page, several pages) it places every token where SGLang's own torch path
    `alloc_extend_naive` places it."""
    _drive()
    import importlib
    import random
    import torch
    try:
        paged = importlib.import_module("sglang.srt.mem_cache.allocator.paged")
    except ImportError:         # 0.5.7-0.5.13: one allocator module
        paged = importlib.import_module("sglang.srt.mem_cache.allocator")
    kernel = getattr(paged, "alloc_extend_kernel", None)
    naive = getattr(paged, "alloc_extend_naive", None)
    if kernel is None or naive is None:
        pytest.skip("this release lacks the kernel or its torch path")
    from sglang.srt.utils import next_power_of_2
    rng = random.Random(7)
    for _ in range(40):
        page, bs = rng.choice([1, 4, 16, 64]), rng.randint(1, 6)
        pre = [rng.randint(0, 5 * page) for _ in range(bs)]
        seq = [p + rng.randint(1, 4 * page) for p in pre]
        used = iter(range(1, 1000))
        last = [(next(used) * page + (p - 1) % page) if p else -1 for p in pre]   # a hit's last slot
        free = torch.tensor(rng.sample(range(1000, 2000), 64), dtype=torch.int64)
        args = [torch.tensor(x, dtype=torch.int64) for x in (pre, seq, last)]
        n = sum(s - p for p, s in zip(pre, seq))
        got, want = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
        kernel[(bs,)](*args, free, got, next_power_of_2(bs), page)
        naive(*args, free, want, page, "cpu")
        assert torch.equal(got, want), (page, pre, seq)


def test_a_sample_sglang_discarded_at_a_retraction_is_not_read_back():
    """Under the overlap scheduler a request retracted while its last forward's result is still
    unprocessed loses that sample; the worker must not use it for the request's next forward (it
    did once: a false tree_content_matches on 0.5.15). The recorded steps replay without a finding."""
    sg = _drive()
    from pathlib import Path
    trace = Path(__file__).resolve().parents[2] / "docs/repro/traces/sglang_sched_retract_under_overlap.trace.json"
    res = sg.replay(str(trace))
    assert res["violation"] is None and res["exit_code"] == 0, res


def test_a_decode_over_a_truncated_prefill_is_caught():
    """`context_complete` on SGLang's own behaviour: with an SWA pool below one prefill chunk
    (256 slots, chunk 512: an operator's `--swa-full-tokens-ratio 0.5` on this pool, which the
    server accepts; docs/findings-sglang.md), 0.5.17+
    admit two long prompts into one extend, truncating the first (236 of 402 tokens) without making
    it the chunked request; it then decodes over 237 positions of a 403-token sequence. 0.5.15 and
    0.5.16 admit the same steps differently and run them clean (a differential, not a rule)."""
    sg = _drive()
    from pathlib import Path
    from kvcheck.engines.sglang.install import sglang_version
    from kvcheck.fuzz.known import KnownDefect
    trace = Path(__file__).resolve().parents[2] / "docs/repro/traces/sglang_sched_swa_pool_below_chunk.trace.json"
    res = sg.replay(str(trace))
    if KnownDefect("", "", "", "0.5.17", "9.9.9", "").in_release(sglang_version()):
        assert res["violation"]["check"] == "context_complete" and res["reproduced"], res
        assert "r9 decodes over 237 positions but its sequence has 403 tokens" in res["violation"]["message"]
    else:
        assert res["violation"] is None, res


def test_the_locked_full_kv_freed_by_swa_recovery_is_29352_on_its_releases_only():
    """docs/repro/traces/sglang_sched_swa_recover_frees_locked_full.trace.json, found by the drive
    on 0.5.7's own scheduler (10 steps, overlap, priority): SWARadixCache's insert recovers the
    tombstoned one-token node two running requests lock by freeing its full slot 1, which both
    requests' rows still hold (sgl-project/sglang#29352). On 0.5.7-0.5.14 the replay finds it
    (`size_accounting`, slot 1 both free and held) and the drive recognises it by its mechanism
    (watched on the way); from 0.5.15, whose insert keeps a locked node's full KV, it runs clean."""
    sg = _drive()
    from pathlib import Path
    from kvcheck.engines.sglang.install import sglang_version
    from kvcheck.engines.sglang.scheduler import known
    from kvcheck.fuzz.known import KnownDefect
    trace = Path(__file__).resolve().parents[2] / "docs/repro/traces/sglang_sched_swa_recover_frees_locked_full.trace.json"
    res = sg.replay(str(trace))
    if not KnownDefect("", "", "", "0.4.10", "0.5.14", "").in_release(sglang_version()):
        assert res["violation"] is None, res
        return
    assert res["violation"]["check"] == "size_accounting", res
    # slot 1 counted twice, free and held (98 + 409 + 6 on 0.5.7-0.5.10; 101 + 201 + 211 from 0.5.11,
    # whose admission runs the same steps in another order)
    import re
    counts = re.match(r"pool: (\d+) free \+ (\d+) in the tree \+ (\d+) held by live requests != 512 slots",
                      res["violation"]["message"])
    assert counts and sum(map(int, counts.groups())) == 513, res
    k = next(k for k in known.KNOWN if k.defect.name == "swa_recover_frees_locked_full")
    with k.fixed() as seen:
        sg.replay(str(trace))
    assert seen == [[1]], seen          # the insert freed slot 1, locked by r4 and r5


def _run_script(path, *args):
    """The reproducer as a maintainer runs it: isolated (-I: no kvcheck on the path, no
    PYTHONPATH, not the script's folder), from another directory, with only this SGLang."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-I", str(path), *args], capture_output=True, text=True, timeout=600,
                       cwd=str(path.parent.parent))
    return p.returncode, p.stdout + p.stderr


def test_a_finding_gets_a_standalone_reproducer_that_needs_only_sglang(tmp_path):
    """A scheduler-drive finding writes `<trace>.repro.py` (scheduler/repro.py, one template for
    every layout and fault): it replays the steps through SGLang's own Scheduler with kvcheck's
    drive frozen into the script, exit 1 with the fault planted, 0 with --clean."""
    sg = _drive()
    from pathlib import Path
    r = sg.run_campaign("dense@sched", budget_s=30, steps=20_000, seed=1, fault="evict_no_free",
                        out_dir=str(tmp_path / "out"), shrink_s=5)
    f = r["findings"][0]
    assert f["reproducer"] and f["reproducer_run"].startswith("python "), f
    script = Path(f["reproducer"])
    code, out = _run_script(script)
    assert code == 1 and f"FOUND {f['check']}" in out and "(the recorded finding)" in out, out[-3000:]
    code, out = _run_script(script, "--clean")
    assert code == 0 and "not reproduced" in out, out[-3000:]


def test_the_standalone_reproducers_of_known_defects_answer_by_release(tmp_path, capsys):
    """The scripts of the shipped traces, run on this release: exit 1 exactly where the defect
    lives (#29352 through 0.5.14, swa_cut_request_replaced from 0.5.17), 0 elsewhere: the same
    answers as `kvcheck replay` (test_a_decode_over_a_truncated_prefill_is_caught,
    test_the_locked_full_kv_freed_by_swa_recovery_is_29352_on_its_releases_only); written by
    `kvcheck replay TRACE --reproducer DIR`."""
    _drive()
    from pathlib import Path
    from kvcheck.checker.cli import main
    from kvcheck.engines.sglang.install import sglang_version
    from kvcheck.fuzz.known import KnownDefect
    docs = Path(__file__).resolve().parents[2] / "docs/repro/traces"
    for name, first, last, check in (("sglang_sched_swa_recover_frees_locked_full", "0.4.10", "0.5.14", "size_accounting"),
                                     ("sglang_sched_swa_pool_below_chunk", "0.5.17", "9.9.9", "context_complete")):
        code, res = main(["replay", str(docs / f"{name}.trace.json"), "--sut", "sglang", "--reproducer",
                          str(tmp_path / "t"), "--json"]), json.loads(capsys.readouterr().out)
        assert res["reproducer"] == str(tmp_path / "t" / f"{name}.trace.repro.py"), res
        code, out = _run_script(Path(res["reproducer"]))
        assert (code == 1) == res["reproduced"], (name, res, out[-3000:])      # the script answers as the replay
        if KnownDefect("", "", "", first, last, "").in_release(sglang_version()):
            assert code == 1 and f"FOUND {check}" in out, (name, out[-3000:])
        else:
            assert code == 0 and "not reproduced" in out, (name, out[-3000:])


def test_the_radix_cache_disabled_runs_clean_and_its_faults_are_caught(tmp_path):
    """`nocache@sched`: a server with --disable-radix-cache (a ChunkCache up to 0.5.21, a disabled
    UnifiedRadixCache from 0.5.22) under SGLang's own Scheduler: clean, no prefix but a request's
    own chunks (`disabled_cache_no_hit`); where the cache is a ChunkCache its planted faults are
    caught by their expected checks, and where it is not they are refused in one line."""
    sg = _drive()
    from kvcheck.engines.sglang.install import load
    from kvcheck.engines.sglang.layouts import LayoutError
    lay = sg.LAYOUTS["nocache@sched"]
    r = sg.run_campaign(lay.name, steps=1500, seed=2, out_dir=str(tmp_path / "clean"))
    assert r["exit_code"] == 0 and r["findings"] == [], r["findings"]
    assert r["coverage"].get("finished") and r["coverage"].get("config:chunked"), r["coverage"]
    for fault in ("chunk_reports_hit", "chunk_finish_leaks"):
        if not isinstance(load()["classes"].get("ChunkCache"), type):
            with pytest.raises(LayoutError, match="plants nothing there"):
                sg.make_adapter(lay, fault)
            continue
        r = sg.run_campaign(lay.name, budget_s=30, steps=20_000, seed=1, fault=fault, out_dir=str(tmp_path / fault),
                            shrink_s=5)
        assert r["caught"] and r["findings"][0]["check"] == sg.FAULTS[fault].expected, (fault, r["findings"])


def test_a_chunk_the_swa_budget_defers_is_cached_uncomputed_on_0_5_11_only():
    """docs/repro/traces/sglang_sched_swa_unadmitted_chunk_cached.trace.json (found by the 60 s
    matrix on 0.5.11, 3 steps: one 181-token prompt, chunk 128, an SWA pool of 130): the SWA budget
    admits a 1-token chunk, then defers the next one, whose `fill_ids` the next round had already
    expanded to the whole prompt; the stash's `cache_unfinished_req` caches positions 129..180 from
    row entries never written (slot 0): sgl-project/sglang#24252, fixed by #24318. Recognised by
    that fix (stash at the computed prefix); clean on 0.5.7, 0.5.10, 0.5.12, 0.5.14, 0.5.15, 0.5.18,
    0.5.23 (replayed)."""
    sg = _drive()
    from pathlib import Path
    from kvcheck.engines.sglang.install import sglang_version
    from kvcheck.engines.sglang.scheduler import known
    trace = Path(__file__).resolve().parents[2] / "docs/repro/traces/sglang_sched_swa_unadmitted_chunk_cached.trace.json"
    res = sg.replay(str(trace))
    if sglang_version() != "0.5.11":
        assert res["violation"] is None, res
        return
    assert res["reproduced"] and "position 129 of a cached prefix in slot 0" in res["violation"]["message"], res
    k = next(k for k in known.KNOWN if k.defect.name == "swa_unadmitted_chunk_cached")
    with k.fixed():
        assert sg.replay(str(trace))["violation"] is None


def test_an_all_sliding_window_model_runs_where_its_server_exists_and_its_faults_are_caught(tmp_path, monkeypatch):
    """`pure-swa@sched`: a model whose every layer is sliding-window attention, served (0.5.15+) with
    one SWA pool (`PureSWATokenToKVPoolAllocator`) and `PureSWARadixCache`, which SGLang's factory
    builds for it. Clean, with the window's tail freed during decode (the forward then reads the
    window only); the tree's planted faults are caught by their expected checks, and a window
    eviction that frees nothing (slots the request's cursor says are gone) by `size_accounting`.
    A release without that server says so in one line (cannot express), not a finding."""
    sg = _drive()
    from kvcheck.engines.sglang.install import SglangUnavailable
    from kvcheck.engines.sglang.layouts import list_layouts
    lay = sg.LAYOUTS["pure-swa@sched"]
    row = next(x for x in list_layouts() if x.get("name") == lay.name)
    try:
        from sglang.srt.mem_cache.allocator.swa import PureSWATokenToKVPoolAllocator as A
    except ImportError:
        assert not row["supported"] and "serves no all-sliding-window model" in row["reason"], row
        with pytest.raises(SglangUnavailable, match="serves no all-sliding-window model"):
            sg.make_adapter(lay)
        return
    assert row["supported"], row
    from kvcheck.spec.refusal import ActionRejected
    ad = sg.make_adapter(lay)
    try:        # no full pool: an operator's --swa-full-tokens-ratio has nothing to apply to
        with pytest.raises(ActionRejected, match="swa_full_tokens_ratio does not apply"):
            ad.apply("start", {"config": {"capacity": 1024, "swa_full_tokens_ratio": 0.5}})
    finally:
        ad.close()
    r = sg.run_campaign(lay.name, steps=2500, seed=1, out_dir=str(tmp_path / "clean"))
    assert r["exit_code"] == 0 and r["findings"] == [], r["findings"]
    cov = r["coverage"]
    assert cov.get("tree:PureSWARadixCache") and cov.get("state:window_freed") and cov.get("forward:extend_after_hit"), cov
    for fault in ("lock_ref_leak", "evict_locked", "evict_no_free", "insert_shifted_values"):
        r = sg.run_campaign(lay.name, budget_s=30, steps=20_000, seed=1, fault=fault, out_dir=str(tmp_path / fault),
                            shrink_s=5)
        assert r["caught"] and r["findings"][0]["check"] == sg.FAULTS[fault].expected, (fault, r["findings"])
    monkeypatch.setattr(A, "free_swa", lambda self, free_index: None)      # the window's tail never freed
    r = sg.run_campaign(lay.name, steps=2500, seed=1, out_dir=str(tmp_path / "leak"), shrink_s=5)
    assert r["findings"] and r["findings"][0]["check"] == "size_accounting", r["findings"]


def test_an_all_swa_model_served_without_prefill_aware_swa_caches_its_freed_window(tmp_path, monkeypatch):
    """What `pure-swa@sched` would report for an all-SWA model that is not prefill-aware (SGLang
    serves none: its one such model, UnlimitedOCR, is): PureSWARadixCache limits a finished
    request's insert to what the window never freed only by `swa_evict_floor`, which only
    prefill-aware SWA sets, so the tree takes positions `maybe_evict_swa` already freed and the
    pool gives to later tokens: `tree_content_matches` or `no_write_into_cached` (seen on 0.5.15,
    0.5.18, 0.5.20, 0.5.23).
    The check sees this class of bug (a tree caching freed window slots); the layout does not
    report it as SGLang's defect, since no model SGLang serves reaches it."""
    sg = _drive()
    try:
        import sglang.srt.mem_cache.allocator.swa as sw
        sw.PureSWATokenToKVPoolAllocator
    except (ImportError, AttributeError):
        pytest.skip("this release serves no all-sliding-window model (0.5.15+)")
    from kvcheck.engines.sglang.scheduler import build
    monkeypatch.setattr(build, "PREFILL_AWARE_ALL_SWA", False)
    r = sg.run_campaign("pure-swa@sched", budget_s=60, steps=20_000, seed=1, out_dir=str(tmp_path), shrink_s=5)
    # the tree holding a slot the pool gave again: seen as its content (tree_content_matches) or as
    # the later forward that writes it (no_write_into_cached), whichever comes first
    assert r["findings"] and r["findings"][0]["check"] in ("tree_content_matches", "no_write_into_cached"), \
        r["findings"]
