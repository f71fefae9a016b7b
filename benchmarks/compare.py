"""Side-by-side speed of two checkouts (this one and a base commit), interleaved run by run so
that machine load hits both alike: spec walk steps/s, fuzz spec and lockstep steps/s, explore
states/s. Prints one JSON object: per metric, each side's median and the ratio new/base.

    python benchmarks/compare.py --base-tree /tmp/old [--runs 3] [--metrics walk,explore] [--smoke]

--smoke: 1/100 of each metric's work (explore capped at 20,000 states per config): checks that
this script runs; the figures and ratios are meaningless.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SNIPPET = r"""
import json, sys, time, torch
torch.set_num_threads(1)
what, smoke = sys.argv[1], sys.argv[2:] == ["smoke"]
if what == "walk":
    from kvcheck.fuzz.walk import Walker
    from kvcheck.spec.config import Config
    from kvcheck.spec.system import Spec
    res = Walker(Spec(Config()), seed=1).run(200 if smoke else 20000)
    print(json.dumps({"v": res.coverage.steps / res.seconds}))
elif what in ("fuzz_spec", "fuzz_lockstep"):
    import tempfile, pathlib
    from kvcheck.fuzz.campaign import Budget, run_campaign
    from kvcheck.spec.config import Config
    sut, n = ("spec", 20000) if what == "fuzz_spec" else ("reference", 4000)
    n = n // 100 if smoke else n
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter(); r = run_campaign(Config(), sut, Budget(steps=n), 0, None, None, pathlib.Path(d))
        print(json.dumps({"v": r["steps"] / (time.perf_counter() - t)}))
elif what == "explore":
    from kvcheck.checker.explore import CI_PROFILE, explore
    n = t = 0.0
    for cfg in CI_PROFILE.values():
        _, res, _ = explore(cfg, **({"max_states": 20000} if smoke else {})); t += res.seconds; n += res.states
    print(json.dumps({"v": n / t}))
"""


def one(tree: str, what: str, smoke: bool = False) -> float:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", SNIPPET, what, *(["smoke"] if smoke else [])], cwd=tree, env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["v"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-tree", required=True, help="a checkout of the base commit")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--metrics", default="walk,fuzz_spec,fuzz_lockstep,explore")
    ap.add_argument("--smoke", action="store_true",
                    help="1/100 of each metric's work: checks the script runs, figures meaningless")
    args = ap.parse_args()
    out: dict = {"benchmark": "compare", "runs": args.runs, "base_tree": args.base_tree, "smoke": args.smoke}
    for what in args.metrics.split(","):
        base, new = [], []
        for _ in range(args.runs):             # interleaved: base, new, base, new, ...
            base.append(one(args.base_tree, what, args.smoke))
            new.append(one(str(HERE), what, args.smoke))
        b, n = statistics.median(base), statistics.median(new)
        out[what] = {"base": round(b), "new": round(n), "ratio": round(n / b, 3)}
        print(json.dumps({what: out[what]}), file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
