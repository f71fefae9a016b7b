"""A third party's engine ships as its own package: examples/kvcheck-toyengine, installed into a
fresh virtual environment layered over kvcheck's, is listed by `kvcheck engines` next to
kvcheck's own engines and fuzzed by `kvcheck fuzz --sut toyengine`. A broken entry point is
reported under `load_errors` and changes nothing else. The registry's refusals (not an Engine,
a wrong name, a taken name) are unit-tested without a venv, on faked entry points."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import types
from importlib.metadata import EntryPoint, EntryPoints
from pathlib import Path

import pytest

from kvcheck.checker.cli import main
from kvcheck.fuzz import registry
from kvcheck.fuzz.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "examples" / "kvcheck-toyengine"
OWN = {"reference", "vllm", "sglang", "transformers", "hashchain"}


def _run(cmd: list, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", CI="1")
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> types.SimpleNamespace:
    """A venv whose own site-packages has kvcheck-toyengine (pip, no index, no build isolation)
    and a hand-written dist-info whose entry point names a missing module; kvcheck and its
    dependencies come from the running environment through a .pth (as scripts/install-vllm.sh
    layers a side environment), processed with site.addsitedir so that an editable kvcheck's
    own .pth hook runs too."""
    for needed in ("pip", "setuptools"):      # pip installs, setuptools builds (no index, no isolation)
        # package metadata, not importlib.util.find_spec: asking the import system for "pip"
        # trips setuptools' distutils hack for the whole process (a later vLLM import then fails)
        try:
            importlib.metadata.version(needed)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{needed} is not installed in kvcheck's environment")
    root = tmp_path_factory.mktemp("plugin")
    venv = root / "venv"
    r = _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    assert r.returncode == 0, r.stderr
    py = venv / "bin" / "python"
    site_dir = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         cwd=root).stdout.strip())
    base = sysconfig.get_paths()["purelib"]
    (site_dir / "zz-kvcheck-base.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    # build from a copy: setuptools writes build/ and *.egg-info next to the sources
    src = root / "src"
    shutil.copytree(PKG, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    r = _run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", src], cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    broken = site_dir / "kvcheck_brokenengine-0.0.1.dist-info"
    broken.mkdir()
    (broken / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcheck-brokenengine\nVersion: 0.0.1\n")
    (broken / "entry_points.txt").write_text(
        "[kvcheck.engines]\nbrokenengine = kvcheck_brokenengine_missing.engine:ENGINE\n")
    return types.SimpleNamespace(root=root, py=py, site=site_dir)


def test_installed_plugin_is_listed_beside_kvcheck_engines_and_a_broken_one_is_reported(plugin_env) -> None:
    r = _run([plugin_env.py, "-m", "kvcheck", "engines", "--json"], cwd=plugin_env.root)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    rows = {row["name"]: row for row in data["engines"]}
    assert OWN | {"toyengine"} <= set(rows) and "brokenengine" not in rows
    toy = rows["toyengine"]
    version = tomllib.loads((PKG / "pyproject.toml").read_text())["project"]["version"]
    assert toy["release"] == version
    assert toy["layout_count"] == 2 and "layouts" not in toy          # the table only with --layouts
    assert toy["faults"] == ["toy_hash_only_hit"] and "errors" not in toy
    assert toy["module"] == "kvcheck_toyengine.engine"
    assert (ROOT / toy["docs"]).is_file()
    # the plugin comes after kvcheck's own (registry order), and the broken one is only an error
    assert [row["name"] for row in data["engines"]][-1] == "toyengine"
    assert set(data["load_errors"]) == {"brokenengine"}
    why = data["load_errors"]["brokenengine"]
    assert "kvcheck_brokenengine_missing.engine:ENGINE" in why and "ModuleNotFoundError" in why
    assert data["entry_point_group"] == "kvcheck.engines"


def test_installed_plugin_fuzzes_with_its_own_layout(plugin_env, tmp_path) -> None:
    r = _run([plugin_env.py, "-m", "kvcheck", "engines", "toyengine", "--layouts", "--json"], cwd=plugin_env.root)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["engines"]
    assert set(row["layouts"]) == {"tiny", "tight"}
    config = re.match(r"--config (\S+) ", row["layouts"]["tiny"]).group(1)
    assert Path(config).is_relative_to(plugin_env.site)           # shipped in the installed package
    r = _run([plugin_env.py, "-m", "kvcheck", "fuzz", "--sut", "toyengine", "--config", config,
              "--budget", "1000", "--json", "--out", tmp_path / "report"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    res = json.loads(r.stdout)
    assert res["exit_code"] == 0 and res["findings"] == [] and res["steps"] >= 1000
    assert {"lookup", "bind", "append", "evict", "finish"} <= set(res["coverage"]["actions"])
    assert res["coverage"]["decisions"]["REUSE"] > 0
    # kvcheck's default config (a hybrid with host and disk tiers) is refused in one line
    r = _run([plugin_env.py, "-m", "kvcheck", "fuzz", "--sut", "toyengine", "--budget", "100",
              "--out", tmp_path / "report"], cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and "toyengine caches one full-attention layer" in r.stderr
    assert config in r.stderr
    # a project file names the plugin like a built-in system: its campaign and its planted fault
    (tmp_path / "kvcheck.toml").write_text(
        f'[systems.toyengine]\nconfig = "{config}"\nengines = ["fuzz"]\nbudget = 600\n'
        'expected_faults = ["toy_hash_only_hit"]\nfault_budget = "20s"\n')
    r = _run([plugin_env.py, "-m", "kvcheck", "gate", "--json", "--out", tmp_path / "gate"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    checks = {c["check"]: c["verdict"] for c in json.loads(r.stdout)["checks"] if c["system"] == "toyengine"}
    assert checks["coverage"] == "passed" and checks["expected_fault:toy_hash_only_hit"] == "passed", checks


def test_plugin_is_not_registered_in_kvcheck_own_environment() -> None:
    registry.reset()
    try:
        assert OWN <= set(registry.engines())
        assert "toyengine" not in registry.engines() and "toyengine" not in registry.load_errors()
        with pytest.raises(registry.UnknownEngine, match="unknown engine 'toyengine'"):
            registry.get("toyengine")
    finally:
        registry.reset()


# ---- the registry on faked entry points ---------------------------------------------------


class _Plugin(Engine):
    name = "plugin"


class _Other(Engine):
    name = "other"


class _Shadow(Engine):
    name = "reference"


class _NotAnEngine:
    name = "notanengine"


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Register these (name, "MODULE:ATTR") entry points, and only these, for the registry."""
    mod = types.ModuleType("fake_kvcheck_plugin")
    mod.PLUGIN, mod.PLUGIN_CLASS, mod.OTHER, mod.SHADOW = _Plugin(), _Plugin, _Other(), _Shadow()
    mod.NOT_ENGINE, mod.NOT_ENGINE_CLASS = object(), _NotAnEngine
    monkeypatch.setitem(sys.modules, mod.__name__, mod)

    def install(*eps: tuple[str, str]) -> None:
        fake = [EntryPoint(name, value, registry.GROUP) for name, value in eps]
        monkeypatch.setattr(registry, "metadata", types.SimpleNamespace(
            entry_points=lambda **params: EntryPoints(fake).select(**params)))
        registry.reset()
    yield install
    registry.reset()                    # forget the fakes: the next lookup loads the real ones


def test_registry_lists_good_entry_points_an_instance_or_a_class(fake_entry_points) -> None:
    fake_entry_points(("plugin", "fake_kvcheck_plugin:PLUGIN"))
    assert list(registry.engines()) == ["plugin"] and registry.load_errors() == {}
    fake_entry_points(("plugin", "fake_kvcheck_plugin:PLUGIN_CLASS"))     # a class is instantiated
    assert isinstance(registry.get("plugin"), _Plugin) and registry.load_errors() == {}


def test_registry_refuses_what_is_not_an_engine_a_wrong_name_and_a_taken_name(fake_entry_points) -> None:
    fake_entry_points(
        ("reference", "fake_kvcheck_plugin:SHADOW"),                # before kvcheck's own, still second
        ("notengine", "fake_kvcheck_plugin:NOT_ENGINE"),
        ("notengineclass", "fake_kvcheck_plugin:NOT_ENGINE_CLASS"),
        ("misnamed", "fake_kvcheck_plugin:OTHER"),
        ("plugin", "fake_kvcheck_plugin:PLUGIN"),
        ("plugin", "fake_kvcheck_plugin:PLUGIN_CLASS"),
        ("missing", "fake_kvcheck_plugin_gone.engine:ENGINE"),
        ("reference", "kvcheck.engines.reference.engine:ENGINE"),
    )
    found = registry.engines()
    assert list(found) == ["reference", "plugin"]
    assert type(found["reference"]).__module__ == "kvcheck.engines.reference.engine"   # not shadowed
    errors = registry.load_errors()
    assert set(errors) == {"reference", "notengine", "notengineclass", "misnamed", "plugin", "missing"}
    for name in ("notengine", "notengineclass"):
        assert "TypeError" in errors[name] and "not a kvcheck.fuzz.engine.Engine" in errors[name]
    assert errors["notengine"].startswith("fake_kvcheck_plugin:NOT_ENGINE: ")
    assert "_NotAnEngine" in errors["notengineclass"]
    assert errors["misnamed"].startswith("fake_kvcheck_plugin:OTHER: ValueError")
    assert "'other'" in errors["misnamed"] and "'misnamed'" in errors["misnamed"]
    assert errors["plugin"].startswith("fake_kvcheck_plugin:PLUGIN_CLASS: ") and __name__ in errors["plugin"]
    assert errors["reference"].startswith("fake_kvcheck_plugin:SHADOW: ")
    assert "kvcheck.engines.reference.engine" in errors["reference"]
    assert "ModuleNotFoundError" in errors["missing"]
    with pytest.raises(registry.UnknownEngine, match=r"unknown engine 'misnamed' \(fake_kvcheck_plugin:OTHER: "
                                                     r"ValueError.*registered: reference, plugin"):
        registry.get("misnamed")


def test_kvcheck_engines_lists_the_rest_and_exits_0_when_entry_points_fail(fake_entry_points, capsys) -> None:
    fake_entry_points(("plugin", "fake_kvcheck_plugin:PLUGIN"), ("notengine", "fake_kvcheck_plugin:NOT_ENGINE"),
                      ("missing", "fake_kvcheck_plugin_gone.engine:ENGINE"))
    assert main(["engines", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in data["engines"]] == ["plugin"]
    assert set(data["load_errors"]) == {"notengine", "missing"}
    assert main(["engines"]) == 0
    text = capsys.readouterr().out
    assert "1 engine(s) registered" in text
    assert re.search(r"^  notengine +FAILED TO LOAD: fake_kvcheck_plugin:NOT_ENGINE: TypeError", text, re.M)
    assert re.search(r"^  missing +FAILED TO LOAD: .*ModuleNotFoundError", text, re.M)
