"""kvcheck's side of the engine boundary is never the engine's bug (fuzz/boundary.py).

Unit level: a fake engine package (its modules' frames are the engine's) and code compiled as a
kvcheck module (its frames are kvcheck's) raise each kind of exception; `blame` sides them by
where they were raised and on what. End to end on the vLLM in the venv: a planted interface
drift (a vLLM method whose signature changed; a release that reads a field kvcheck's stand-in
lacks) ends `kvcheck fuzz` with exit 3 and the one-line "cannot drive", not exit 10; the same
kind of exception raised inside vLLM's own code on what kvcheck handed it stays a finding.
"""
from __future__ import annotations

import json
import sys
import textwrap
import types

import pytest

from kvcheck.fuzz import boundary
from kvcheck.fuzz.boundary import CannotDrive, Needs, StandIn, blame, preflight

ENGINE_SRC = '''
def reads(req):
    return req.get_fill_ids()

def own_bug(xs):
    assert len(xs) == 0, "the engine's own invariant"

def calls_method(req):
    return req.finished(1, 2, 3)

def takes_key(*, key):
    return key

def via_stdlib(d):
    import json
    return json.loads(d)

class Cache:
    def dec_lock_ref(self, node, *, skip_swa=False):
        return 0

    def release(self, node):
        return self.dec_lock_ref(node, skip_swa=True)     # a keyword a newer release passes

    def own_mistake(self, node):
        return self.dec_lock_ref(node, bogus=True)         # the engine's own call, wrong

def uses_a_kernel(x):
    return transfer_kv_direct(x)    # imported only where the kernel package has it (not on CPU)

def annotated(fn):                  # a pass-through decorator (as SGLang's nvtx wrappers)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper

class Scheduler:
    @annotated
    def get_next_batch_to_run(self):
        return None

    def step(self):
        return self.get_next_batch_to_run(running_batch=None)   # the engine's own call, wrong
'''


_SRC_DIR: list = []


def _module(name: str, src: str) -> types.ModuleType:
    """A module from source written to a file (so inspect can read it, as it reads a release's)."""
    import importlib.util
    import tempfile
    from pathlib import Path
    if not _SRC_DIR:
        _SRC_DIR.append(Path(tempfile.mkdtemp(prefix="kvcheck-boundary-")))
    path = _SRC_DIR[0] / f"{name.replace('.', '_')}.py"
    path.write_text(textwrap.dedent(src))
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m


@pytest.fixture(scope="module")
def eng():
    m = _module("fakeengine", ENGINE_SRC)
    yield m
    sys.modules.pop("fakeengine", None)


@pytest.fixture(scope="module")
def ours(eng):
    """Adapter code as kvcheck's: its frames belong to a kvcheck module."""
    m = _module("kvcheck.fake_adapter", '''
import fakeengine
def call_with_dropped_keyword():
    return fakeengine.takes_key(k=1)
def read_engine_attr():
    return fakeengine.get_server_args()
def call_through_a_wrapper():
    s = fakeengine.Scheduler()
    return s.get_next_batch_to_run(running_batch=None)
def engine_step():
    return fakeengine.Scheduler().step()
''')
    yield m
    sys.modules.pop("kvcheck.fake_adapter", None)


def _raised(fn, *a):
    try:
        fn(*a)
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("did not raise")


def _flat():
    from kvcheck.engines.sglang.sched_req import FlatReq
    return FlatReq("r0", [1, 2])


class Bare:
    """An engine-side object (this test module is neither kvcheck's nor the engine's)."""


def test_the_engine_reading_a_field_kvchecks_stand_in_lacks_is_kvchecks_side(eng):
    e = _raised(eng.reads, StandIn(rid="r0"))
    got = blame(e, ("fakeengine",))
    assert got is not None and "'get_fill_ids'" in got[0] and "StandIn" in got[0]


def test_the_engine_reading_a_field_its_own_object_lacks_is_the_engines(eng):
    assert blame(_raised(eng.reads, Bare()), ("fakeengine",)) is None


def test_an_engine_assertion_on_its_own_logic_stays_the_engines(eng):
    assert blame(_raised(eng.own_bug, [1]), ("fakeengine",)) is None


def test_engine_code_that_cannot_run_here_is_kvchecks_side(eng):
    """A NameError / ImportError inside the release's code: it cannot run in kvcheck's CPU
    setting (a kernel its stand-ins lack), which says nothing about its cache logic."""
    got = blame(_raised(eng.uses_a_kernel, 1), ("fakeengine",))
    assert got is not None and "transfer_kv_direct" in got[0] and "cannot run" in got[0]


def test_an_exception_in_a_library_the_engine_calls_is_the_engines(eng):
    assert blame(_raised(eng.via_stdlib, "{"), ("fakeengine",)) is None


def test_a_call_with_a_keyword_the_release_dropped_is_kvchecks_side(ours):
    got = blame(_raised(ours.call_with_dropped_keyword), ("fakeengine",))
    assert got is not None and "unexpected keyword" in got[0] and "call_with_dropped_keyword" in got[1]


def test_an_engine_attribute_kvcheck_relies_on_that_is_gone_is_kvchecks_side(ours):
    got = blame(_raised(ours.read_engine_attr), ("fakeengine",))
    assert got is not None and "get_server_args" in got[0]


def test_the_engine_calling_a_stand_in_method_with_other_arguments_is_kvchecks_side(eng):
    got = blame(_raised(eng.calls_method, _flat()), ("fakeengine",))
    assert got is not None and "FlatReq" in got[0] and "sched_req.py" in got[1]


def test_the_engine_calling_a_wrapper_kvcheck_installed_with_a_new_keyword_is_kvchecks_side(eng, ours):
    """A planted fault (or probe) wraps an engine method on the instance; a release that passes the
    method a keyword the wrapper does not forward fails inside the engine's frame, but on kvcheck's
    wrapper (0.5.16's SWA tree passed `skip_swa` to the lock_ref_leak wrapper: a false finding)."""
    cache = eng.Cache()
    ns: dict = {}
    exec(compile("def dec(node, *rest):\n    return real(node, *rest)\n", "kvcheck_wrapper", "exec"),
         {"real": cache.dec_lock_ref, "__name__": "kvcheck.fake_adapter"}, ns)
    cache.dec_lock_ref = ns["dec"]
    got = blame(_raised(cache.release, object()), ("fakeengine",))
    assert got is not None and "kvcheck's dec" in got[0] and "skip_swa" in got[0]
    # the engine's own method called wrongly by the engine itself stays the engine's
    assert blame(_raised(eng.Cache().own_mistake, object()), ("fakeengine",)) is None


def test_assign_refuses_a_field_the_object_does_not_have():
    b = Bare()
    b.fill_len = 0
    boundary.assign(b, fill_len=3)
    assert b.fill_len == 3
    e = _raised(lambda: boundary.assign(b, fill_ids=[1]))
    assert isinstance(e, AttributeError) and blame(e, ("fakeengine",)) is not None
    assert not hasattr(b, "fill_ids")


def test_preflight_names_every_gap(eng):
    assert preflight([Needs("fakeengine:reads", reads=("req", lambda: StandIn(get_fill_ids=list)))]) == []
    gaps = preflight([
        Needs("fakeengine:reads", reads=("req", lambda: StandIn()), where="here.py:1"),
        Needs("fakeengine:takes_key", keywords=("key", "value")),
        Needs("fakeengine:gone"),
        Needs("no_such_module_kvcheck"),
    ])
    assert [g[0].split(" ")[0] for g in gaps] == ["fakeengine:reads", "fakeengine:takes_key", "fakeengine:gone",
                                                  "no_such_module_kvcheck"]
    assert "get_fill_ids" in gaps[0][0] and gaps[0][1] == "here.py:1"
    assert "'value'" in gaps[1][0]


def test_attributes_read_follows_the_parameter_into_methods_of_its_class():
    m = _module("fakeengine2", '''
class Cache:
    def publish(self, req):
        n = req.fill_len
        self._write(1, req)
    def _write(self, x, r):
        return r.req_pool_idx + x
''')
    try:
        assert boundary.attributes_read(m.Cache.publish, "req") == {"fill_len", "req_pool_idx"}
    finally:
        sys.modules.pop("fakeengine2", None)


def test_cannot_drive_is_one_line_exit_3_with_no_finding():
    e = CannotDrive("vllm", "0.99.0", "AttributeError: x", "kvcheck/engines/vllm/mamba.py:1 (f)")
    r = e.result(sut="vllm")
    assert r["exit_code"] == 3 and r["findings"] == [] and "\n" not in r["cannot_drive"]["line"]
    assert "vllm 0.99.0" in e.line and "mamba.py:1" in e.line


# ---- end to end on the installed vLLM -------------------------------------------------------
vllm = pytest.importorskip("vllm", reason="vLLM is not installed here")


def _fuzz(capsys, tmp_path, layout: str = "full") -> tuple[int, dict]:
    from kvcheck.checker.cli import main
    # the manager drive: kvcheck calls the manager's methods and stands in for the scheduler itself
    code = main(["fuzz", "--sut", "vllm", "--layout", layout, "--budget", "300", "--seed", "1", "--json",
                 "--drive", "mixed", "--out", str(tmp_path)])
    return code, json.loads(capsys.readouterr().out)


def _engine_code(src: str, name: str = "vllm.v1.core.kvcheck_test_drift"):
    """Code compiled as part of vLLM (its frames are vLLM's): a release's changed method."""
    return _module(name, src)


def test_a_vllm_method_whose_signature_changed_is_cannot_drive_not_a_finding(capsys, tmp_path, monkeypatch):
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    drift = _engine_code('''
def get_computed_blocks(self, request, new_required_argument):
    raise AssertionError("not reached")
''')
    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", drift.get_computed_blocks)
    code, res = _fuzz(capsys, tmp_path)
    assert code == 3 and res["findings"] == [], res
    line = res["cannot_drive"]["line"]
    assert "vllm" in line and "get_computed_blocks" in line and "new_required_argument" in line
    assert "kvcheck/engines/vllm/" in res["cannot_drive"]["where"]


def test_a_release_reading_a_field_kvchecks_stand_in_lacks_is_cannot_drive(capsys, tmp_path, monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler
    real = Scheduler._mamba_block_aligned_split
    drift = _engine_code('''
def make(real):
    def _mamba_block_aligned_split(self, *a, **k):
        if self.kvcheck_test_new_field:
            pass
        return real(self, *a, **k)
    return _mamba_block_aligned_split
''', "vllm.v1.core.sched.kvcheck_test_drift2")
    monkeypatch.setattr(Scheduler, "_mamba_block_aligned_split", drift.make(real))
    monkeypatch.setattr("kvcheck.engines.vllm.mamba._PREFLIGHT", [True])    # past the pre-flight: at run time
    code, res = _fuzz(capsys, tmp_path, "full+mamba")
    assert code == 3 and res["findings"] == [], res
    assert "kvcheck_test_new_field" in res["cannot_drive"]["line"] and "StandIn" in res["cannot_drive"]["line"]


def test_the_pre_flight_catches_the_same_drift_before_the_first_step(capsys, tmp_path, monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler
    drift = _engine_code('''
def _mamba_block_aligned_split(self, *a, **k):
    return self.kvcheck_test_preflight_field
''', "vllm.v1.core.sched.kvcheck_test_drift3")
    monkeypatch.setattr(Scheduler, "_mamba_block_aligned_split", drift._mamba_block_aligned_split)
    monkeypatch.setattr("kvcheck.engines.vllm.mamba._PREFLIGHT", [])
    code, res = _fuzz(capsys, tmp_path, "full+mamba")
    assert code == 3 and "kvcheck_test_preflight_field" in res["cannot_drive"]["what"]
    assert "_split_fn" in res["cannot_drive"]["where"]


def test_the_same_exception_raised_by_vllms_own_logic_stays_a_finding(capsys, tmp_path, monkeypatch):
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    real = KVCacheManager.get_computed_blocks
    bug = _engine_code('''
def make(real):
    calls = [0]
    def get_computed_blocks(self, request):
        calls[0] += 1
        if calls[0] == 4:
            raise AssertionError("a planted engine-side defect")
        return real(self, request)
    return get_computed_blocks
''', "vllm.v1.core.kvcheck_test_bug")
    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", bug.make(real))
    code, res = _fuzz(capsys, tmp_path)
    assert code == 10 and "cannot_drive" not in res
    assert res["findings"][0]["check"] == "vllm_internal_error"


def test_a_call_the_release_refuses_through_its_own_wrapper_is_kvchecks_side(ours):
    """kvcheck passes an argument the release's method does not take, and the TypeError is raised
    inside the release's pass-through decorator (an engine frame): still kvcheck's call."""
    got = blame(_raised(ours.call_through_a_wrapper), ("fakeengine",))
    assert got is not None and "kvcheck calls the release's Scheduler.get_next_batch_to_run" in got[0]
    assert "fake_adapter" in got[1]


def test_the_engine_calling_its_own_wrapped_method_wrongly_stays_the_engines(ours):
    assert blame(_raised(ours.engine_step), ("fakeengine",)) is None
