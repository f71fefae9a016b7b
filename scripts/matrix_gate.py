"""CI's gate on a `kvcheck matrix` result: print the table's verdicts, fail (exit 1) when any cell
is "cannot drive" or "error" (kvcheck could not drive a release it claims, or crashed), or when
the matrix wrote nothing. Findings and undecided cells are reported, not failed on: a short CI
budget leaves some actions unexercised, and findings are the release's own (docs/matrix.md).

    python scripts/matrix_gate.py kvcheck-matrix-ci/matrix-sglang.json
"""
from __future__ import annotations

import json
import sys
from collections import Counter


def main(path: str) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
    except (OSError, ValueError) as e:
        print(f"matrix gate: no matrix result at {path}: {e}", file=sys.stderr)
        return 1
    rows = res.get("rows") or []
    if not rows:
        print(f"matrix gate: {path} has no release row", file=sys.stderr)
        return 1
    bad, counts = [], Counter()
    for row in rows:
        if row.get("error"):
            bad.append(f"{row.get('release')}: {row['error']}")
        for layout, cell in (row.get("cells") or {}).items():
            counts[cell.get("verdict")] += 1
            if cell.get("verdict") in ("cannot drive", "error"):
                bad.append(f"{row.get('release')} {layout}: {cell.get('verdict')}: {cell.get('line')}")
    releases = ", ".join(str(r.get("release")) for r in rows)
    print(f"matrix gate: {res.get('engine', '?')} {releases}: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    for line in bad:
        print(f"  FAIL {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]) if len(sys.argv) == 2 else 2)
