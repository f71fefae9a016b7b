"""The configurable semantics on the reference engine from the command line: it implements
prompts > 1, decode, drop_hash eviction and alloc = evict (`kvcheck fuzz --sut reference` runs
them), and a semantic it does not implement is refused by `kvcheck fuzz --sut reference` and
`kvcheck diff` in one line naming the key, exit 2: not a flood of divergences. `duplicates = "allow"`
is outside the reference's `IMPLEMENTS`: refused for real; the others are shown refused with
one taken out of it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcheck.spec.config import Config, ConfigError

pytest.importorskip("torch")

SEMANTICS = [({"prompts": 2, "tiers": ["device"]}, "prompts = 2"), ({"decode": True}, "decode = true"),
             ({"eviction": "drop_hash"}, 'eviction = "drop_hash"'), ({"alloc": "evict"}, 'alloc = "evict"')]
SMALL = {"layers": [{"kind": "swa", "window": 4}], "blocks": 3, "tiers": ["device"]}


def _cli(tmp_path, data, *argv, lacks: str | None = None):
    """`kvcheck ARGV --config` over `data`; `lacks`: that semantic taken out of the reference's
    IMPLEMENTS first (as an engine that does not implement it)."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(data))
    pre = ("import kvcheck.engines.reference.sut as a; "
           f"a.IMPLEMENTS = tuple(k for k in a.IMPLEMENTS if k != {lacks!r}); ") if lacks else ""
    code = pre + "from kvcheck.checker.cli import entry; entry()"
    return subprocess.run([sys.executable, "-c", code, *argv, "--config", str(cfg), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True)


def test_fuzz_reference_runs_the_semantics(tmp_path) -> None:
    """All four at once (each alone: tests/reference/test_engine_semantics.py)."""
    data = {k: v for d, _ in SEMANTICS for k, v in d.items()}
    proc = _cli(tmp_path, {**SMALL, **data}, "fuzz", "--sut", "reference", "--budget", "300")
    # (exit 3 allowed: 300 steps need not reach every declared action)
    assert proc.returncode in (0, 3), proc.stdout + proc.stderr
    assert "FINDING" not in proc.stdout and "does not implement" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("data, key", SEMANTICS[1:2], ids=[k for _, k in SEMANTICS[1:2]])
def test_fuzz_reference_refuses_a_semantic_it_does_not_implement(tmp_path, data, key) -> None:
    proc = _cli(tmp_path, data, "fuzz", "--sut", "reference", "--budget", "50", lacks="decode")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "reference engine does not implement" in lines[0]
    assert not proc.stdout.strip()


def test_diff_refuses_it_with_the_same_line(tmp_path) -> None:
    proc = _cli(tmp_path, {"alloc": "evict"}, "diff", "--scenarios", "2", lacks="alloc")
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


@pytest.mark.parametrize("data, key", [({"duplicates": "allow"}, 'duplicates = "allow"')])
def test_fuzz_reference_refuses_duplicates(tmp_path, data, key) -> None:
    proc = _cli(tmp_path, {**SMALL, **data}, "fuzz", "--sut", "reference", "--budget", "50")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "reference engine does not implement" in lines[0], lines


def test_fuzz_reference_refuses_content_on_a_disk_tier(tmp_path) -> None:
    proc = _cli(tmp_path, {"layers": [{"kind": "swa", "window": 4}], "blocks": 2, "prompts": 2},
                "fuzz", "--sut", "reference", "--budget", "50")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stdout + proc.stderr
    assert "prompts = 2 with tiers" in proc.stderr and "reference engine does not implement" in proc.stderr
