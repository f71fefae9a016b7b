"""The sequence-level adapter shape (kvcheck/engines/hashchain/sequence.py) through its example
(examples/seq_adapter.py on examples/seq_manager.py, examples/seq.json): the planted bug (a hit
serving another block's content) leads with hit_sound_content, the fix is clean, and the bug's
trace replays clean on the fix (`kvcheck replay --without-fault`, exit 0)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcheck.fuzz.campaign import Budget, run_campaign
from kvcheck.fuzz.traces import replay
from kvcheck.spec.config import Config
from kvcheck.spec.severity import lead
from kvcheck.spec.trace import Trace

ROOT = Path(__file__).resolve().parents[2]
SUT = "examples.seq_adapter:Adapter"
CFG = Config.from_dict(json.loads((ROOT / "examples" / "seq.json").read_text()))


@pytest.fixture(autouse=True)
def _path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcheck", *args], capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, cwd=ROOT, timeout=120)


def test_the_mapping_is_short_and_uses_no_base_internals() -> None:
    src = (ROOT / "examples" / "seq_adapter.py").read_text()
    assert len(src.splitlines()) <= 60
    assert "self.req" not in src and "_prompt" not in src and "self.shadow" not in src


def test_planted_bug_leads_fix_clean_and_replays_clean_on_the_fix(tmp_path) -> None:
    res = run_campaign(CFG, SUT, Budget(steps=3000), seed=0, fault="key_without_prefix", out=tmp_path,
                       shrink_seconds=4)
    assert res["exit_code"] == 10 and lead(res["findings"][0]["checks"]) == "hit_sound_content", res["findings"]
    assert res["checks_raised"][0]["check"] == "hit_sound_content"
    path = res["findings"][0]["trace"]
    from examples.seq_adapter import Adapter
    code, out = replay(Trace.load(path), Adapter("key_without_prefix"))
    assert code == 10 and lead(out["finding"]["checks"]) == "hit_sound_content", out
    fix = _cli("replay", path, "--sut", SUT, "--without-fault", "--json")
    assert fix.returncode == 0 and json.loads(fix.stdout)["exit_code"] == 0, fix.stdout + fix.stderr
    clean = run_campaign(CFG, SUT, Budget(steps=3000), seed=0, out=tmp_path / "fix", shrink_seconds=4)
    assert clean["exit_code"] == 0 and clean["checks_raised"] == [], clean["findings"]
    assert not clean["coverage"]["actions_missing"], clean["coverage"]


def test_a_salted_config_is_one_line_exit_2(tmp_path) -> None:
    cfg = tmp_path / "salted.json"
    cfg.write_text(json.dumps({**CFG.to_dict(), "salt": True}))
    bad = _cli("adapter-check", SUT, "--config", str(cfg))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert '"salt": false' in bad.stderr and "declare a `salt` parameter" in bad.stderr


def _salted(tokens, salt):
    return tuple((salt, t) for t in tokens)         # the manager's keys carry the tenant


def _salted_adapter(ignore: bool = False):
    from examples.seq_adapter import Adapter

    class Salted(Adapter):
        """The example manager keyed by (salt, token): callbacks that declare `salt`."""

        def lookup(self, tokens, salt):
            return self.m.match(_salted(tokens, "one" if ignore else salt))

        def admit(self, seq, tokens, salt):
            return self.m.admit(seq, _salted(tokens, "one" if ignore else salt))

        def append(self, seq, tokens, salt):
            return self.m.extend(seq, _salted(tokens, "one" if ignore else salt))
    return Salted


def test_callbacks_declaring_salt_take_the_tenants_salt(tmp_path) -> None:
    """salt = true: the salt reaches the callbacks, a manager keyed by it is clean, one that
    declares the parameter and ignores it serves another tenant's block (UNSAFE HIT); salt =
    false passes none (the example's callbacks, unchanged)."""
    salted = Config.from_dict({**CFG.to_dict(), "salt": True, "salted_prompts": 1})
    seen = []
    Salted = _salted_adapter()

    class Spy(Salted):
        def lookup(self, tokens, salt):
            seen.append(salt)
            return super().lookup(tokens, salt)
    from kvcheck.fuzz.adapter_lint import lint
    clean = lint(salted, "salted", Spy, steps=3000)
    assert clean["exit_code"] == 0 and "finding" not in clean, clean
    assert {"tenant-0", "tenant-2"} <= set(seen)
    bad = lint(salted, "ignores-salt", _salted_adapter(ignore=True), steps=3000)
    assert bad["exit_code"] == 10 and lead(bad["finding"]["checks"]) == "hit_sound_content", bad.get("finding")
    unsalted = Salted()
    unsalted.reset(CFG)
    assert unsalted.salted is False and unsalted._salt("tenant-0") == {}


def test_admit_returning_the_wrong_count_is_named() -> None:
    from examples.seq_adapter import Adapter
    from kvcheck.fuzz.guard import GuardedLockstep, ValuedSpecModel
    from kvcheck.spec.system import Spec

    class Short(Adapter):
        def admit(self, seq, tokens):
            got = super().admit(seq, tokens)
            return got[:-1] if got else got

    model = ValuedSpecModel(Spec(CFG))
    sut = Short()
    core = GuardedLockstep(model, sut)
    sut.reset(CFG)
    prog = [("submit", {"r": 0, "n": 1, "p": 0}), ("lookup", {"r": 0}), ("bind", {"r": 0}), ("use", {"r": 0}),
            ("append", {"r": 0, "j": 0}), ("finish", {"r": 0}),
            ("submit", {"r": 1, "n": 1, "p": 0}), ("lookup", {"r": 1}), ("bind", {"r": 1})]
    with pytest.raises(TypeError, match=r"admit\(\) must return 1 block ids .* got \[\]"):
        core.run([model.step(a, p) for a, p in prog])     # (a campaign reports it as sut_raised)


def test_capacity_by_the_layer_kind() -> None:
    from kvcheck.spec.config import ConfigError
    assert json.loads((ROOT / "examples" / "seq.json").read_text())["capacity"] == {"full": 2}
    assert CFG.cap("swa_window") == 2 and CFG.to_dict()["capacity"] == {"swa_window": 2}
    with pytest.raises(ConfigError, match="every layer full"):
        Config.from_dict({"layers": [{"kind": "full"}, {"kind": "swa", "window": 2}], "capacity": {"full": 2}})
