"""What the adapter benchmarks (sglang.py, vllm.py) share: timing a planted fault over seeds."""
from __future__ import annotations

import statistics
from typing import Any, Callable


def fault_row(run: Callable[[int], dict[str, Any]], seeds: int, expected: str,
              detected: Callable[[dict[str, Any]], float | None] = lambda r: r["time_to_failure_s"],
              shrunk: Callable[[dict[str, Any]], list[int]] | None = None) -> dict[str, Any]:
    """Run a planted fault's campaign once per seed (`run(seed)`): how often it was caught,
    the median time to detection (`detected(result)`, of the runs that caught it) and the
    longest shrunk trace (`shrunk(result)`: its findings' lengths; default every finding)."""
    ttd, lengths, caught = [], [], 0
    for seed in range(seeds):
        r = run(seed)
        caught += bool(r["caught"])
        t = detected(r)
        if r["caught"] and t is not None:
            ttd.append(t)
        lengths += shrunk(r) if shrunk is not None else [x["steps"] for x in r["findings"]]
    return {"caught": f"{caught}/{seeds}", "expected": expected,
            "median_time_to_detection_s": statistics.median(ttd) if ttd else None,
            "max_shrunk_steps": max(lengths) if lengths else None}
