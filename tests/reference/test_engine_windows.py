"""The reference engine with groups of different sliding windows: each group keeps its own
window start (Request.win, per group), the abstraction function maps them to the spec's window
step, and the engine stays in lockstep with the spec (examples/two-windows.json)."""
from __future__ import annotations

from pathlib import Path

from kvcheck.fuzz.campaign import Budget, run_campaign
from kvcheck.engines.reference.sut import ReferenceSUT
from kvcheck.spec.config import Config, LayerSpec
from kvcheck.spec.system import Spec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "two-windows.json"


def test_each_group_unpins_below_its_own_window_in_lockstep() -> None:
    cfg = Config(layers=(LayerSpec("swa", window=2), LayerSpec("swa", window=4)), block_size=2,
                 blocks=3, requests=1, tiers=("device",), capacity={"swa_window": 6})
    spec, sut = Spec(cfg), ReferenceSUT()
    sut.reset(cfg)
    s = spec.init()
    for a, p in [("submit", {"r": 0, "n": 3}), ("lookup", {"r": 0}), ("bind", {"r": 0}), ("use", {"r": 0}),
                 ("append", {"r": 0, "j": 0}), ("append", {"r": 0, "j": 1}), ("slide", {"r": 0})]:
        x = spec.instance(a, p)
        assert x.guard(s)
        sut.apply(a, p)
        s = x.effect(s)
        assert sut.observe() == s, a
    req = sut.engine.mgr.requests[0]
    assert req.win == (1, 0)                 # W=2 starts at block 1, W=4 still at 0
    held = sorted((o.g, o.j) for o in req.pins)
    assert held == [(0, 1), (1, 0), (1, 1)]
    sut.close()


def test_two_window_campaign_is_clean_and_slides(tmp_path) -> None:
    cfg = Config.load(EXAMPLE)
    assert len(cfg.windows) == 3
    res = run_campaign(cfg, "reference", Budget(steps=1500), seed=0, out=tmp_path)
    assert res["exit_code"] == 0, res["findings"]
    assert res["coverage"]["actions"].get("slide", 0) > 0
