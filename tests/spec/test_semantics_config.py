"""Configurable semantics (config keys `eviction`, `prompts`): validated as one-line errors,
off by default (the default spec is unchanged), and each one's rules run on small scenarios:
drop_hash eviction unpublishes, a content hit needs the whole prefix, and the faults only a
new semantic can express are caught by their own invariant."""
from __future__ import annotations

import pytest

from kvcheck.spec.config import Config, ConfigError, LayerSpec
from kvcheck.spec.invariants import INVARIANTS, invariants_for
from kvcheck.spec.system import Spec

from scenario import Driver

FULL2 = dict(layers=(LayerSpec("full"),), blocks=2, requests=1, tiers=("device",))


@pytest.mark.parametrize("data, where", [
    ({"eviction": "lru"}, "eviction must be one of tombstone, drop_hash"),
    ({"eviction": 1}, "eviction must be one of"),
    ({"prompts": 0}, "prompts must be >= 1"),
    ({"prompts": "2"}, "prompts must be an integer"),
    ({"prompts": 9}, "prompts must be <= 8"),
    ({"salted_prompts": -1}, "salted_prompts must be >= 0"),
    ({"salted_prompts": True}, "salted_prompts must be an integer"),
    ({"salted_prompts": 1}, "salted_prompts = 1 needs prompts >= 2"),
    ({"salted_prompts": 2, "prompts": 2, "tiers": ["device"]}, "salted_prompts = 2 needs prompts >= 3"),
    ({"decode": 1}, "decode must be true or false"),
    ({"alloc": "lru"}, "alloc must be one of refuse, evict"),
    ({"alloc": None}, "alloc must be one of"),
])
def test_bad_semantic_keys_are_one_line_errors_naming_the_key(data, where) -> None:
    with pytest.raises(ConfigError, match=where) as e:
        Config.from_dict(data)
    assert "\n" not in str(e.value)


def test_the_default_config_has_none_of_the_new_state_actions_or_invariants() -> None:
    spec = Spec(Config())
    assert (len(spec.instances), spec.lay.size) == (130, 238)
    assert not [n for n in spec.lay.names if n[-1] in ("bcid", "bkey", "rp", "rtok", "bpart", "dup")]
    assert not {"drop_hash", "decode", "append_evict", "append_fail"} & set(spec.actions)
    assert set(invariants_for(Config())) == set(INVARIANTS) - {"published_hash_resident", "hit_content_sound",
                                                               "hit_full_blocks", "copies_cached"}
    assert not {"eviction", "prompts", "salted_prompts", "decode", "alloc", "duplicates"} & set(Config().to_dict())
    on = Config(eviction="drop_hash", prompts=2, salted_prompts=1, tiers=("device",), decode=True,
                alloc="evict", duplicates="allow")
    assert Config.from_dict(on.to_dict()) == on


def test_drop_hash_eviction_unpublishes_tombstone_keeps() -> None:
    for mode, logical in (("tombstone", 2), ("drop_hash", 0)):
        d = Driver(Spec(Config(eviction=mode, **FULL2)))
        d.fill(0, 2).do("evict", g=0, kind="swa_window", j=0)
        assert d.field("b", 0, "hashed") == (mode == "tombstone")
        d.do("submit", r=0, n=2)
        assert d.spec.decide(d.s, 0)["logical"] == logical
        assert not d.violations()


def test_stale_hash_after_evict_is_caught_by_published_hash_resident() -> None:
    d = Driver(Spec(Config(eviction="drop_hash", **FULL2), "stale_hash_after_evict"))
    d.fill(0, 1).do("evict", g=0, kind="swa_window", j=0)
    assert {i for i, _ in d.violations()} == {"published_hash_resident"}


def _content(fault=None) -> Driver:
    """Prompt 1 (an edit of prompt 0's block 0) computes both blocks; prompt 0 then recomputes
    block 0 only: slot 1 still holds prompt 1's block 1, whose own tokens equal prompt 0's."""
    d = Driver(Spec(Config(prompts=2, **FULL2), fault))
    d.do("submit", r=0, n=2, p=1).do("lookup", r=0).do("bind", r=0).do("use", r=0)
    d.do("append", r=0, j=0).do("append", r=0, j=1).do("finish", r=0)
    d.do("submit", r=0, n=1, p=0).do("lookup", r=0)
    assert d.spec.decide(d.s, 0)["kind"] == "RECOMPUTE"       # block 0 differs: no hit
    d.do("bind", r=0).do("use", r=0).do("append", r=0, j=0).do("finish", r=0)
    return d.do("submit", r=0, n=2, p=0).do("lookup", r=0)


def test_a_content_hit_needs_the_whole_prefix() -> None:
    d = _content()
    dec = d.spec.decide(d.s, 0)
    assert (dec["kind"], dec["k"], dec["logical"]) == ("REUSE", 1, 1)   # block 1 is another lineage's
    d.do("bind", r=0)
    assert not d.violations()


def test_hash_ignores_parent_reuses_another_prefix_and_is_caught() -> None:
    d = _content("hash_ignores_parent")
    assert d.spec.decide(d.s, 0)["k"] == 2                   # block 1 reused under prompt 0
    d.do("bind", r=0)
    assert {i for i, _ in d.violations()} == {"hit_content_sound"}


def test_a_slot_rewritten_with_other_content_is_rehit_only_with_a_stale_hash() -> None:
    for fault, bad in ((None, set()), ("stale_hash_after_reuse", {"hit_content_sound"})):
        d = Driver(Spec(Config(prompts=2, **FULL2), fault))
        d.do("submit", r=0, n=1, p=0).do("lookup", r=0).do("bind", r=0).do("use", r=0)
        d.do("append", r=0, j=0).do("finish", r=0)
        d.do("submit", r=0, n=1, p=1).do("lookup", r=0).do("bind", r=0).do("use", r=0)
        d.do("append", r=0, j=0).do("finish", r=0)          # slot 0 now holds prompt 1's block
        d.do("submit", r=0, n=1, p=0).do("lookup", r=0)
        assert d.spec.decide(d.s, 0)["k"] == (1 if fault else 0)
        d.do("bind", r=0)
        assert {i for i, _ in d.violations()} == bad


def _salted(fault=None) -> Driver:
    """Prompt 0 computes block 0; prompt 1 (prompt 0's tokens under another salt) looks it up."""
    d = Driver(Spec(Config(prompts=2, salted_prompts=1, **FULL2), fault))
    d.do("submit", r=0, n=1, p=0).do("lookup", r=0).do("bind", r=0).do("use", r=0)
    d.do("append", r=0, j=0).do("finish", r=0)
    return d.do("submit", r=0, n=1, p=1).do("lookup", r=0)


def test_a_salted_prompt_shares_tokens_but_not_blocks() -> None:
    from kvcheck.spec import content
    cfg = Config(prompts=3, salted_prompts=1, **{**FULL2, "blocks": 3})
    assert [content.salted(cfg, p) for p in range(3)] == [False, False, True]
    assert [content.chain(cfg, 2, j) for j in range(3)] == [2, 2, 2]       # differs from block 0 on
    assert [content.local(cfg, 2, j) for j in range(3)] == [0, 0, 0]       # its own tokens agree
    assert [content.chain(cfg, 1, j) for j in range(3)] == [0, 1, 1]       # prompt 1: an edit at block 1
    assert [content.extra_key(cfg, p) for p in range(3)] == [0, 0, 2]
    d = _salted()
    assert d.spec.decide(d.s, 0)["kind"] == "RECOMPUTE"
    d.do("bind", r=0).do("use", r=0).do("append", r=0, j=0)                # rewritten under its salt
    assert d.field("b", 0, "bcid") == 1 and not d.violations()


def test_a_hash_missing_the_salt_reuses_another_tenants_block_and_is_caught() -> None:
    d = _salted("hash_missing_salt")
    assert d.spec.decide(d.s, 0)["kind"] == "REUSE"                      # prompt 0's block, wrong salt
    d.do("bind", r=0)
    assert {i for i, _ in d.violations()} == {"hit_content_sound"}


def test_a_hash_missing_the_salt_plants_nothing_without_a_salted_prompt() -> None:
    from kvcheck.spec.faults import FaultError
    with pytest.raises(FaultError, match="plants nothing"):
        Spec(Config(prompts=2, **FULL2), "hash_missing_salt")


def _restored(fault=None) -> Driver:
    """Prompt 0's block 0 is offloaded, then the slot is rewritten with prompt 1's and evicted;
    the copy (prompt 0's) is prefetched and verified."""
    cfg = Config(prompts=2, **{**FULL2, "tiers": ("device", "disk"), "reserve": 0, "blocks": 1,
                               "requests": 2})
    d = Driver(Spec(cfg, fault))
    d.do("submit", r=0, n=1, p=0).do("lookup", r=0).do("bind", r=0).do("use", r=0).do("append", r=0, j=0)
    d.do("offload_start", j=0).do("offload_ack", j=0).do("finish", r=0)
    assert d.field("b", 0, "dcid") == 0
    d.do("evict", g=0, kind="swa_window", j=0)
    d.do("submit", r=0, n=1, p=1).do("lookup", r=0)
    assert d.spec.decide(d.s, 0)["kind"] == "RECOMPUTE"       # a copy of prompt 0: no prefetch for 1
    d.do("bind", r=0).do("use", r=0).do("append", r=0, j=0).do("finish", r=0)
    assert (d.field("b", 0, "bcid"), d.field("b", 0, "dcid")) == (1, 0)
    d.do("evict", g=0, kind="swa_window", j=0).do("submit", r=0, n=1, p=0).do("lookup", r=0)
    assert d.spec.decide(d.s, 0)["kind"] == "RECOMPUTE"       # the hash names prompt 1's block now
    return d.do("prefetch_start", j=0).do("prefetch_complete", j=0).do("verify_ok", j=0, aligned=1)


def test_an_offloaded_copy_carries_its_content() -> None:
    """The copy is prefetched only for prompt 0, and restoring it restores prompt 0's content."""
    d = _restored()
    assert (d.field("b", 0, "bcid"), d.field("b", 0, "bkey")) == (0, 0)   # restored: prompt 0's
    d.do("preempt", r=0).do("resume", r=0).do("lookup", r=0)   # look up again
    assert d.spec.decide(d.s, 0)["kind"] == "REUSE"
    d.do("bind", r=0)
    assert not d.violations()


def test_a_copy_restored_under_the_slots_old_hash_is_caught() -> None:
    d = _restored("restore_under_stale_key")
    assert (d.field("b", 0, "bcid"), d.field("b", 0, "bkey")) == (0, 1)   # prompt 0's, named 1
    d.do("submit", r=1, n=1, p=1).do("lookup", r=1)
    assert d.spec.decide(d.s, 1)["kind"] == "REUSE"          # prompt 1 reuses prompt 0's block
    d.do("bind", r=1)
    assert {i for i, _ in d.violations()} == {"hit_content_sound"}


def test_a_copy_of_other_content_never_completes_a_live_slot() -> None:
    cfg = Config(prompts=2, **{**FULL2, "tiers": ("device", "disk"), "reserve": 0, "blocks": 1})
    d = Driver(Spec(cfg))
    d.do("submit", r=0, n=1, p=0).do("lookup", r=0).do("bind", r=0).do("use", r=0).do("append", r=0, j=0)
    d.do("offload_start", j=0).do("offload_ack", j=0).do("finish", r=0).do("evict", g=0, kind="swa_window", j=0)
    d.do("prefetch_start", j=0).do("prefetch_complete", j=0)
    d.do("submit", r=0, n=1, p=1).do("lookup", r=0).do("bind", r=0).do("use", r=0).do("append", r=0, j=0)
    assert d.field("b", 0, "bcid") == 1                       # the slot moved on while loading
    assert not d.can("verify_ok", j=0, aligned=1)
    d.do("checksum_fail", j=0)                                # the copy is dropped, never served
    assert not d.violations()


def test_a_pinned_block_is_not_rewritten_with_other_content() -> None:
    d = Driver(Spec(Config(prompts=2, **{**FULL2, "requests": 2})))
    d.do("submit", r=0, n=1, p=0).do("lookup", r=0).do("bind", r=0).do("use", r=0)
    d.do("append", r=0, j=0)                                 # r0 runs on block 0, pinned
    d.do("submit", r=1, n=1, p=1).do("lookup", r=1).do("bind", r=1).do("use", r=1)
    assert not d.can("append", r=1, j=0)                     # another prompt's block: wait


def _decoded(fault=None) -> Driver:
    """Request 0 computes its 1-block prompt, then decodes one token into block 1 (B = 2)."""
    d = Driver(Spec(Config(decode=True, block_size=2, **{**FULL2, "requests": 2}), fault))
    d.do("submit", r=0, n=1).do("lookup", r=0).do("bind", r=0).do("use", r=0).do("append", r=0, j=0)
    return d.do("decode", r=0, j=1)


def test_decode_publishes_a_block_when_it_fills() -> None:
    d = _decoded()
    assert d.field("b", 1, "hashed") == 0 and d.field("r", 0, "rtok") == 1
    d.do("decode", r=0, j=1)                                 # the second token fills block 1
    assert d.field("b", 1, "hashed") == 1 and d.field("r", 0, "rlen") == 2 and d.field("r", 0, "rpos") == 2
    assert d.field("o", 0, "swa_window", 1, "ref") == 1      # and the request holds it
    d.do("finish", r=0).do("submit", r=1, n=2)
    assert d.spec.decide(d.s, 1)["kind"] == "REUSE" and not d.violations()


def test_a_block_published_at_its_first_decoded_token_is_caught() -> None:
    d = _decoded("decode_publishes_partial")
    assert d.field("b", 1, "hashed") == 1                    # published with 1 of its 2 tokens
    d.do("submit", r=1, n=2).do("lookup", r=1).do("bind", r=1)
    assert {i for i, _ in d.violations()} == {"hit_full_blocks"}


# alloc = evict: one SWA group whose window covers one block (W = B = 4), a pool of two pages
# for three blocks: the third append finds the pool full, and block 0 (slid out of the window)
# is the unreferenced cached block the allocation may evict.
SWA3 = dict(layers=(LayerSpec("swa", window=4),), blocks=3, requests=2, tiers=("device",),
            capacity={"swa_window": 2}, reserve=0)


def _full_pool(fault=None, **kw) -> Driver:
    d = Driver(Spec(Config(alloc="evict", **{**SWA3, **kw}), fault))
    d.do("submit", r=0, n=3).do("lookup", r=0).do("bind", r=0).do("use", r=0)
    return d.do("append", r=0, j=0).do("append", r=0, j=1).do("slide", r=0)


@pytest.mark.parametrize("eviction", ["tombstone", "drop_hash"])
def test_an_allocation_into_a_full_pool_evicts_an_unreferenced_block(eviction) -> None:
    d = _full_pool(eviction=eviction)
    assert not d.can("append", r=0, j=2)                      # full: a plain append is not enabled
    assert not d.can("append_evict", r=0, j=2, v=1)           # block 1 is held (in the window)
    d.do("append_evict", r=0, j=2, v=0)
    assert [d.field("o", 0, "swa_window", j, "st") for j in range(3)] == [3, 2, 2]   # evicted, ready, ready
    assert d.field("b", 0, "hashed") == (eviction == "tombstone") and d.field("r", 0, "rpos") == 3
    assert not d.violations()


def test_with_alloc_refuse_a_full_pool_needs_an_eviction_first() -> None:
    d = Driver(Spec(Config(**SWA3)))
    d.do("submit", r=0, n=3).do("lookup", r=0).do("bind", r=0).do("use", r=0)
    d.do("append", r=0, j=0).do("append", r=0, j=1).do("slide", r=0)
    assert "append_evict" not in d.spec.actions and not d.can("append", r=0, j=2)
    d.do("evict", g=0, kind="swa_window", j=0).do("append", r=0, j=2)


def test_an_allocation_with_nothing_evictable_fails_and_preempts() -> None:
    d = Driver(Spec(Config(alloc="evict", **{**SWA3, "layers": (LayerSpec("full"),)})))
    d.do("submit", r=0, n=3).do("lookup", r=0).do("bind", r=0).do("use", r=0)
    d.do("append", r=0, j=0).do("append", r=0, j=1)           # both pages held: nothing to evict
    assert not any(d.can("append_evict", r=0, j=2, v=v) for v in (0, 1))
    assert not d.can("append_fail", r=0, j=2, x=1)            # request 1 holds nothing to free
    d.do("append_fail", r=0, j=2, x=0)
    assert d.field("r", 0, "rst") == 5 and d.field("o", 0, "swa_window", 0, "ref") == 0   # preempted, unpinned
    assert not d.violations()


def test_an_allocation_that_evicts_a_held_block_is_caught() -> None:
    d = _full_pool("alloc_evicts_referenced")
    d.do("append_evict", r=0, j=2, v=1)                       # block 1: still in the window
    assert {i for i, _ in d.violations()} == {"toctou_bound_stable"}
