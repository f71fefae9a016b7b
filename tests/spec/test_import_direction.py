"""The architecture as a test: imports flow one way (spec <- reference <- fuzz <- checker <-
engines), kernels is a leaf, the core imports no engine, there is no import cycle anywhere in
kvcheck/, and no private name (`_x`) is imported across modules. Every import counts, also those
inside functions and under TYPE_CHECKING (a lazy import is still a dependency); strings (a
generated reproducer's text, an entry point's target) do not."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "kvcheck"

FORBIDDEN = {
    "spec": ("reference", "fuzz", "checker", "engines"),
    "reference": ("fuzz", "checker", "engines"),
    "fuzz": ("checker", "engines"),
    "checker": ("engines",),
    "kernels": ("spec", "reference", "fuzz", "checker", "engines"),
}


def _module(path: Path, pkg_dir: Path) -> str:
    rel = path.relative_to(pkg_dir.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(pkg_dir: Path = PKG) -> dict[str, set[str]]:
    """kvcheck module -> the kvcheck modules (or packages) it imports."""
    out: dict[str, set[str]] = {}
    for path in pkg_dir.rglob("*.py"):
        mod = _module(path, pkg_dir)
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                deps.add(target)
                deps.update(f"{target}.{a.name}" for a in node.names)   # `from . import x`
        out[mod] = {d for d in deps if d == "kvcheck" or d.startswith("kvcheck.")}
    return out


def private_imports(pkg_dir: Path = PKG) -> list[str]:
    """`from M import _x` where M is a kvcheck module: a private name used across modules."""
    out = []
    for path in sorted(pkg_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("kvcheck")):
                out += [f"{_module(path, pkg_dir)} imports {a.name} from {'.' * node.level}{node.module or ''}"
                        for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (each holds an import cycle)."""
    import networkx as nx
    g = nx.DiGraph()
    g.add_nodes_from(graph)
    g.add_edges_from((m, d) for m, deps in graph.items() for d in deps if d in graph and d != m)
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"{mod} imports {d}" for mod, deps in sorted(graph.items()) for d in sorted(deps)
            if _layer(d) in FORBIDDEN.get(_layer(mod), ()) or (_layer(mod) == "kernels" and d == "kvcheck")]


def checker_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    mods = {m for m in graph if _layer(m) == "checker"}
    edges = {m: {d for d in graph[m] if d in mods and d != m} for m in mods}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None
    for m in sorted(mods):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_imports_flow_one_way() -> None:
    bad = violations(imports())
    assert not bad, "\n".join(bad)


def test_no_import_cycle_within_checker() -> None:
    cycle = checker_cycle(imports())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_anywhere() -> None:
    found = cycles(imports())
    assert not found, "modules importing each other (a cycle in each):\n" + "\n".join(map(str, found))


def test_no_private_name_imported_across_modules() -> None:
    bad = private_imports()
    assert not bad, "\n".join(bad)


def test_the_engines_are_packages_outside_the_core() -> None:
    """Each of kvcheck's engines is a package under kvcheck/engines/ with an `engine` module;
    the old flat adapters folder is gone."""
    for name in ("reference", "vllm", "sglang", "transformers", "hashchain"):
        assert (PKG / "engines" / name / "engine.py").is_file(), name
    assert not (PKG / "fuzz" / "adapters").exists()


def test_the_checks_find_planted_violations(tmp_path) -> None:
    """Not vacuous: a lazy fuzz -> checker import and a checker cycle are reported."""
    pkg = tmp_path / "kvcheck"
    for sub, name, text in [("fuzz", "camp.py", "def f():\n    from ..checker import common\n"),
                            ("fuzz", "reg.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                               "    from kvcheck.engines.x import engine\n"),
                            ("engines", "x.py", "from ..fuzz.camp import _secret\n"),
                            ("checker", "a.py", "from .b import x\n"),
                            ("checker", "b.py", "def g():\n    from .a import y\n"),
                            ("checker", "common.py", ""),
                            ("kernels", "k.py", "import kvcheck.spec.config\n")]:
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / name).write_text(text)
    graph = imports(pkg)
    assert violations(graph) == ["kvcheck.fuzz.camp imports kvcheck.checker",
                                 "kvcheck.fuzz.camp imports kvcheck.checker.common",
                                 "kvcheck.fuzz.reg imports kvcheck.engines.x",
                                 "kvcheck.fuzz.reg imports kvcheck.engines.x.engine",
                                 "kvcheck.kernels.k imports kvcheck.spec.config"]
    assert checker_cycle(graph) == ["kvcheck.checker.a", "kvcheck.checker.b", "kvcheck.checker.a"]
    assert cycles(graph) == [["kvcheck.checker.a", "kvcheck.checker.b"]]
    assert private_imports(pkg) == ["kvcheck.engines.x imports _secret from ..fuzz.camp"]
