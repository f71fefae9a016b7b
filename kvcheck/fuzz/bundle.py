"""Freeze a few of kvcheck's modules into a standalone script, as readable text.

A standalone reproducer must run where only the engine is installed. When what it replays needs
kvcheck's own driver (the scheduler drive builds the engine's scheduler on CPU; rewriting that
driver per script would be a second copy to drift), the script carries the driver's modules:
their import closure inside kvcheck (module-level imports, parent packages included), each line
written as a comment (`#| `) under a `# >>> module NAME` marker, so the text is read, never run,
until the script's `install()` (written here too) serves them to `import` from the script's own
file. Nothing outside kvcheck is carried: the engine and the standard library are the machine's.
Only module-level imports are followed: a kvcheck module imported inside a function is not frozen
(where kvcheck is installed too, that one import would come from the installed copy).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = "kvcheck"
MARK = "# >>> module "


def _file(name: str) -> tuple[Path, bool] | None:
    """(source file, is a package) of kvcheck module `name`, found on disk (nothing imported)."""
    base = Path(__file__).resolve().parents[1].joinpath(*name.split(".")[1:])
    if name.split(".")[0] != ROOT:
        return None
    if (base / "__init__.py").is_file():
        return base / "__init__.py", True
    return (base.with_suffix(".py"), False) if base.with_suffix(".py").is_file() else None


def _imports(name: str, path: Path, is_pkg: bool) -> set[str]:
    """The kvcheck modules `name` imports when it is imported (its top level, not its functions,
    not under `if TYPE_CHECKING:`)."""
    out: set[str] = set()
    here = name if is_pkg else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.If, ast.Try)):
            stack += node.body + node.orelse + getattr(node, "finalbody", []) + \
                [s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names if _file(f"{base}.{a.name}") is not None}
    return {m for m in out if m == ROOT or m.startswith(ROOT + ".")}


def closure(roots: list[str]) -> list[str]:
    """Every kvcheck module importing `roots` imports, parents first, sorted."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        found = _file(name)
        if found is None:
            raise ImportError(f"bundle: {name} is not a kvcheck source module")
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += sorted(_imports(name, *found))
    return sorted(seen)


def bundle_text(roots: list[str]) -> str:
    """The modules of `closure(roots)` as commented text, one marker line each."""
    out = []
    for name in closure(roots):
        path, is_pkg = _file(name)      # type: ignore[misc]
        out.append(f"{MARK}{name}{' (package)' if is_pkg else ''}")
        out += [f"#| {line}".rstrip() for line in path.read_text().splitlines()]
    return "\n".join(out) + "\n"


INSTALLER = '''
def install():
    """Serve the kvcheck modules frozen at the end of this file to `import` (they come first)."""
    import importlib.abc
    import importlib.util
    mods, name = {}, None
    for line in open(__file__, encoding="utf-8").read().splitlines():
        if line.startswith("# >>> module "):
            name = line[len("# >>> module "):]
            mods[name] = []
        elif name is not None and line.startswith("#|"):
            mods[name].append(line[3:])

    class Frozen(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path=None, target=None):
            for key in (fullname, fullname + " (package)"):
                if key in mods:
                    return importlib.util.spec_from_loader(fullname, self, is_package=key != fullname)
            return None

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            key = module.__name__ if module.__name__ in mods else module.__name__ + " (package)"
            module.__file__ = __file__ + "/" + module.__name__.replace(".", "/") + ".py"
            exec(compile("\\n".join(mods[key]) + "\\n", module.__file__, "exec"), module.__dict__)

    sys.meta_path.insert(0, Frozen())
'''
