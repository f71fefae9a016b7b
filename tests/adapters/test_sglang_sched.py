"""SGLang's scheduler paths (sglang_sched.py): chunked prefill published by SGLang's own
cache_unfinished_req / checkpoint, siblings matching a partly inserted prompt, eviction and abort
between chunks, and such requests released by SGLang's own cache_finished_req / release_kv_cache.

Each python named in KVCHECK_SGLANG_PYTHONS (side venvs built by scripts/install-sglang.sh) runs
one subprocess (SGLang's import chain takes seconds) that plays a hand-written chunked scenario,
plants `unfinished_lock_not_moved` on every layout of the release it applies to (ChunkCache has no
lock to move), runs a short clean campaign per layout and models the wrong slot ownership once; the tests judge its JSON. Without the variable
they skip, saying how to enable them; the first two tests need no SGLang.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

import pytest

from kvcheck.engines.sglang.layouts import ACTIONS, FAULTS

ROOT = Path(__file__).resolve().parents[2]
PYTHONS = [p for p in os.environ.get("KVCHECK_SGLANG_PYTHONS", "").split(os.pathsep) if p]
needs_sglang = pytest.mark.skipif(not PYTHONS, reason="set KVCHECK_SGLANG_PYTHONS to side-venv pythons "
                                  "(scripts/install-sglang.sh VERSION DIR) to test SGLang's scheduler paths")

_PROBE = r"""
import json, subprocess, sys, time
from kvcheck.engines.sglang import drivers as sg
from kvcheck.engines.sglang.layouts import fault_applies, known_finding
out = {"version": sg.sglang_version(), "scenario": {}, "faults": [], "clean": [], "ownership": None}
from kvcheck.fuzz.known import parse_cli
ACK = parse_cli(["sanity_check_lru_wallclock=sgl-project/sglang#8931, fixed in 0.5.5"])
# the cache-level layouts (kvcheck's `chunk` action); SGLang's own Scheduler (NAME@sched) has its own tests
lays = [r["name"] for r in sg.list_layouts() if r["supported"] and sg.LAYOUTS[r["name"]].drive == "cache"]
repro = set()

# a hand-written scenario on RadixCache: a 14-token prompt in chunks of 4 while a sibling shares 6
ad = sg.make_adapter(sg.LAYOUTS["radix"], None, 48)
A = [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2]
steps, seen = [("submit", {"r": "a", "tokens": A}), ("chunk", {"r": "a", "n": 4}), ("chunk", {"r": "a", "n": 4}),
               ("submit", {"r": "b", "tokens": A[:6] + [5, 5, 5]}), ("match", {"r": "b"}),
               ("evict", {"n": 48}), ("chunk", {"r": "a", "n": 4}),
               ("submit", {"r": "c", "tokens": A[:10] + [4]}), ("chunk", {"r": "c", "n": 8}),
               ("abort", {"r": "a"}), ("finish", {"r": "b"}), ("decode", {"r": "c", "tok": 3}), ("finish", {"r": "c"})], []
from kvcheck.spec.sut import ActionRejected
for a, p in steps:
    try:
        obs = ad.apply(a, p)
    except ActionRejected:          # 0.4.10 aborts a request only after its prefill: finish the prompt first
        ad.apply("chunk", {"r": p["r"], "n": 8})
        obs = dict(ad.apply(a, p), after_prefill=True)
    v = ad.extra_checks(a, p)
    seen.append({"action": a, "obs": obs, "violation": v,
                 "locks": sorted((len(path) + len(n.key), n.lock_ref) for n, path in ad.tree()),
                 "free": ad.alloc.available_size()})
out["scenario"] = {"steps": seen, "coverage": dict(ad.coverage),
                   "tree_tokens": sum(len(n.value) for n, _ in ad.tree()), "capacity": ad.capacity}

def planted(lay):
    r = sg.run_campaign(lay, budget_s=10, steps=20000, seed=1, fault="unfinished_lock_not_moved",
                        out_dir=sys.argv[1], shrink_s=3)
    row = {"layout": lay, "class": sg.LAYOUTS[lay].cls, "caught": r["caught"], "ttf": r["time_to_failure_s"],
           "check": r["findings"][0]["check"] if r["findings"] else None}
    if r["findings"]:
        x = r["findings"][0]
        row.update(steps=x["steps"], replayed=sg.replay(x["trace"])["reproduced"])
        if x.get("reproducer") and row["class"] not in repro:     # once per class: each run imports SGLang
            repro.add(row["class"])
            row["repro_exit"] = [subprocess.run([sys.executable, x["reproducer"], *a], capture_output=True,
                                                timeout=120).returncode for a in ([], ["--clean"])]
    return row

for lay in lays:
    if fault_applies("unfinished_lock_not_moved", sg.LAYOUTS[lay]):   # not ChunkCache: no tree, no lock
        out["faults"].append(planted(lay))
    c = sg.run_campaign(lay, budget_s=None, steps=2500, seed=3, out_dir=sys.argv[1], shrink_s=2,
                        acknowledged=ACK)   # sgl-project/sglang#8931 on releases before 0.5.5
    out["clean"].append({"layout": lay, "exit": c["exit_code"], "missing": c["missing_actions"],
                         "check": c["findings"][0]["check"] if c["findings"] else None,
                         "known": known_finding(sg.LAYOUTS[lay], sg.sglang_version()),
                         "chunks": c["coverage"].get("state:chunk_cached", 0),
                         "released": c["coverage"].get("state:sched_released", 0)})

# the adapter must model who owns a published request's slots: take the tree's part as the request's
from kvcheck.engines.sglang import sched as sglang_sched
real = sglang_sched.SchedMixin._read_back
def wrong(self, r, s):
    real(self, r, s)
    self.reqs[r].hit = 0                  # as if the request still owned its whole row
sglang_sched.SchedMixin._read_back = wrong
ad = sg.make_adapter(sg.LAYOUTS["radix"], None, 48)
ad.apply("submit", {"r": "a", "tokens": A})
ad.apply("chunk", {"r": "a", "n": 4})
out["ownership"] = ad.extra_checks("chunk", {})
print(json.dumps(out, default=str))
"""


@functools.lru_cache(maxsize=None)      # one subprocess per interpreter for every test below
def _probe(py: str, out_dir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([py, "-c", _PROBE, out_dir], capture_output=True, text=True, env=env, cwd=ROOT, timeout=1500)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sched"))


def test_chunk_is_an_action_and_its_fault_is_declared_once():
    """No SGLang needed: the vocabulary and the one fault table carry the new path."""
    assert "chunk" in ACTIONS
    f = FAULTS["unfinished_lock_not_moved"]
    assert f.expected == "lock_ref_equals_holders" and f.site == "cache_unfinished_req"


def test_flat_request_pops_its_committed_kv_once():
    """No SGLang needed: the Req-like record fails loudly where SGLang's Req would (a second pop)."""
    from kvcheck.engines.sglang.sched import FlatReq
    q = FlatReq("r", [1, 2, 3], kv_committed_len=3, kv_allocated_len=3)
    assert q.pop_committed_kv_cache() == 3 and not q.finished()
    with pytest.raises(AssertionError):
        q.pop_committed_kv_cache()


@needs_sglang
@pytest.mark.parametrize("py", PYTHONS)
def test_chunked_scenario_moves_the_lock_and_shares_the_partial_prefix(py, probe_dir):
    res = _probe(py, probe_dir)
    sc = res["scenario"]
    by = sc["steps"]
    for s in by:
        s["locks"] = [tuple(x) for x in s["locks"]]      # JSON gives lists
    assert all(s["violation"] is None for s in by), by
    # after each published chunk the lock is on the deepest published node (4, then 8 tokens; lock_ref
    # counts along the path)
    assert by[1]["locks"] == [(4, 1)] and by[2]["locks"] == [(4, 1), (8, 1)], (by[1], by[2])
    # b matches the partly inserted prompt (its 6 shared tokens, page 1) while a is mid-prefill
    assert by[4]["obs"] == {"hit": 6, "admitted": True}, by[4]
    # eviction between chunks: everything in the tree is held, nothing goes; a's third chunk is published
    assert by[5]["obs"]["evicted"] == 0 and by[6]["obs"] == {"computed": 12, "hit": 12}, (by[5], by[6])
    assert max(by[6]["locks"]) == (12, 1), by[6]
    # c resumes inside a's published prefix; a is aborted mid-prefill, its chunks stay cached, unlocked
    # (0.4.10 has no is_insert: its scheduler aborts after the prefill and caches the request)
    assert by[8]["obs"]["hit"] == 10, by[8]
    if by[9]["obs"].get("after_prefill"):
        assert by[9]["obs"]["inserted"] and (14, 0) in by[9]["locks"], by[9]
    else:
        assert by[9]["obs"] == {"inserted": False} and (12, 0) in by[9]["locks"], by[9]
    # all released: no lock left, every slot in the tree or free
    assert all(n == 0 for _, n in by[-1]["locks"]), by[-1]
    assert by[-1]["free"] + sc["tree_tokens"] == sc["capacity"], (by[-1], sc["tree_tokens"])
    assert sc["coverage"]["state:lock_moved"] == 3 and sc["coverage"]["state:sched_released"] == 2


@needs_sglang
@pytest.mark.parametrize("py", PYTHONS)
def test_lock_not_moved_is_caught_shrunk_replayed_and_reproduced(py, probe_dir):
    res = _probe(py, probe_dir)
    assert res["faults"], res
    for row in res["faults"]:
        assert row["caught"] and row["check"] == "lock_ref_equals_holders", (res["version"], row)
        assert row["steps"] <= 10 and row["replayed"] and row["ttf"] <= 10, (res["version"], row)
        if "repro_exit" in row:
            assert row["repro_exit"] == [1, 0], (res["version"], row)
    assert any(r.get("repro_exit") for r in res["faults"] if r["class"] == "RadixCache"), res["faults"]


@needs_sglang
@pytest.mark.parametrize("py", PYTHONS)
def test_every_layout_runs_the_scheduler_path_clean(py, probe_dir):
    """Clean, or only the release's known SGLang finding (KNOWN_FINDINGS), with chunks published
    and scheduler-path requests released by SGLang's own code on every layout."""
    res = _probe(py, probe_dir)
    for row in res["clean"]:
        assert row["exit"] == 0 or row["check"] == row["known"], (res["version"], row)
        assert row["chunks"] > 0 and (row["released"] > 0 or row["exit"] != 0), (res["version"], row)
        assert row["exit"] != 0 or not row["missing"], (res["version"], row)


@needs_sglang
@pytest.mark.parametrize("py", PYTHONS)
def test_wrong_slot_ownership_is_reported_as_double_ownership(py, probe_dir):
    """Negative control of the ownership model: an adapter that takes the tree's slots as the
    request's own is caught by size_accounting (counted twice), not silently accepted."""
    v = _probe(py, probe_dir)["ownership"]
    assert v and v[1] == "size_accounting" and "counted twice" in v[2], v
