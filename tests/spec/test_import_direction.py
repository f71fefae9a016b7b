"""The architecture as a test: imports flow one way (spec <- reference <- fuzz <- checker),
kernels is a leaf, and checker/ has no import cycle. Every import counts, also those inside
functions (a lazy import is still a dependency); strings (a generated reproducer's text) do not."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "kvcheck"

FORBIDDEN = {
    "spec": ("reference", "fuzz", "checker"),
    "reference": ("fuzz", "checker"),
    "fuzz": ("checker",),
    "kernels": ("spec", "reference", "fuzz", "checker"),
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


def test_the_checks_find_planted_violations(tmp_path) -> None:
    """Not vacuous: a lazy fuzz -> checker import and a checker cycle are reported."""
    pkg = tmp_path / "kvcheck"
    for sub, name, text in [("fuzz", "camp.py", "def f():\n    from ..checker import common\n"),
                            ("checker", "a.py", "from .b import x\n"),
                            ("checker", "b.py", "def g():\n    from .a import y\n"),
                            ("checker", "common.py", ""),
                            ("kernels", "k.py", "import kvcheck.spec.config\n")]:
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / name).write_text(text)
    graph = imports(pkg)
    assert violations(graph) == ["kvcheck.fuzz.camp imports kvcheck.checker",
                                 "kvcheck.fuzz.camp imports kvcheck.checker.common",
                                 "kvcheck.kernels.k imports kvcheck.spec.config"]
    assert checker_cycle(graph) == ["kvcheck.checker.a", "kvcheck.checker.b", "kvcheck.checker.a"]
