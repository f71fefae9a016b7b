"""The decision on hand-built states, including the worked example of docs/spec.md."""
from __future__ import annotations

from scenario import Driver

from kvcheck.spec.config import Config
from kvcheck.spec.system import Spec


# Roomy pools: every object of the 4-block prefix fits (the default config is tighter, to
# create memory pressure in walks).
ROOMY = {"compressed_kv": 4, "tail": 6, "swa_window": 17, "indexer": 3}


def filled(cfg: Config | None = None) -> Driver:
    d = Driver(Spec(cfg or Config(capacity=ROOMY)))
    d.fill(0, 4)
    d.do("submit", r=1, n=4)
    return d


def test_empty_cache_recomputes() -> None:
    d = Driver(Spec())
    d.do("submit", r=0, n=3)
    assert d.spec.decide(d.s, 0) == {"kind": "RECOMPUTE", "k": 0, "logical": 0, "reasons": []}


def test_full_hit_is_reuse() -> None:
    d = filled()
    assert d.spec.decide(d.s, 1) == {"kind": "REUSE", "k": 4, "logical": 4, "reasons": []}


def test_worked_example_one_swa_page_evicted_degrades_to_partial() -> None:
    """docs/spec.md: the hash hit covers 4 blocks, but the SWA page of block 2 is gone. At k=4
    and k=3 the window [L-5, L) needs block 2; k=2 needs blocks 0-1 only: PARTIAL(2)."""
    d = filled()
    d.do("evict", g=0, kind="swa_window", j=2)
    dec = d.spec.decide(d.s, 1)
    assert dec == {"kind": "PARTIAL", "k": 2, "logical": 4, "reasons": ["window_incomplete"]}
    d.do("lookup", r=1).do("bind", r=1).do("use", r=1)
    assert d.field("r", 1, "rpos") == 2 and not d.violations()
    # the request recomputes blocks 2 and 3 and the page comes back
    d.do("append", r=1, j=2)
    assert d.field("o", 0, "swa_window", 2, "st") == 2


def test_stale_indexer_degrades_with_its_reason() -> None:
    d = filled()
    d.do("bump_indexer")
    dec = d.spec.decide(d.s, 1)
    assert dec["kind"] == "PARTIAL" and dec["k"] == 1 and dec["reasons"] == ["indexer_version"]


def test_lagging_indexer_is_not_a_hit() -> None:
    d = Driver(Spec(Config(capacity=ROOMY)))
    d.do("submit", r=0, n=2).do("lookup", r=0).do("bind", r=0).do("use", r=0)
    d.do("append", r=0, j=0).do("append", r=0, j=1).do("compress", g=1, kind="compressed_kv", j=1)
    d.do("compress", g=2, kind="compressed_kv", j=1) if d.spec.lay.has(2, "compressed_kv", 1) else None
    d.do("finish", r=0).do("submit", r=1, n=2)
    dec = d.spec.decide(d.s, 1)
    assert dec["k"] == 1 and "indexer_lagging" in dec["reasons"]


def test_prefetch_then_verify_then_reuse() -> None:
    d = filled()
    d.do("offload_start", j=3).do("offload_ack", j=3)
    for o in d.spec.lay.objects:
        if o.block == 3:
            d.do("evict", g=o.group, kind=o.kind, j=3)
    assert d.spec.decide(d.s, 1)["kind"] == "PREFETCH"
    d.do("prefetch_start", j=3).do("prefetch_complete", j=3)
    # registered, loaded, not verified: still not a hit
    assert d.spec.decide(d.s, 1)["kind"] == "PREFETCH"
    d.do("verify_ok", j=3, aligned=1)
    assert d.spec.decide(d.s, 1) == {"kind": "REUSE", "k": 4, "logical": 4, "reasons": []}


def test_corrupt_copy_is_quarantined_never_served() -> None:
    d = filled()
    d.do("offload_start", j=3).do("offload_ack", j=3).do("corrupt", j=3)
    for o in d.spec.lay.objects:
        if o.block == 3:
            d.do("evict", g=o.group, kind=o.kind, j=3)
    d.do("prefetch_start", j=3).do("prefetch_complete", j=3)
    assert not d.can("verify_ok", j=3, aligned=1)
    d.do("checksum_fail", j=3)
    assert d.spec.decide(d.s, 1)["kind"] == "PARTIAL"


def test_misaligned_restore_fails_layer_four() -> None:
    d = filled()
    d.do("offload_start", j=0).do("offload_ack", j=0).do("evict", g=0, kind="swa_window", j=0)
    d.do("prefetch_start", j=0).do("prefetch_complete", j=0).do("verify_ok", j=0, aligned=0)
    d.do("submit", r=0, n=1)
    assert d.spec.decide(d.s, 0) == {"kind": "RECOMPUTE", "k": 0, "logical": 1, "reasons": ["misaligned"]}


def test_lcm_alignment_rounds_the_hit_down() -> None:
    cfg = Config(page_tokens={"hca": 8}, capacity=ROOMY)                     # hits in multiples of 2 blocks
    d = Driver(Spec(cfg))
    d.fill(0, 3)
    d.do("submit", r=1, n=3)
    assert d.spec.decide(d.s, 1) == {"kind": "PARTIAL", "k": 2, "logical": 3, "reasons": ["lcm_alignment"]}


def test_bind_rechecks_and_use_revalidates() -> None:
    d = filled()
    d.do("lookup", r=1)
    d.do("evict", g=0, kind="swa_window", j=3)               # between check and bind
    assert not d.can("bind", r=1)
    d.do("bind_stale", r=1).do("lookup", r=1).do("bind", r=1)
    d.do("bump_model")                                       # between bind and use
    assert not d.can("use", r=1)
    d.do("use_stale", r=1)
    assert not d.violations()


def test_pinned_and_captured_objects_are_not_evicted() -> None:
    d = filled()
    d.do("lookup", r=1).do("bind", r=1)
    assert not d.can("evict", g=3, kind="swa_window", j=0)   # pinned by the lease
    d.do("use", r=1).do("capture", r=1).do("preempt", r=1)
    assert d.field("o", 3, "swa_window", 0, "ref") == 0
    assert not d.can("evict", g=3, kind="swa_window", j=0)   # still referenced by the graph
    assert not d.can("migrate", g=3, kind="swa_window", j=0)
    d.do("release_graph").do("evict", g=3, kind="swa_window", j=0)
