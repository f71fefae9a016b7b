"""kvcheck/fuzz/bundle.py: kvcheck modules frozen into a standalone script as commented text."""
from __future__ import annotations

import subprocess
import sys

from kvcheck.fuzz.bundle import INSTALLER, MARK, bundle_text, closure


def test_the_closure_is_the_import_closure_inside_kvcheck_parents_first():
    mods = closure(["kvcheck.engines.sglang.scheduler.adapter"])
    assert mods == sorted(mods) and mods[0] == "kvcheck"
    for m in mods:                     # every parent package comes with its module
        parts = m.split(".")
        assert all(".".join(parts[:i]) in mods for i in range(1, len(parts)))
    assert "kvcheck.engines.sglang.scheduler.build" in mods and "kvcheck.spec.refusal" in mods
    # layouts is imported only under TYPE_CHECKING, the generator only inside a function
    assert "kvcheck.engines.sglang.layouts" not in mods and "kvcheck.engines.sglang.scheduler.generator" not in mods
    assert not any(m.split(".")[0] != "kvcheck" for m in mods)


def test_an_unknown_root_is_refused():
    import pytest
    with pytest.raises(ImportError, match="kvcheck.nope"):
        closure(["kvcheck.nope"])


def test_a_script_with_the_bundle_imports_kvcheck_from_itself_alone(tmp_path):
    """Run isolated (-I): the frozen modules come first (ahead of an installed kvcheck: each module
    imported is the script's own text) and behave as the real ones (relative imports, packages)."""
    script = tmp_path / "s.py"
    body = ("import sys\n" + INSTALLER + "\ninstall()\n"
            "from kvcheck.spec.verdict import ExitCode\n"
            "from kvcheck.fuzz.boundary import CannotDrive\n"
            "import kvcheck.spec\n"
            "import kvcheck.spec.verdict as v\n"
            "print(int(ExitCode.OK), CannotDrive.__module__, v.__file__.startswith(__file__), "
            "kvcheck.spec.__path__ is not None)\n"
            "# the frozen text\n" + bundle_text(["kvcheck.fuzz.boundary"]))
    script.write_text(body)
    assert MARK + "kvcheck.fuzz.boundary" in body and "#| " in body
    p = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True, cwd=str(tmp_path),
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:2] == ["0 kvcheck.fuzz.boundary True True", ""], p.stdout
