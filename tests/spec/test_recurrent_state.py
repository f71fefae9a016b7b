"""The recurrent-state rule (objects.RECURRENT_STATE): declared once, judged by adapters, refused
by the spec's state machine in one line, and the default spec untouched."""
from __future__ import annotations

import pytest

from kvcheck.spec.config import Config, ConfigError, LayerSpec
from kvcheck.spec.objects import DEVICE_KINDS, OBJECT_KINDS, needed_objects
from kvcheck.spec.system import Spec


def _hybrid() -> Config:
    return Config(layers=(LayerSpec("full"), LayerSpec("mamba"), LayerSpec("mamba")), block_size=4)


def test_a_resume_reads_the_state_at_the_boundary_and_nothing_older() -> None:
    cfg = _hybrid()
    full, mamba = cfg.groups                       # identical mamba layers share one group
    for k in range(1, 9):
        assert needed_objects(cfg, mamba, k) == {"recurrent_state": [k - 1]}
        assert needed_objects(cfg, full, k) == {"swa_window": list(range(k))}


def test_the_spec_machine_refuses_a_recurrent_layer_in_one_line() -> None:
    with pytest.raises(ConfigError) as e:
        Spec(_hybrid())
    assert "'mamba'" in str(e.value) and "\n" not in str(e.value)


def test_a_recurrent_layer_takes_no_window() -> None:
    with pytest.raises(ConfigError, match=r"layers\[1\] \(mamba\)"):
        Config(layers=(LayerSpec("full"), LayerSpec("mamba", window=4)))
    assert Config.from_dict({"layers": ["full", "mamba"]}).groups[1].objects == ("recurrent_state",)


def test_the_spec_modelled_kinds_are_unchanged() -> None:
    assert "recurrent_state" not in OBJECT_KINDS and "recurrent_state" not in DEVICE_KINDS
    spec = Spec()                                  # the default spec is the same size as before
    assert (len(spec.instances), spec.lay.size) == (130, 238)


def test_the_cli_refuses_a_recurrent_layer_in_one_line(tmp_path) -> None:
    import subprocess
    import sys
    cfg = tmp_path / "c.json"
    cfg.write_text('{"layers": ["full", "mamba"]}')
    from pathlib import Path
    r = subprocess.run([sys.executable, "-m", "kvcheck", "explore", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "'mamba'" in r.stderr
