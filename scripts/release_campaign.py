"""One release's campaign for the findings tables: every layout the installed vLLM or SGLang
release can express shares one budget; a layout that finds something restarts with the next seed
so the whole budget is spent looking. Prints one JSON object; `--markdown` adds table rows.

Run it with the interpreter of the release's environment (scripts/install-vllm.sh or
install-sglang.sh VERSION DIR builds one):

    PYTHONPATH=$PWD DIR/bin/python scripts/release_campaign.py --sut vllm --budget 600 --seed 1
    PYTHONPATH=$PWD DIR/bin/python scripts/release_campaign.py --sut sglang --budget 600 --layouts radix,swa
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

# run as a script, this file's folder comes first on sys.path; keep engine imports unshadowed
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def vllm_modules() -> tuple[str, list[str], Callable[..., dict]]:
    from kvcheck.engines.vllm import drivers as v
    gaps = v.supported_layouts()
    names = [k for k, why in gaps.items() if why is None] + [v.GENERATED]
    return f"vllm {v.vllm_version()}", names, v.run_campaign


def _sglang() -> tuple[str, list[str], Callable[..., dict]]:
    from kvcheck.engines.sglang import drivers as sg
    from kvcheck.engines.sglang.layouts import list_layouts
    names = [r["name"] for r in list_layouts() if r["name"] and r["supported"]]
    return f"sglang {sg.sglang_version()}", names, sg.run_campaign


ENGINES = {"vllm": vllm_modules, "sglang": _sglang}


def _one_layout(run: Callable[..., dict], layout: str, seconds: float, seed: int, out: str) -> dict[str, Any]:
    """Fuzz `layout` for `seconds`, restarting with seed+1 after every finding; sums the runs."""
    t0, row = time.monotonic(), {"layout": layout, "seeds": [], "steps": 0, "episodes": 0,
                                 "lookups_with_hit": 0, "findings": [], "first_finding_s": None,
                                 "exit_codes": [], "coverage": {}}
    while (left := seconds - (time.monotonic() - t0)) > 1:
        before = time.monotonic() - t0
        res = run(layout, budget_s=left, seed=seed, out_dir=out)
        row["seeds"].append(seed)
        row["exit_codes"].append(res["exit_code"])
        for k in ("steps", "episodes", "lookups_with_hit"):
            row[k] += res.get(k) or 0
        for k, n in res.get("coverage", {}).items():
            row["coverage"][k] = row["coverage"].get(k, 0) + n
        for f in res["findings"]:
            row["findings"].append({k: f.get(k) for k in ("kind", "check", "message", "trace", "replay", "steps")})
            at = min(x for x in (res.get("time_to_failure_s"), res.get("time_to_first_lost_reuse_s"),
                                 res["elapsed_s"]) if x is not None)
            if row["first_finding_s"] is None:
                row["first_finding_s"] = round(before + at, 1)
        if res["exit_code"] in (0, 3):       # ran to its budget (3: an action never reached)
            break
        seed += 1
    row["elapsed_s"] = round(time.monotonic() - t0, 1)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sut", choices=sorted(ENGINES), required=True)
    ap.add_argument("--budget", type=float, default=600, help="seconds for the whole release (default 600)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--layouts", default="", help="comma-separated layouts (default: every one the release runs)")
    ap.add_argument("--out", default="kvcheck-report/release-campaign", help="where finding traces go")
    ap.add_argument("--markdown", action="store_true", help="also print Markdown table rows on stderr")
    a = ap.parse_args()
    release, names, run = ENGINES[a.sut]()
    if a.layouts:
        unknown = [x for x in a.layouts.split(",") if x not in names]
        if unknown:
            print(f"release_campaign: {release} cannot run {', '.join(unknown)}; it runs {', '.join(names)}",
                  file=sys.stderr)
            return 2
        names = a.layouts.split(",")
    t0, rows = time.monotonic(), []
    for i, name in enumerate(names):
        share = (a.budget - (time.monotonic() - t0)) / (len(names) - i)
        rows.append(_one_layout(run, name, share, a.seed, a.out))
    out = {"release": release, "budget_s": a.budget, "seed": a.seed, "layouts": rows,
           "steps": sum(r["steps"] for r in rows), "findings": sum(len(r["findings"]) for r in rows),
           "elapsed_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(out, indent=1))
    if a.markdown:
        for r in rows:
            kinds = ", ".join(sorted({f"{f['kind']}: {f['check']}" for f in r["findings"]})) or "none"
            print(f"| {release.split()[1]} | `{r['layout']}` | {r['elapsed_s']:.0f} | {r['steps']:,} | "
                  f"{r['episodes']:,} | {r['lookups_with_hit']:,} | {kinds} | "
                  f"{r['first_finding_s'] if r['first_finding_s'] is not None else '—'} | "
                  f"{','.join(map(str, sorted(set(r['exit_codes']))))} |", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
