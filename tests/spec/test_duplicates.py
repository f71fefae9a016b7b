"""Duplicate physical copies (config `duplicates`): off ("forbid") the spec is unchanged and
shares a cached block; with "allow" two requests recomputing one block keep two copies, the
unreferenced one is evictable and is the victim a full-attention allocation can have, and a
copy allocated without room is caught (`copy_ignores_capacity`, admission_cap)."""
from __future__ import annotations

import pytest

from kvcheck.spec.config import Config, ConfigError, LayerSpec
from kvcheck.spec.invariants import invariants_for
from kvcheck.spec.system import Spec

from scenario import Driver

DUP = dict(layers=(LayerSpec("full"),), blocks=2, requests=2, tiers=("device",),
           capacity={"swa_window": 2}, max_active=2, reserve=0, duplicates="allow")


def _two_copies(fault=None, **kw) -> Driver:
    """Requests 0 and 1 both decide RECOMPUTE, then both compute block 0: two copies."""
    d = Driver(Spec(Config(**{**DUP, **kw}), fault))
    d.do("submit", r=0, n=1).do("submit", r=1, n=2).do("lookup", r=0).do("lookup", r=1)
    d.do("bind", r=0).do("bind", r=1).do("use", r=0).do("use", r=1).do("append", r=0, j=0)
    return d.do("append_copy", r=1, j=0)


def test_bad_duplicates_value_is_a_one_line_error() -> None:
    for bad in ("keep", 1, None):
        with pytest.raises(ConfigError, match="duplicates must be one of forbid, allow") as e:
            Config.from_dict({"duplicates": bad})
        assert "\n" not in str(e.value)


def test_forbid_is_the_default_spec_byte_for_byte() -> None:
    spec = Spec(Config())
    assert (len(spec.instances), spec.lay.size) == (130, 238)
    assert not {"append_copy", "evict_copy", "append_evict_copy"} & set(spec.actions)
    assert "duplicates" not in Config().to_dict() and "copies_cached" not in invariants_for(Config())
    on = Config(**DUP)
    assert Config.from_dict(on.to_dict()) == on


def test_two_requests_recomputing_a_block_keep_two_copies() -> None:
    d = _two_copies()
    assert d.field("o", 0, "swa_window", 0, "dup") == 1 and d.field("o", 0, "swa_window", 0, "ref") == 2
    assert not d.can("evict_copy", g=0, kind="swa_window", j=0)     # both copies held
    d.do("finish", r=0)
    d.do("evict_copy", g=0, kind="swa_window", j=0)                 # now one is unreferenced
    assert d.field("o", 0, "swa_window", 0, "dup") == 0 and not d.violations()


def test_the_unreferenced_copy_is_the_victim_a_full_attention_allocation_can_have() -> None:
    d = _two_copies(alloc="evict").do("finish", r=0)
    assert not d.can("append", r=1, j=1)                            # the copy fills the pool
    assert not d.can("append_evict", r=1, j=1, v=0)                 # block 0 itself is held
    assert not d.can("append_fail", r=1, j=1, x=1)                  # there is room to make
    d.do("append_evict_copy", r=1, j=1, v=0)
    assert d.field("o", 0, "swa_window", 0, "dup") == 0 and d.field("r", 1, "rpos") == 2
    assert not d.violations()


def test_evicting_a_block_frees_both_copies() -> None:
    d = _two_copies().do("finish", r=0).do("preempt", r=1)
    d.do("evict", g=0, kind="swa_window", j=0)
    assert d.field("o", 0, "swa_window", 0, "dup") == 0 and not d.violations()


def test_a_copy_allocated_without_room_is_caught() -> None:
    with pytest.raises(AssertionError, match="append_copy"):
        _two_copies(capacity={"swa_window": 1})                     # no room: not enabled
    d = _two_copies("copy_ignores_capacity", capacity={"swa_window": 1})
    assert {i for i, _ in d.violations()} == {"admission_cap"}
