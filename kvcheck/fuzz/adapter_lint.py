"""Linting an adapter before a campaign: what `kvcheck adapter-check MODULE:CLASS` reports.

Owns the short seeded lockstep run that shows what a campaign would find inconclusive: the
actions an adapter declares that the spec never enables (with the others it declares, in this
config: a clean campaign would exit 3), declared names the spec does not have, the state
fields its abstraction function never reports (compared nowhere), observations of the wrong
shape, faults that do not construct, and a finding the run already meets. Constructor and
reset errors are a broken --sut (suts.SutError, exit 2).
"""
from __future__ import annotations

import random
from typing import Any, Callable

from ..spec.actions import ACTIONS
from ..spec.config import Config
from ..spec.state import BLOCK_FIELDS, GLOBAL_FIELDS, OBJ_FIELDS, REQ_FIELDS
from ..spec.system import Spec
from .guard import GuardedLockstep, ValuedSpecModel, guard
from .lockstep import Finding
from .suts import SutError

HOOKS = ("differential_check", "isolation_check", "extra_checks", "close")
# What a full-attention adapter should report at least (docs/adapters.md, "Hash-chain managers")
RECOMMENDED = ("st", "ref", "rst", "rpos")


def lint(cfg: Config, name: str, factory: Callable[[], Any], steps: int = 2000, seed: int = 0,
         run_steps: int = 200) -> dict[str, Any]:
    """Lint the SUT `factory` builds (`name` for messages). Returns a JSON-able result with
    `problems` (each one line) and `exit_code` (0 clean, 3 inconclusive, a finding's code)."""
    spec = Spec(cfg)
    sut = factory()
    try:
        sut.reset(cfg)
    except Exception as e:  # noqa: BLE001 - the user's adapter
        raise SutError(f"--sut {name}: reset() raised {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    declared = getattr(sut, "actions", None)      # after reset: a SUT may declare per config
    problems: list[str] = []
    res: dict[str, Any] = {"sut": name, "name": getattr(sut, "name", None), "seed": seed,
                           "hooks": [h for h in HOOKS if callable(getattr(sut, h, None))]}
    if declared is not None and not isinstance(declared, (set, frozenset, list, tuple)):
        raise SutError(f"--sut {name}: `actions` must be a set of action names or None, got {type(declared).__name__}")
    names = set(spec.actions) if declared is None else set(declared)
    unknown = sorted(names - set(ACTIONS))
    if unknown:
        problems.append(f"declares actions the spec does not have: {', '.join(unknown)} (`kvcheck spec` lists them)")
    absent = sorted((names & set(ACTIONS)) - set(spec.actions))
    if absent:
        problems.append(f"declares actions this config has no instance of: {', '.join(absent)}")
    driven = [a for a in spec.actions if a in names]
    res["actions"] = driven
    run = _drive(spec, driven, factory, steps, seed, run_steps)
    never = [a for a in driven if a not in run["enabled"]]
    # a base class's declarations (`base_actions`: action -> what reaches it) are not the user's to drop
    base = getattr(sut, "base_actions", None) or {}
    mine = [a for a in never if a not in base]
    if mine:
        problems.append(f"declares {', '.join(mine)}, which the spec never enabled in {run['steps']} steps "
                        "(a clean campaign would exit 3): drop them from `actions`, or declare the "
                        "actions that enable them")
    for a in (a for a in never if a in base):
        problems.append(f"the base class declares {a}, which the spec never enabled in {run['steps']} steps "
                        f"(a clean campaign would exit 3); it is reached by {base[a]}")
    # enabled but never drawn (chance, in a short run; a refusal would have been a finding)
    res["enabled_not_drawn"] = [a for a in driven if a in run["enabled"] and a not in run["taken"]]
    problems += run["shape"]
    lay = spec.lay
    fields = {"object": OBJ_FIELDS, "block": BLOCK_FIELDS, "request": REQ_FIELDS, "global": GLOBAL_FIELDS}
    seen = {lay.names[i][-1] for i in run["slots"]}
    res["reports"] = ("nothing (decisions only)" if run["observes"] == "none" else
                      "the whole state" if run["observes"] == "whole" else "part of the state")
    res["fields_never_reported"] = {k: [f for f in fs if f not in seen] for k, fs in fields.items()}
    res["fields_never_reported"] = {k: v for k, v in res["fields_never_reported"].items() if v}
    missing = [f for f in RECOMMENDED if f not in seen]
    if missing and run["observes"] != "none":
        res["recommended_missing"] = missing
    res["faults"] = _faults(sut, type(sut))
    problems += [f"fault {n!r}: {why}" for n, why in res["faults"].items() if why != "ok"]
    res.update(steps=run["steps"], runs=run["runs"], enabled=sorted(run["enabled"]),
               taken=dict(sorted(run["taken"].items())), never_enabled=never, problems=problems)
    f = run["finding"]
    if f is not None and f.program:
        f = _shrink(spec, model_for(spec, driven), factory, f)
    if f is not None:
        res["finding"] = {"kind": f.kind, "checks": f.checks, "message": f.message,
                          "steps": [x.label() for x in f.program]}
        from ..spec.verdict import FOR_FINDING
        res["exit_code"] = int(FOR_FINDING.get(f.kind, 13))
    else:
        res["exit_code"] = 3 if problems else 0
    return res


def model_for(spec: Spec, driven: list[str]) -> ValuedSpecModel:
    return ValuedSpecModel(spec, frozenset(driven))


def _shrink(spec: Spec, model: ValuedSpecModel, factory: Callable[[], Any], f: Finding,
            seconds: float = 3.0) -> Finding:
    """The one shrinker on the failing run's steps (probes stay probes where they fall)."""
    from .lockstep import lead
    from .shrink import shrink_finding
    want = lead(f.checks)

    def run(prog: list[Any]) -> Finding | None:
        sut = guard(factory())
        try:
            sut.reset(spec.cfg)
            return GuardedLockstep(model, sut, follow=False).run(prog, stop_at_divergence=True)
        except Finding as g:
            return g
    return shrink_finding(f, run, lambda g: g.kind == f.kind and want in g.checks, seconds)


def _drive(spec: Spec, driven: list[str], factory: Callable[[], Any], steps: int, seed: int,
           run_steps: int) -> dict[str, Any]:
    """Seeded lockstep runs of the spec and fresh SUTs: each step a uniformly drawn enabled
    action among those declared, then one of its enabled instances, or (one step in ten) a
    negative probe the SUT must refuse. Stops at a finding."""
    rng = random.Random(f"kvcheck-adapter-check-{seed}")
    model = model_for(spec, driven)
    out: dict[str, Any] = {"enabled": set(), "taken": {}, "slots": set(), "shape": [], "observes": "none",
                           "finding": None, "steps": 0, "runs": 0}

    def count(action: str, _decision: Any) -> None:
        out["taken"][action] = out["taken"].get(action, 0) + 1
    while out["steps"] < steps and out["finding"] is None:
        out["runs"] += 1
        sut = guard(factory())
        core = None
        try:
            sut.reset(spec.cfg)
            core = GuardedLockstep(model, sut, follow=False, count=count)
            _shape(sut.observe(), spec.lay.size, out)       # before a step can misread it
            for _ in range(run_steps):
                by: dict[str, list[Any]] = {}
                for i in model.instances:
                    if i.guard(core.s):
                        by.setdefault(i.action, []).append(i)
                out["enabled"].update(by)
                if not by or out["steps"] >= steps:
                    break
                out["steps"] += 1
                dis = [i for i in core.probes if not i.guard(core.s)] if rng.random() < 0.1 else []
                if dis:             # a negative probe, as a campaign sends: it must be refused
                    core.probe(rng.choice(dis))
                else:
                    core.step(rng.choice(by[rng.choice(sorted(by))]))
                if core.diverged is not None:
                    raise core.diverged
                _shape(sut.observe(), spec.lay.size, out)
            core.close()
        except Finding as f:
            out["finding"] = f
            if core is not None:
                try:
                    core.close()
                except Finding:
                    pass
    return out


def _shape(seen: Any, size: int, out: dict[str, Any]) -> None:
    """Record what an observation covers; a malformed one is a problem (once)."""
    if seen is None:
        return
    if isinstance(seen, tuple) and len(seen) == size:
        out["observes"] = "whole"
        out["slots"].update(range(size))
        return
    if isinstance(seen, dict) and all(isinstance(k, int) and 0 <= k < size for k in seen):
        out["observes"] = "whole" if out["observes"] == "whole" else "partial"
        out["slots"].update(seen)
        return
    msg = (f"observe() returned {type(seen).__name__} {seen!r:.60}: expected None, a tuple of {size} "
           f"ints (Layout order) or a {{slot: value}} dict with slots in [0, {size})")
    if msg not in out["shape"]:
        out["shape"].append(msg)


def _faults(sut: Any, cls: type) -> dict[str, str]:
    """Each declared fault: "ok" when the SUT constructs with it, else why not."""
    declared = getattr(sut, "faults", None) or {}
    if not isinstance(declared, dict):
        return {"faults": f"`faults` must be a dict {{name: expected check}}, got {type(declared).__name__}"}
    out = {}
    for n, check in declared.items():
        try:
            cls(fault=n)
            out[n] = "ok" if isinstance(check, str) and check else "its expected check must be a check name"
        except Exception as e:  # noqa: BLE001 - the user's constructor
            out[n] = f"constructing with fault={n!r} raised {type(e).__name__}: {e}"
    return out
