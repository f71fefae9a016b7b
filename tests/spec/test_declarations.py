"""Object kinds and faults are declared once, and the declarations are checked: a misspelled
fault is an error, a fault that plants nothing is an error, every fault names a real site, and
the spec's per-kind rules come from the ObjectKind descriptors."""
from __future__ import annotations

import ast
import pathlib

import pytest

from kvcheck.fuzz import faults as registry
from kvcheck.reference import faults as engine_faults
from kvcheck.engines.reference.sut import ReferenceSUT
from kvcheck.spec import faults as F
from kvcheck.spec.actions import ACTIONS
from kvcheck.spec.config import Config, LayerSpec
from kvcheck.spec.objects import DEVICE_KINDS, KIND, OBJECT_KINDS, OBJECTS, needed_objects
from kvcheck.spec.system import Spec

ROOT = pathlib.Path(__file__).resolve().parents[2] / "kvcheck"


def test_one_registry_lists_every_provider() -> None:
    faults = registry.REGISTRY.all()
    providers = {f.provider for f in faults.values()}
    assert {"spec", "reference", "vllm", "transformers", "sglang"} <= providers
    assert len(faults) == len(F.SPEC_FAULTS) + len(engine_faults.ENGINE_FAULTS) + sum(
        f.provider in ("vllm", "transformers", "sglang") for f in faults.values())
    for f in faults.values():
        assert f.expected and f.site and f.suts, f


def test_misspelled_fault_is_an_error_everywhere() -> None:
    with pytest.raises(F.UnknownFault):
        Spec(Config(), "window_off_by_two")
    with pytest.raises(F.UnknownFault):
        registry.get("window_off_by_two")
    with pytest.raises(ValueError):
        ReferenceSUT(fault="engine_tail_check_skiped")
    with pytest.raises(F.UnknownFault):
        engine_faults.planted("engine_tail_check_skiped")


def test_fault_for_another_sut_names_the_sut() -> None:
    from kvcheck.checker.common import UsageError, check_sut_fault
    with pytest.raises(UsageError) as e:
        check_sut_fault("spec", "engine_tail_check_skipped")
    assert "--sut reference" in str(e.value)
    check_sut_fault("reference", "engine_tail_check_skipped")            # its own SUT: fine
    with pytest.raises(F.UnknownFault):
        Spec(Config(), "engine_tail_check_skipped")       # not a spec fault


def test_fault_that_plants_nothing_is_refused() -> None:
    # No compressed layer: no tail is ever needed, so the tail fault's site is never reached.
    cfg = Config(layers=(LayerSpec("swa", window=6), LayerSpec("full")), capacity={"swa_window": 8})
    with pytest.raises(F.FaultError, match="plants nothing"):
        Spec(cfg, "tail_junction_not_checked")
    Spec(cfg, "window_off_by_one")                        # its site (layer 3's window) is here


def test_each_spec_fault_is_asked_by_its_declared_site() -> None:
    for f in F.SPEC_FAULTS:
        kind, _, name = f.site.partition(":")
        assert kind in ("action", "funnel"), f
        if kind == "action":
            assert name in ACTIONS, f
        spec = Spec(f.config_for(Config()), f.name)
        assert f.name in spec.planted.asked
        if f.needs:     # a fault of a configurable semantic plants nothing with it off: refused
            with pytest.raises(F.FaultError, match="plants nothing"):
                Spec(Config(), f.name)


def test_no_fault_name_compared_as_a_string() -> None:
    """Patch sites ask with the fault's constant: no `fault == "name"` left in the rule text."""
    paths = [*(ROOT / "spec").glob("*.py"), *(ROOT / "reference").glob("*.py"),
             *(ROOT / "fuzz" / "adapters").glob("vllm*.py")]
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                names = [n for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr == "fault"] + \
                        [n for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == "fault"]
                consts = [n for n in node.comparators + [node.left] if isinstance(n, ast.Constant)
                          and isinstance(n.value, str)]
                assert not (names and consts), f"{path.name}:{node.lineno} compares a fault name"


def test_object_kinds_declared_once() -> None:
    assert OBJECT_KINDS == tuple(k.name for k in OBJECTS)
    assert DEVICE_KINDS == tuple(k.name for k in OBJECTS if k.device)
    cfg = Config()
    for g in cfg.groups:
        for k in range(1, cfg.blocks + 1):
            need = needed_objects(cfg, g, k)
            assert set(need) == set(g.objects)
            for kind, blocks in need.items():
                assert blocks == KIND[kind].needed(cfg, g, k)
    # the kinds finished by a later action are exactly those written WRITING
    staged = {k.name for k in OBJECTS if k.device and k.fresh != KIND["swa_window"].fresh}
    assert staged == {k.name for k in OBJECTS if k.finished_by}
    assert {k.finished_by for k in OBJECTS if k.finished_by} <= set(ACTIONS)


def test_no_per_kind_string_switch_outside_the_declarations() -> None:
    """`kind in ("compressed_kv", "indexer")` and the like: only objects.py (the descriptors),
    config.py (the layer -> kinds table) and the reference engine's per-kind managers may name
    kinds in comparisons (fault patches aside, which name the kind they break)."""
    allowed = {"objects.py", "config.py", "kinds.py"}
    kinds = set(OBJECT_KINDS)
    offenders = []
    for path in [p for d in ("spec", "reference", "checker") for p in (ROOT / d).glob("*.py")]:
        if path.name in allowed:
            continue
        src = path.read_text()
        tree = ast.parse(src)
        parent = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            if not {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)} & kinds:
                continue
            if not _inside_fault_patch(node, parent):
                offenders.append(f"{path.name}:{node.lineno}: {ast.get_source_segment(src, node)}")
    assert offenders == []


def _asks_planted(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "planted"
               for n in ast.walk(node))


def _inside_fault_patch(node: ast.AST, parent: dict) -> bool:
    """Inside `if ...planted(F):` (or an `and` with it): a fault patch names the kind it breaks."""
    while node in parent:
        p = parent[node]
        if isinstance(p, (ast.If, ast.IfExp)) and _asks_planted(p.test):
            return True
        if isinstance(p, ast.BoolOp) and _asks_planted(p):
            return True
        if isinstance(p, (ast.FunctionDef, ast.Module)):
            return False
        node = p
    return False
