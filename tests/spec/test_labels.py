"""Objects in messages are named in the config's vocabulary: a config whose layers are all full
attention calls its pages `full` (its capacity key), a hybrid one `swa_window` as before."""
from __future__ import annotations

from kvcheck.spec.config import Config, LayerSpec
from kvcheck.spec.state import Layout, ObjSlot


def test_full_attention_pages_are_named_full_and_hybrids_unchanged() -> None:
    full = Layout(Config(layers=(LayerSpec("full"),), capacity={"swa_window": 2}))
    assert full.label(ObjSlot(0, "swa_window", 1)) == "full[g0,b1]"
    assert full.label(ObjSlot(0, "swa_window", 1), block=False) == "full[g0]"
    hybrid = Layout(Config())
    assert hybrid.label(ObjSlot(0, "swa_window", 1)) == "swa_window[g0,b1]"


def test_an_invariant_message_of_a_full_config_says_full() -> None:
    from kvcheck.spec.system import Spec
    spec = Spec(Config(layers=(LayerSpec("full"),), blocks=1, requests=1, tiers=("device",),
                       capacity={"swa_window": 1}))
    s = list(spec.init())
    s[spec.lay.o(0, "swa_window", 0, "ref")] = 1          # a holder nobody is
    assert any("full[g0,b0]" in w for _, w in spec.check(tuple(s)))
