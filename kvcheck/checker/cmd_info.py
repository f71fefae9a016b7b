"""`kvcheck spec` and `kvcheck faults`: what the spec is and which bugs it plants."""
from __future__ import annotations

import argparse

from ..fuzz import faults as faultlib
from ..spec.actions import ACTIONS
from ..spec.invariants import invariants_for
from ..spec.objects import DECISION_KINDS, OBJECTS, REASONS
from ..spec.state import BLOCK_FIELDS, GLOBAL_FIELDS, OBJ_FIELDS, REQ_FIELDS, field_docs
from ..spec.system import Spec
from .common import emit, load_config

FUNNEL = [
    {"layer": 1, "name": "lcm_alignment",
     "checks": "the hit is a whole number of LCM pages across all cache groups",
     "reasons": ["lcm_alignment"]},
    {"layer": 2, "name": "fingerprint",
     "checks": "kernel ABI / layout and version stamps (model, compressor, indexer) of every "
               "present object match the current ones", "reasons": ["abi_mismatch", "model_version", "indexer_version"]},
    {"layer": 3, "name": "group_intersection",
     "checks": "every cache group's recovery condition holds (intersection, not union): entries "
               "compressed, tail at the hit point, window pages present, indexer synced; on-disk "
               "copies in flight are not ready",
     "reasons": ["compressed_missing", "tail_missing", "window_incomplete", "indexer_lagging", "on_disk_not_ready"]},
    {"layer": 4, "name": "hardware_alignment",
     "checks": "every physical address the resume reads is hardware-aligned", "reasons": ["misaligned"]},
]

def cmd_spec(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    spec = Spec(cfg)
    data = {
        "objects": [{"name": o.name, "layers": o.layers, "states": list(o.states),
                     "recovery_condition": o.recovery_condition, "hit_validation": o.hit_validation,
                     "eviction": o.eviction, "cost_of_loss": o.cost_of_loss} for o in OBJECTS],
        "actions": [{"name": a.name, "doc": a.doc,
                     "instances": sum(1 for i in spec.instances if i.action == a.name),
                     "params": sorted({k for i in spec.instances if i.action == a.name for k in i.params})}
                    for a in ACTIONS.values()],
        "funnel": FUNNEL,
        "invariants": [{"name": i.name, "kind": i.kind, "doc": i.doc} for i in invariants_for(cfg).values()],
        "decisions": list(DECISION_KINDS),
        "degradation_reasons": [name for name, _ in REASONS],
        "state": {"per_object": field_docs(OBJ_FIELDS, cfg), "per_block": field_docs(BLOCK_FIELDS, cfg),
                  "per_request": field_docs(REQ_FIELDS, cfg),
                  "global": field_docs(GLOBAL_FIELDS, cfg), "slots": spec.lay.size},
        "groups": [{"name": g.name, "layers": list(g.layers), "window": g.window, "m": g.m,
                    "topk": g.topk, "objects": list(g.objects)} for g in cfg.groups],
        "config": cfg.to_dict(),
    }

    def text() -> str:
        lines = [f"kvcheck spec: {len(cfg.layers)} layers in {len(cfg.groups)} cache groups, "
                 f"{cfg.blocks} blocks x {cfg.block_size} tokens, {cfg.requests} requests; "
                 f"{spec.lay.size} state slots, {len(spec.instances)} action instances", "", "objects:"]
        lines += [f"  {o.name:14} {o.layers}\n  {'':14} recovery: {o.recovery_condition}" for o in OBJECTS]
        lines += ["", "funnel:"] + [f"  {f['layer']}. {f['name']}: {f['checks']}" for f in FUNNEL]
        lines += ["", "decisions: " + " | ".join(DECISION_KINDS), "", "actions:"]
        lines += [f"  {a['name']:18} {a['doc']}" for a in data["actions"]]
        lines += ["", "invariants:"] + [f"  {i.name:26} [{i.kind}] {i.doc}" for i in invariants_for(cfg).values()]
        return "\n".join(lines)

    emit(args, data, text)
    return 0


def cmd_faults(args: argparse.Namespace) -> int:
    data = {"faults": [f.to_dict() for f in faultlib.FAULTS.values()],
            "engines_not_read": dict(faultlib.ERRORS)}

    def text() -> str:
        lines = [f"{len(faultlib.FAULTS)} faults (a fault counts as caught only by its expected check):", ""]
        for f in faultlib.FAULTS.values():
            lines.append(f"  {f.name:34} [--sut {'|'.join(f.suts)}] expected: {f.expected}")
            lines.append(f"  {'':34} {f.bug_class}; mirrors: {f.mirrors}")
        lines += [f"  (engine {n}: faults not read: {why})" for n, why in data["engines_not_read"].items()]
        return "\n".join(lines)

    emit(args, data, text)
    return 0


