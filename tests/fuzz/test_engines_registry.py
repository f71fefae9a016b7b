"""The engine registry as the core sees it: kvcheck's own engines come through the
`kvcheck.engines` entry points, their faults make up the one fault registry, `--sut NAME`
resolves through it, old module paths in traces still resolve, and what an engine does not
have is one clear line (exit 2)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvcheck.fuzz import faults as faultlib
from kvcheck.fuzz import registry
from kvcheck.fuzz.engine import Engine
from kvcheck.fuzz.suts import SutError, resolve_sut

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from badinput import assert_bad_input, run  # noqa: E402

OWN = ("reference", "vllm", "sglang", "transformers", "hashchain")


def test_kvchecks_own_engines_come_through_the_entry_points() -> None:
    found = registry.engines()
    assert set(OWN) <= set(found), found
    assert not {n: e for n, e in registry.load_errors().items() if n in OWN}
    for name in OWN:
        eng = found[name]
        assert isinstance(eng, Engine) and eng.name == name
        assert type(eng).__module__ == f"kvcheck.engines.{name}.engine"


def test_the_fault_registry_is_the_spec_and_every_engine() -> None:
    every = faultlib.FAULTS
    for name, eng in registry.engines().items():
        for f in eng.faults():
            assert every[f.name] is f and f.provider == name
    assert {f.provider for f in every.values()} >= {"spec", "reference", "vllm", "sglang", "transformers"}


def test_describe_never_raises_and_counts() -> None:
    rows = {n: e.describe() for n, e in registry.engines().items()}
    assert rows["vllm"]["layout_count"] == len(registry.get("vllm").layouts()) > 20
    assert rows["reference"]["faults"] and rows["reference"]["release"]

    class Broken(Engine):
        name = "broken"

        def layouts(self) -> dict[str, str]:
            raise RuntimeError("no layouts here")
    row = Broken().describe()
    assert row["layout_count"] == 0 and "no layouts here" in row["errors"]["layouts"]


def test_sut_by_engine_name_and_by_old_module_path() -> None:
    ref = resolve_sut("reference").cls                               # type: ignore[attr-defined]
    assert ref.__module__ == "kvcheck.engines.reference.sut"
    # a trace written before the engines became packages names the old module
    assert resolve_sut("kvcheck.reference.adapter:ReferenceSUT").cls is ref  # type: ignore[attr-defined]
    old = resolve_sut("kvcheck.fuzz.hashchain:HashChainAdapter").cls            # type: ignore[attr-defined]
    assert old.__module__ == "kvcheck.engines.hashchain.base"
    assert registry.legacy_module("kvcheck.fuzz.adapters.vllm_layouts") == "kvcheck.engines.vllm.layouts"
    assert registry.legacy_module("kvcheck.fuzz.adapters.sglang") == "kvcheck.engines.sglang.drivers"
    with pytest.raises(SutError, match="its own driver"):
        resolve_sut("vllm")
    with pytest.raises(SutError, match="unknown system under test 'nosuch'"):
        resolve_sut("nosuch")


def test_kvcheck_engines_lists_them(capsys) -> None:
    code, out, _ = run(capsys, "engines", "--json")
    assert code == 0
    data = json.loads(out)
    names = [r["name"] for r in data["engines"]]
    assert set(OWN) <= set(names)
    vllm = next(r for r in data["engines"] if r["name"] == "vllm")
    assert vllm["docs"] == "docs/adapters-vllm.md" and "drop_ref_on_free" in vllm["faults"]
    code, out, _ = run(capsys, "engines", "vllm", "--layouts")
    assert code == 0 and "full+swa" in out and "reference" not in out.splitlines()[1]
    assert_bad_input(*run(capsys, "engines", "nosuch")[::2], "unknown engine 'nosuch'")


def test_what_an_engine_lacks_is_one_line(capsys) -> None:
    code, _, err = run(capsys, "fuzz", "--sut", "hashchain", "--budget", "5")
    assert_bad_input(code, err, "--sut hashchain", "no SUT class")
    code, _, err = run(capsys, "diff", "--sut", "vllm")
    assert_bad_input(code, err, "no reuse-vs-recompute model", "reference", "transformers")
    code, _, err = run(capsys, "diff", "--sut", "nosuch")
    assert_bad_input(code, err, "unknown engine 'nosuch'")
    code, _, err = run(capsys, "fuzz", "--sut", "reference", "--sched-policy", "priority")
    assert_bad_input(code, err, "--sched-policy applies to --sut vllm only")
    code, _, err = run(capsys, "fuzz", "--sut", "sglang", "--workload", "chat")
    assert_bad_input(code, err, "--workload applies to --sut vllm only")


def test_the_release_ranges_the_engines_declare_are_the_ones_their_drivers_test():
    """`kvcheck matrix` reads Engine.release_range; the drivers' OLDEST/NEWEST are the same."""
    from kvcheck.engines.sglang import install
    from kvcheck.engines.vllm import runtime
    from kvcheck.fuzz import registry
    assert registry.get("vllm").release_range == (runtime.OLDEST, runtime.NEWEST)
    assert registry.get("sglang").release_range == (install.OLDEST, install.NEWEST)
    for name in ("vllm", "sglang"):
        e = registry.get(name)
        assert e.packages == (name,) and e.distribution == name
        assert (Path(__file__).resolve().parents[2] / e.install_script).is_file()
