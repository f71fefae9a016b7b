"""`kvcheck prove`: read the arguments, run the prover (prove.py), print and write its report."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..spec.config import Config
from .common import check_fault, check_writable, emit
from .prove import run_prove


def render_text(rep: dict[str, Any]) -> str:
    lines = [f"kvcheck prove: {rep['verdict']} (exit {rep['exit_code']}) in {rep['seconds']} s "
             f"[{rep['blocks']} blocks, {rep['instances']} action instances, {rep['slots']} slots]"]
    for o in rep["invariants"]:
        b = "" if o["bound"] is None else f" bound {o['bound']}"
        lines.append(f"  {o['status']:8} {o['name']:28} {o['method']}{b}  {o['seconds']} s"
                     + (f"  ({o['note']})" if o.get("note") and o["status"] != "proved" else ""))
    v = rep["bmc"]["violation"]
    if v:
        lines.append(f"  BMC counterexample ({len(v['steps'])} steps): {', '.join(v['invariants'])}")
        lines += [f"    {i:3}. {s}" for i, s in enumerate(v["steps"])]
        lines.append(f"  replay: {v['replay']}")
    if "fault_result" in rep:
        fr = rep["fault_result"]
        if fr["caught"]:
            lines.append(f"  fault {rep['fault']}: expected {fr['expected']} -> caught")
        elif fr["caught_by"]:
            lines.append(f"  fault {rep['fault']}: expected {fr['expected']} -> MIS-ATTRIBUTED "
                         f"(caught by {', '.join(fr['caught_by'])})")
        else:
            lines.append(f"  fault {rep['fault']} SURVIVED to BMC depth {rep['bmc']['checked']}")
    return "\n".join(lines)


def cmd_prove(args: Any) -> int:
    if args.config is None and args.fault is not None:
        from .explore import fault_config     # the small profile where BMC reaches every fault
        cfg = fault_config(args.fault)
    else:
        cfg = Config.load(args.config)
    if args.blocks is not None:
        from dataclasses import replace
        cfg = replace(cfg, blocks=args.blocks)
    if args.fault is not None:
        check_fault(args.fault, ("spec",), "`kvcheck prove`")
    out = Path(args.out) if getattr(args, "out", None) else None
    if out is not None:
        check_writable(out)
    code, rep = run_prove(cfg, out, args.fault, args.depth, args.config)
    if out is not None:
        from ..spec.outputs import write_atomic
        write_atomic(out / "prove.json", json.dumps(rep, indent=1) + "\n")
    emit(args, rep, lambda: render_text(rep))
    return code
