"""`kvcheck explore`: read the arguments, run the explorer (explore.py), print and write its report."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..spec.config import Config
from ..spec.outputs import write_atomic
from .common import check_fault, check_out_file, check_writable, emit
from .explore import fault_config, run_explore, run_profile


def render_text(rep: dict[str, Any]) -> str:
    lines = [f"kvcheck explore: {rep['verdict']} (exit {rep['exit_code']})",
             f"  {rep['states']} distinct states ({'symmetry-reduced, ' if rep['symmetry'] else ''}"
             f"{'exhaustive' if rep['exhaustive'] else 'not exhaustive'}), {rep['transitions']} transitions, "
             f"depth {rep['depth']}, {rep['seconds']} s ({rep['states_per_s']} states/s)",
             "  decisions reached: " + (", ".join(rep["decisions"]) or "none"),
             f"  actions reached: {sum(1 for v in rep['actions'].values() if v)}/{len(rep['actions'])}",
             f"  deadlocks: {rep['deadlocks']}"]
    if rep.get("idle_unreachable") is not None:
        lines.append(f"  states from which every-request-idle is unreachable: {rep['idle_unreachable']['count']}")
    if rep["sometimes_missing"]:
        lines.append("  sometimes-properties NOT reached: " + ", ".join(rep["sometimes_missing"]))
    if "violation" in rep:
        v = rep["violation"]
        lines.append(f"  shortest violation ({v['depth']} steps): {', '.join(v['invariants'])}")
        lines += [f"    {i:3}. {s}" for i, s in enumerate(v["steps"])]
        lines.append(f"  replay: {v['replay']}")
    if "fault_result" in rep:
        fr = rep["fault_result"]
        lines.append(f"  fault {rep['fault']}: expected {fr['expected']} -> "
                     + ("caught" if fr["caught"] else
                        (f"MIS-ATTRIBUTED (caught by {', '.join(fr['caught_by'])})" if fr["caught_by"] else "SURVIVED")))
    if rep.get("graph"):
        lines.append(f"  graph: {rep['graph']}")
    return "\n".join(lines)


def cmd_explore(args: Any) -> int:
    if args.fault is not None:
        check_fault(args.fault, ("spec",), "`kvcheck explore`")
    cfg = Config.load(args.config) if args.config else fault_config(args.fault)
    out = Path(args.out) if getattr(args, "out", None) else None
    if out is not None:
        check_writable(out)
    if args.graph is not None:
        check_out_file(Path(args.graph), "--graph", (".graphml", ".dot"))
    if args.config is None and args.fault is None and args.graph is None:
        code, rep = run_profile(out, args.max_states)
    else:
        code, rep = run_explore(cfg, out, args.fault, args.max_states, args.graph, args.config)
    if out is not None:
        write_atomic(out / "explore.json", json.dumps(rep, indent=1) + "\n")
    emit(args, rep, lambda: render_text(rep))
    return code
