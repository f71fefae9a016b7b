"""`kvcheck adapter-check MODULE:CLASS`: lint an adapter before a campaign (fuzz/adapter_lint.py)."""
from __future__ import annotations

import argparse

from .common import emit, load_config


def cmd_adapter_check(args: argparse.Namespace) -> int:
    """Construct, reset and drive the adapter briefly; say what would make a campaign fail or
    claim nothing (exit 0 clean, 3 inconclusive, 10/13 a finding already, 2 it cannot start)."""
    from ..fuzz.adapter_lint import lint
    from ..fuzz.suts import resolve_sut
    cfg = load_config(args)
    factory = resolve_sut(args.sut)
    res = lint(cfg, args.sut, factory, steps=args.steps, seed=args.seed)
    code = res["exit_code"]
    verdict = {0: "clean", 3: "inconclusive"}.get(code, "finding")

    def text() -> str:
        cfg_name = args.config or "the default config"
        lines = [f"kvcheck adapter-check {args.sut}: {verdict} (exit {code})",
                 f"  constructed and reset on {cfg_name}: " + ", ".join(g.name for g in cfg.groups)
                 + f"; {cfg.blocks} blocks, {cfg.requests} requests",
                 f"  drove {res['steps']} steps in {res['runs']} runs (seed {args.seed}) over the "
                 f"{len(res['actions'])} actions it declares: " + ", ".join(f"{a} {n}" for a, n in res["taken"].items()),
                 f"  reports {res['reports']}" + (
                     "; never reports " + "; ".join(f"{k} fields {', '.join(v)}" for k, v in res["fields_never_reported"].items())
                     if res["fields_never_reported"] else "")]
        if res.get("recommended_missing"):
            lines.append(f"  note: a full-attention adapter should report {', '.join(res['recommended_missing'])} "
                         "(docs/adapters.md, \"Hash-chain managers\")")
        lines.append("  hooks: " + (", ".join(res["hooks"]) or "none") + "; faults: "
                     + (", ".join(f"{n} ({why})" for n, why in res["faults"].items()) or "none declared"))
        lines += [f"  PROBLEM: {p}" for p in res["problems"]]
        if "finding" in res:
            f = res["finding"]
            lines.append(f"  FINDING [{f['kind']}] {', '.join(f['checks'])}: {f['message']}")
            lines += [f"    {i:3}. {s}" for i, s in enumerate(f["steps"])]
        if code == 0:
            lines.append(f"  ready: kvcheck fuzz --sut {args.sut}" + (f" --config {args.config}" if args.config else ""))
        return "\n".join(lines)

    emit(args, res, text)
    return code
