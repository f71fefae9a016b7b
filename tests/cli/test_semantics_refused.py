"""A config using a semantic the reference engine does not implement (prompts > 1, salted
prompts, decode, drop_hash eviction, alloc = evict, duplicates = allow) is refused by `kvcheck fuzz --sut reference` and
`kvcheck diff` in one line naming the key, exit 2: not a flood of divergences."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcheck.spec.config import Config, ConfigError

pytest.importorskip("torch")

SEMANTICS = [({"prompts": 2, "tiers": ["device"]}, "prompts = 2"), ({"decode": True}, "decode = true"),
             ({"eviction": "drop_hash"}, 'eviction = "drop_hash"'), ({"alloc": "evict"}, 'alloc = "evict"'),
             ({"duplicates": "allow"}, 'duplicates = "allow"')]


def _cli(tmp_path, data, *argv):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(data))
    return subprocess.run([sys.executable, "-m", "kvcheck", *argv, "--config", str(cfg), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True)


@pytest.mark.parametrize("data, key", SEMANTICS, ids=[k for _, k in SEMANTICS])
def test_fuzz_reference_refuses_a_semantic_it_does_not_implement(tmp_path, data, key) -> None:
    proc = _cli(tmp_path, data, "fuzz", "--sut", "reference", "--budget", "50")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "reference engine does not implement" in lines[0]
    assert not proc.stdout.strip()


def test_diff_refuses_it_with_the_same_line(tmp_path) -> None:
    proc = _cli(tmp_path, {"alloc": "evict"}, "diff", "--scenarios", "2")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stdout + proc.stderr
    assert 'alloc = "evict": the reference engine does not implement' in proc.stderr


def test_the_default_semantics_pass_and_the_spec_runs_them(tmp_path) -> None:
    Config().refuse_semantics("the reference engine")          # nothing switched on: no error
    with pytest.raises(ConfigError, match="decode = true"):
        Config(decode=True).refuse_semantics("x", implements=("alloc",))
    salted = Config(prompts=2, salted_prompts=1, tiers=("device",))   # an engine with content, no salt
    with pytest.raises(ConfigError, match="salted_prompts = 1: x does not implement"):
        salted.refuse_semantics("x", implements=("prompts",))
    alloc = {"layers": [{"kind": "swa", "window": 4}], "blocks": 3, "tiers": ["device"],
             "capacity": {"swa_window": 2}, "reserve": 0, "alloc": "evict"}
    proc = _cli(tmp_path, alloc, "fuzz", "--sut", "spec", "--budget", "3000")
    # (exit 3: a device-only config never enables the spec's tier actions; nothing is refused)
    assert proc.returncode in (0, 3) and "does not implement" not in proc.stdout + proc.stderr
    never = next(line for line in proc.stdout.splitlines() if "actions exercised" in line)
    assert "append_evict" not in never and "append_fail" not in never, never
