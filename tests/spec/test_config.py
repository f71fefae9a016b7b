from __future__ import annotations

import json

import pytest

from kvcheck.spec.config import Config, ConfigError


def test_default_groups_and_roundtrip() -> None:
    cfg = Config()
    assert [g.kind for g in cfg.groups] == ["swa", "csa", "hca", "full"]
    assert cfg.groups[1].layers == (1, 3)          # the two csa layers share a cache group
    assert Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("data, msg", [
    ({"layers": [{"kind": "swa", "window": 0}]}, "window must be >= 1"),
    ({"layers": [{"kind": "hca", "window": 4, "m": 6}]}, "must nest"),
    ({"layers": [{"kind": "csa", "window": 4, "m": 4}]}, "topk"),
    ({"layers": [{"kind": "rwkv"}]}, "unknown layer kind"),
    ({"layers": [{"kind": "mamba", "window": 4}]}, "takes no window"),
    ({"capacity": {"tail": -1}}, "non-negative"),
    ({"capacity": {"gpu": 3}}, "unknown object kind"),
    ({"blocks": 0}, "blocks must be"),
    ({"windw": 3}, "unknown key"),
    ({"layers": [{"kind": "swa", "window": 4, "size": 2}]}, "unknown key"),
    ({"page_tokens": {"swa": 6}}, "multiple of block_size"),
    ({"tiers": ["host"]}, "must include 'device'"),
    ([1, 2], "JSON object"),
])
def test_bad_configs_are_one_line_errors(data, msg) -> None:
    with pytest.raises(ConfigError) as e:
        Config.from_dict(data)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_load_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        Config.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Config.load(bad)


def test_lcm_alignment_from_page_sizes() -> None:
    cfg = Config(page_tokens={"hca": 8})
    assert cfg.align_blocks == 2
    assert Config().align_blocks == 1


def test_tail_and_entry_placement() -> None:
    cfg = Config()
    csa, hca = cfg.groups[1], cfg.groups[2]                 # m = 8 and 16, block size 4
    assert [cfg.has_compressed(csa, j) for j in range(4)] == [False, True, False, True]
    assert [cfg.needs_tail(hca, j) for j in range(4)] == [True, True, True, False]
    assert cfg.tail_start_block(hca, 3) == 0
    assert cfg.window_lo_block(6, 4) == 2 and cfg.window_lo_block(None, 4) == 0


def test_window_steps_keep_every_groups_window_start() -> None:
    """A request's retained windows are one step of a table of every group's window start.
    With one finite window the step is that window's first block (so rwin reads as before);
    with several, each group moves on its own; without any, there is one step (nothing slides)."""
    from kvcheck.spec.config import LayerSpec
    cfg = Config()                       # W=6 for swa and the csa/hca branches, full: 0
    assert [cfg.window_step(k) for k in range(5)] == [cfg.window_lo_block(6, k) for k in range(5)]
    two = Config(layers=(LayerSpec("swa", window=2), LayerSpec("swa", window=4), LayerSpec("full")),
                 block_size=2, blocks=3)
    assert two.windows == (2, 4)
    assert two.window_steps() == ((0, 0, 0), (1, 0, 0), (2, 1, 0))
    assert [two.window_step(k) for k in range(4)] == [0, 0, 1, 2]
    assert Config(layers=(LayerSpec("full"),)).window_steps() == ((0,),)
    assert Config(layers=(LayerSpec("swa", window=3), LayerSpec("csa", window=9, m=4, topk=1))).windows == (3, 9)