"""Late publishing (config `publish = "release"`): an engine that publishes a block's hash only
when the request holding it releases it (finish, preempt). `append` writes the block
unpublished; a second request cannot find it and computes its own copy (`append_copy`, never
a shared `append`); the release publishes the positions whose slot still holds the request's
content. The default ("append") is the spec byte for byte; a release that publishes a slot
rewritten meanwhile is caught (`late_publish_reused_slot`, hit_content_sound)."""
from __future__ import annotations

import pytest

from kvcheck.spec.config import Config, ConfigError, LayerSpec
from kvcheck.spec.faults import FAULTS
from kvcheck.spec.system import Spec

from scenario import Driver

LATE = dict(layers=(LayerSpec("full"),), blocks=2, requests=2, tiers=("device",),
            capacity={"swa_window": 3}, max_active=2, reserve=0, duplicates="allow", publish="release")


def _running(d: Driver, r: int, n: int, **p: int) -> Driver:
    return d.do("submit", r=r, n=n, **p).do("lookup", r=r).do("bind", r=r).do("use", r=r)


def test_bad_publish_values_are_one_line_errors() -> None:
    for bad, msg in (("finish", "publish must be one of append, release"), (1, "publish must be one of"),
                     ("release", 'needs duplicates = "allow"')):
        with pytest.raises(ConfigError, match=msg) as e:
            Config.from_dict({"publish": bad})
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="decode = false"):
        Config.from_dict({"publish": "release", "duplicates": "allow", "decode": True})


def test_append_is_the_default_spec_byte_for_byte() -> None:
    spec = Spec(Config())
    assert (len(spec.instances), spec.lay.size) == (130, 238)
    assert "publish" not in Config().to_dict()
    on = Config(**LATE)
    assert Config.from_dict(on.to_dict()) == on and on.semantics()["publish"] == "release"


def test_a_written_block_is_published_at_release_and_copied_meanwhile() -> None:
    d = _running(Driver(Spec(Config(**LATE))), 0, 1).do("append", r=0, j=0)
    assert d.field("b", 0, "hashed") == 0                          # written, not published
    _running(d, 1, 1)
    assert d.field("r", 1, "rk") == 0                              # a lookup cannot see it
    assert not d.can("append", r=1, j=0)                           # nor can its append share it
    d.do("append_copy", r=1, j=0)
    assert d.field("o", 0, "swa_window", 0, "dup") == 1
    d.do("finish", r=0)
    assert d.field("b", 0, "hashed") == 1 and not d.violations()   # published at release
    d.do("preempt", r=1).do("evict_copy", g=0, kind="swa_window", j=0)
    _running(d, 0, 1)
    assert d.field("r", 0, "rk") == 1 and not d.violations()


def test_preempt_publishes_too() -> None:
    d = _running(Driver(Spec(Config(**LATE))), 0, 2).do("append", r=0, j=0).do("preempt", r=0)
    assert d.field("b", 0, "hashed") == 1


def test_a_release_publishing_a_rewritten_slot_is_caught() -> None:
    f = FAULTS["late_publish_reused_slot"]
    cfg = f.config_for(Config())

    def run(fault):
        d = _running(Driver(Spec(cfg, fault)), 0, 2, p=0).do("append", r=0, j=0).do("append", r=0, j=1)
        d.do("slide", r=0)                                          # block 0 leaves r0's window
        _running(d, 1, 1, p=1).do("append", r=1, j=0)               # prompt 1 rewrites slot 0
        return d.do("finish", r=0).do("submit", r=0, n=1, p=0).do("lookup", r=0)   # r1 still runs

    d = run(None)
    assert d.field("r", 0, "rk") == 0 and not d.violations()        # slot 0 is prompt 1's: unpublished
    d = run(f.name).do("bind", r=0)
    assert {i for i, _ in d.violations()} == {"hit_content_sound"}
