"""Regenerate (--write) or check (default) the per-action table in docs/adapters.md from the
spec's declarations (kvcheck/checker/action_table.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvcheck.checker.action_table import render, splice  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "adapters.md"

if __name__ == "__main__":
    text = DOC.read_text()
    new = splice(text, render())
    if "--write" in sys.argv[1:]:
        DOC.write_text(new)
        print(f"wrote the action table to {DOC}")
    elif new != text:
        print(f"{DOC}: the action table is out of date; run: python scripts/action-table.py --write")
        sys.exit(1)
