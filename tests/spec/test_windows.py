"""Groups with different sliding windows: every group retains its own window (a request keeps
one window step, state.py `rwin`, and each group's first block comes from it), the spec holds
under walks with every invariant checked, exhaustive exploration and Z3, the trace that made
the spec refuse such configs is now clean, and a planted slide that uses one window for every
group is caught by `refcount_equals_holders`."""
from __future__ import annotations

from dataclasses import replace

import pytest
from scenario import Driver

from kvcheck.checker.explore import explore, fault_config
from kvcheck.checker.prove import Prover
from kvcheck.fuzz.walk import Walker
from kvcheck.spec import faults as F
from kvcheck.spec.config import Config, LayerSpec
from kvcheck.spec.invariants import invariants_for
from kvcheck.spec.objects import EVICTED
from kvcheck.spec.system import Spec

L = LayerSpec
# full + two sliding windows (vLLM's `full+swa+swa`): W=6 moves at position 3, W=11 at 4
SWA_SWA_FULL = Config(layers=(L("swa", window=6), L("swa", window=11), L("full")),
                      capacity={"swa_window": 13})
# the SWA branches of csa and hca with windows other than the swa layer's (docs/engine.md:
# the config whose trace broke toctou_bound_stable while the spec kept one window for all)
BRANCHES = Config(layers=(L("swa", window=3), L("csa", window=12, m=4, topk=1), L("hca", window=5, m=16)),
                  block_size=8, blocks=3, max_version=2)
# exhaustive: two SWA groups (W=2, W=4 over blocks of 2: the narrow window moves at 2, both at
# 3), one request, device tier, four pages for six objects
_SMALL = dict(requests=1, tiers=("device",), max_version=0, reserve=0, max_inflight=1, max_active=1)
TWO_SMALL = Config(layers=(L("swa", window=2), L("swa", window=4)), block_size=2, blocks=3,
                   capacity={"swa_window": 4}, **_SMALL)
# exhaustive (slow): an swa layer (W=2) and an hca branch (W=4, m=2) over blocks of 2
SWA_HCA_SMALL = Config(layers=(L("swa", window=2), L("hca", window=4, m=2)), block_size=2, blocks=2,
                       capacity={"swa_window": 4, "compressed_kv": 2}, **_SMALL)


def test_each_group_releases_its_own_window() -> None:
    """At position 2 the W=2 group's window starts at block 1, the W=4 group's still at 0: a
    slide releases the narrow group's block 0 and keeps the wide group's pinned."""
    d = Driver(Spec(replace(TWO_SMALL, capacity={"swa_window": 6})))
    d.do("submit", r=0, n=3).do("lookup", r=0).do("bind", r=0).do("use", r=0)
    d.do("append", r=0, j=0).do("append", r=0, j=1)
    refs = lambda g: [d.field("o", g, "swa_window", j, "ref") for j in range(3)]  # noqa: E731
    assert refs(0) == refs(1) == [1, 1, 0]
    d.do("slide", r=0)
    assert d.field("r", 0, "rwin") == 1 and refs(0) == [0, 1, 0] and refs(1) == [1, 1, 0]
    d.do("evict", g=0, kind="swa_window", j=0)                # out of the narrow window: evictable
    assert not d.can("evict", g=1, kind="swa_window", j=0)    # inside the wide one: pinned
    d.do("append", r=0, j=2).do("slide", r=0)
    assert d.field("r", 0, "rwin") == 2 and refs(0) == [0, 0, 1] and refs(1) == [0, 1, 1]
    assert not d.violations()


def test_the_trace_that_broke_one_retained_window_is_clean() -> None:
    """docs/engine.md: with one retained window (the widest) for every group, `bind` pinned the
    swa group's block 1, below its own window, after it was evicted: toctou_bound_stable failed
    in the spec itself. With a window per group the bind pins only what each group reads."""
    d = Driver(Spec(BRANCHES))
    d.do("submit", r=0, n=2).do("lookup", r=0).do("bind", r=0).do("use", r=0)
    d.do("append", r=0, j=0).do("append", r=0, j=1)
    d.do("compress", g=1, kind="compressed_kv", j=1).do("indexer_sync", g=1, kind="indexer", j=1)
    d.do("submit", r=1, n=3).do("lookup", r=1).do("bind", r=1)
    d.do("indexer_sync", g=1, kind="indexer", j=0).do("use", r=1)
    d.do("append", r=1, j=0).do("append", r=1, j=1).do("append", r=1, j=2).do("finish", r=1)
    d.do("compress", g=1, kind="compressed_kv", j=2).do("finish", r=0)
    d.do("evict", g=2, kind="swa_window", j=1)
    d.do("indexer_sync", g=1, kind="indexer", j=2).do("compress", g=1, kind="compressed_kv", j=0)
    d.do("compress", g=2, kind="compressed_kv", j=1)
    d.do("submit", r=1, n=3).do("lookup", r=1)
    assert d.spec.decide(d.s, 1)["k"] == 3
    d.do("bind", r=1)
    assert d.field("o", 2, "swa_window", 1, "st") == EVICTED
    assert d.field("o", 2, "swa_window", 1, "ref") == 0       # below the W=3 group's window at 3
    assert d.field("o", 1, "swa_window", 1, "ref") == 1       # inside the W=12 group's
    assert not d.violations()


@pytest.mark.parametrize("cfg", [SWA_SWA_FULL, BRANCHES], ids=["swa6+swa11+full", "swa3+csa12+hca5"])
def test_walks_hold_with_every_invariant_checked(cfg: Config) -> None:
    assert len(cfg.windows) > 1
    spec = Spec(cfg)
    res = Walker(spec, seed=3, full_check=True).run(6000)
    assert res.violation is None
    assert {"slide", "evict", "bind", "append"} <= set(res.coverage.actions)
    assert {"REUSE", "PARTIAL"} <= {d for d, n in res.coverage.decisions.items() if n}


def test_exhaustive_exploration_of_two_windows() -> None:
    _, res, _ = explore(TWO_SMALL)
    assert res.exhaustive and res.violation is None and res.states == 55_983
    assert "action slide" not in res.report["sometimes_missing"]
    assert not res.report["deadlocks"]


@pytest.mark.slow
def test_exhaustive_exploration_of_an_swa_layer_and_an_hca_branch() -> None:
    _, res, _ = explore(SWA_HCA_SMALL)           # 954,735 states, ~40 s
    assert res.exhaustive and res.violation is None
    assert "action slide" not in res.report["sometimes_missing"]


@pytest.mark.parametrize("cfg", [SWA_SWA_FULL, BRANCHES], ids=["swa6+swa11+full", "swa3+csa12+hca5"])
def test_z3_proves_every_invariant_with_several_windows(cfg: Config) -> None:
    pv = Prover(cfg)
    res = pv.induction()
    assert set(invariants_for(cfg)) <= set(res)
    assert {n: o.status for n, o in res.items() if o.status != "proved"} == {}
    assert pv.hit_soundness().status == "proved"
    checked, path, _ = pv.bmc(4)
    assert checked == 4 and path is None


def test_slide_with_one_window_for_every_group_is_caught() -> None:
    """The planted fault releases every group's pages below the narrowest window's start: the
    wide group's block 0, still inside its own window, loses its pin (refcount < holders).
    Caught on the fault's explorer config (as `kvcheck mutants` runs it) and on the small
    config explored exhaustively clean above; the clean spec at the same depth finds nothing."""
    f = F.SLIDE_ONE_WINDOW
    for cfg in (fault_config(f.name), TWO_SMALL):
        assert len(cfg.windows) == 2
        _, res, _ = explore(cfg, f.name)
        v = res.violation
        assert v["invariants"] == [f.expected] == ["refcount_equals_holders"]
        assert v["action"] == "slide(r=0)" and v["where"] == ["refcount_equals_holders: swa_window[g1,b0]"]
        assert v["depth"] == 7
        _, clean, _ = explore(cfg, max_depth=v["depth"])         # negative control
        assert clean.violation is None and clean.states > res.states
    walk = Walker(Spec(f.config_for(Config()), f.name), seed=0).run(200_000).violation
    assert walk is not None and f.expected in walk.invariants


def test_slide_with_one_window_plants_nothing_where_windows_are_equal() -> None:
    """With one finite window (the default config: W=6 for every group) one bound for every
    group is the right bound: the fault is refused there rather than run clean and counted."""
    assert Config().windows == (6,)
    with pytest.raises(F.FaultError, match="plants nothing"):
        Spec(Config(), F.SLIDE_ONE_WINDOW.name)
