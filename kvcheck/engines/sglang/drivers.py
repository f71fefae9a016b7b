"""Check SGLang's real radix caches against kvcheck's checks: the drivers.

The adapter (adapter.py) supplies SGLang's actions, how to apply one and its own
checks (checks.py); this module generates seeded operation sequences in that
vocabulary (swarm testing: each episode draws its own weights) and runs them on the lockstep
core with the free model. A failure is shrunk by the one shrinker, saved by the one trace
builder and replayed by the one replay. SGLang is imported lazily (SglangUnavailable).
"""
from __future__ import annotations

import gc
import random
import time
from collections import Counter
from pathlib import Path
from typing import Mapping

from kvcheck.fuzz.floor import shortfall as floor_shortfall, undecided_lines
from kvcheck.spec.trace import Trace

from kvcheck.spec.verdict import FOR_FINDING, ExitCode
from kvcheck.fuzz.boundary import CannotDrive, as_cannot_drive, require, setting_up
from kvcheck.fuzz.known import Acknowledgement, judge, known_lines
from kvcheck.fuzz.lockstep import (Act, Finding, FreeModel, Lockstep)
from kvcheck.fuzz.prompts import PromptGen
from kvcheck.fuzz.steer import Steer, steer_lines
from kvcheck.fuzz.traces import replay as replay_on_core, to_trace
from .swa import WALLCLOCK_DEFECT
from .adapter import SglangAdapter
from .incremental import FULL_SCAN_EVERY
from .interface import needs
from .reproducer import write_reproducer
from .scheduler.adapter import ACTIONS as SCHED_ACTIONS
from .steps import shrink_steps
from .install import INSTALL_HINT, SglangUnavailable, sglang_version
from .layouts import (ACTIONS, FAULTS, LAYOUTS, MAX_TOKENS, SGLANG_FAULTS, VOCAB, Layout, LayoutError,
                      get_layout, layout_config, list_layouts, load_layout_file)

__all__ = ["LAYOUTS", "FAULTS", "SGLANG_FAULTS", "ACTIONS", "SglangUnavailable", "SglangAdapter",
           "LayoutError", "run_campaign", "replay", "list_layouts", "load_layout_file", "INSTALL_HINT"]


class _Gen(PromptGen):
    """Seeded generator of actions (swarm testing: each episode draws its own weights). On a
    layout with a sliding window it leans toward what tombstones a path and then crosses it:
    more evictions, most of them partial (1..window SWA tokens: some nodes tombstoned, not all),
    and next turns (a finished request's tokens, then more), whose match runs over the
    finished request's path."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng, VOCAB, 30, ACTIONS, ("match", "decode"))
        self.done: list[list[int]] = []          # finished requests' tokens (what was inserted)

    def next(self, ad: SglangAdapter) -> tuple[str, dict]:
        rng = self.rng
        en = ad.enabled()
        w = ad.lay.window if "swa" in ad.lay.components else None
        cands = {a: self.w[a] for a, rs in en.items() if rs}
        if len(ad.reqs) < 4:
            cands["submit"] = self.w["submit"] * (3 if not ad.reqs else 1)
        cands["evict"] = self.w["evict"] * (0.5 if w else 0.2)
        a = self.choose(cands)
        if a == "submit":
            toks = self.prompt(30)
            if hasattr(ad, "continue_prompt"):      # a next turn: a finished request's tokens, then more
                toks = ad.continue_prompt(rng, toks)
            elif w and self.done and rng.random() < 0.3:
                k = rng.choice(self.done)
                toks = k + toks[:rng.randint(1, min(len(toks), MAX_TOKENS - 1 - len(k)))]
            return a, {"r": f"r{ad.next_id}", "tokens": toks}
        if a == "evict":
            if hasattr(ad, "evict_params"):         # an adapter with more than one component to evict
                return a, ad.evict_params(rng)
            if w and rng.random() < 0.8:
                return a, {"n": rng.randint(1, w)}
            return a, {"n": rng.randint(1, ad.capacity // 2)}
        r = rng.choice(en[a])
        if a == "decode":
            return a, {"r": r, "tok": rng.randrange(VOCAB)}
        if a == "chunk":                            # a chunk of whole pages (the scheduler's alignment)
            ps = ad.lay.page_size
            return a, {"r": r, "n": ps * rng.randint(1, max(1, 12 // ps))}
        if a == "finish" and len(ad.reqs[r].tokens) < MAX_TOKENS - 2:
            self.done.append(list(ad.reqs[r].tokens))
        return a, {"r": r}


def make_adapter(lay: Layout, fault: str | None = None, capacity: int | None = None) -> SglangAdapter:
    """The adapter for the layout's class (SWARadixCache has its own pools and checks); a
    `drive="sched"` layout runs SGLang's own Scheduler over the class (scheduler/)."""
    if lay.drive == "sched":
        from .scheduler.adapter import SchedAdapter
        return SchedAdapter(lay, fault, capacity)      # type: ignore[return-value]
    if lay.cls == "SWARadixCache":
        from .swa import SwaAdapter
        return SwaAdapter(lay, fault, capacity)
    if lay.cls == "MambaRadixCache":
        from .mamba import MambaAdapter
        return MambaAdapter(lay, fault, capacity)
    if lay.cls == "HiRadixCache":
        from .hicache import HiCacheAdapter
        return HiCacheAdapter(lay, fault, capacity)
    if lay.cls == "ChunkCache":
        from .chunk import ChunkAdapter
        return ChunkAdapter(lay, fault, capacity)
    if lay.cls == "UnifiedRadixCache" and "mamba" in lay.components:
        from .unified_mamba import MambaLockstepAdapter, UnifiedMambaAdapter
        if lay.tree_core == "lockstep":
            return MambaLockstepAdapter(lay, fault, capacity)     # type: ignore[return-value]
        return UnifiedMambaAdapter(lay, fault, capacity, core=lay.tree_core or "python")
    if lay.cls == "UnifiedRadixCache":
        from .unified import UnifiedAdapter
        from .unified_diff import LockstepAdapter
        if lay.tree_core == "lockstep":
            return LockstepAdapter(lay, fault, capacity)     # type: ignore[return-value]
        return UnifiedAdapter(lay, fault, capacity, core=lay.tree_core or "python")
    return SglangAdapter(lay, fault, capacity)


def execute(lay: Layout, capacity: int, fault: str | None, program: list[Act],
            recognise: bool = True) -> tuple[SglangAdapter, Finding | None]:
    """Run steps on a fresh cache, on the core; a refused step (possible after shrinking) is
    skipped. On the scheduler drive a finding a known defect explains is named `known:NAME`
    (so that the shrinker never trades a finding for a known defect)."""
    ad = make_adapter(lay, fault, capacity)
    try:
        f = Lockstep(FreeModel(), ad).run(program)
    finally:
        if hasattr(ad, "close"):
            ad.close()
    if f is not None and recognise and (name := _known(lay, capacity, fault, f)):
        f.checks = [f"known:{name}"]
    return ad, f


def _known(lay: Layout, capacity: int, fault: str | None, f: Finding) -> str | None:
    """The scheduler drive's known defect behind finding `f` (scheduler/known.py), if any."""
    if lay.drive != "sched":
        return None
    from .scheduler import known
    return known.recognise(lay, fault, sglang_version(), f.checks[0],
                           lambda: execute(lay, capacity, fault, f.program, recognise=False)[1])


def shrink_small(viol: Finding, lay: Layout, capacity: int, fault: str | None, seconds: float) -> Finding:
    """The shared shrinker on the compound form of the steps (sglang_steps.shrink_steps), from
    the violation re-located in the exact mode (a full scan after every step: where a violation
    the incremental check saw late happened)."""
    def run(prog: list[Act]) -> Finding | None:
        return execute(lay, capacity, fault, prog)[1]
    exact = run(viol.program)
    if lay.drive == "sched":
        from .scheduler.shrink import shrink_sched
        return shrink_sched(exact if exact is not None else viol, run, lay.page_size, seconds)
    return shrink_steps(exact if exact is not None else viol, run, capacity, seconds)


def _save(lay: Layout, capacity: int, fault: str | None, seed: int, f: Finding, out_dir: str) -> dict:
    trace = to_trace(None, f.trail, seed, engine="sglang-fuzz", cfg=layout_config(lay), sut="sglang",
                     finding=f, fault=fault,
                     meta={"sglang_version": sglang_version(), "layout": lay.to_dict(), "capacity": capacity})
    path = str(trace.save(Path(out_dir) / f"sglang-{lay.name.replace('+', '_')}-{f.checks[0]}-seed{seed}.json"))
    return {"kind": f.kind, "check": f.checks[0], "message": f.message, "trace": path,
            "steps": len(trace.steps), "replay": f"kvcheck replay {path} --sut sglang",
            **write_reproducer(trace, path)}


def run_campaign(layout: str | Layout, budget_s: float | None = 60, steps: int | None = None, seed: int = 0,
                 fault: str | None = None, out_dir: str = "kvcheck-report", shrink_s: float = 30,
                 full_scan_every: int = FULL_SCAN_EVERY, acknowledged: Mapping[str, Acknowledgement] | None = None,
                 strict_known: bool = False, steer: Steer | None = None) -> dict:
    """Fuzz one layout until the budget (seconds and/or steps) is spent or a check breaks. Where
    the class's incremental check pays (`incremental_pays`: UnifiedRadixCache) the checks run
    incrementally with a full scan every `full_scan_every` steps; else, and with 1, the full
    scan after every step. Known defects recognised on the way are judged by the core's rule
    (fuzz/known.py): findings unless `acknowledged`. `steer`: where episodes come from
    (fuzz/steer.py; None: fresh random episodes)."""
    lay = get_layout(layout)
    steer = steer or Steer("random", seed)
    try:
        with setting_up("sglang", sglang_version, ("sglang",), (SglangUnavailable, LayoutError)):
            make_adapter(lay, fault)  # validate layout/fault/release early (and import SGLang)
            require(needs(lay), "sglang", sglang_version())     # the pre-flight interface check
    except CannotDrive as e:
        return e.result(**_base(lay, seed, fault))
    # SGLang's import chain leaves ~650,000 objects (torch, transformers, SGLang) that each full
    # collection of the cyclic collector walks (0.4 s on this machine: a fifth of a lockstep
    # campaign's CPU); they outlive the campaign, so it runs with them frozen (out of the
    # collector's sight; garbage among them waits until the campaign ends, nothing is kept).
    mine = gc.get_freeze_count() == 0       # (a caller's own freeze is left as it is)
    if mine:
        gc.freeze()
    try:
        res = _campaign(lay, budget_s, steps, seed, fault, out_dir, shrink_s, full_scan_every, steer)
    except CannotDrive as e:      # kvcheck's side of the boundary (fuzz/boundary.py): no verdict
        return e.result(**_base(lay, seed, fault))
    except Exception as e:        # raised outside a step's engine calls (the generator, shrinking)
        cd = as_cannot_drive(e, "sglang", sglang_version(), ("sglang",))
        if cd is None:
            raise
        return cd.result(**_base(lay, seed, fault))
    finally:
        res_steer = steer.stop()
        if mine:
            gc.unfreeze()
    res["steer"] = res_steer
    return judge(res, known_defects(), acknowledged, res.get("sglang_version"), strict_known)


def known_defects() -> dict:
    """Every SGLang defect a campaign recognises: the cache-level drive's and the scheduler drive's."""
    from .scheduler.known import DEFECTS
    return {WALLCLOCK_DEFECT.name: WALLCLOCK_DEFECT, **DEFECTS}


def _base(lay: Layout, seed: int, fault: str | None) -> dict:
    """The fields of a campaign result that name what ran (a run that never stepped has only these)."""
    return {"sut": "sglang", "sglang_version": sglang_version(), "layout": lay.name, "class": lay.cls,
            "seed": seed, "fault": fault, "expected_check": FAULTS[fault].expected if fault else None,
            "caught": False if fault else None, "steps": 0, "episodes": 0, "coverage": {},
            "missing_actions": list(ACTIONS), "lookups_with_hit": 0}


def _campaign(lay: Layout, budget_s: float | None, steps: int | None, seed: int, fault: str | None,
              out_dir: str, shrink_s: float, full_scan_every: int, steer: Steer) -> dict:
    t0 = time.monotonic()
    if budget_s is None and steps is None:
        budget_s = 60
    deadline = t0 + budget_s if budget_s is not None else float("inf")
    coverage: Counter = Counter()
    findings: list[dict] = []
    total = episodes = hits = 0
    exit_code, first_fail_s, first_steps = 0, None, None
    first_known: dict[str, float] = {}       # known defect -> seconds to its first recognition
    exp = FAULTS[fault].expected if fault else None
    while time.monotonic() < deadline and (steps is None or total < steps):
        ep = steer.episode(seed * 1_000_003 + episodes)
        ep_seed = ep.seed                    # (a corpus entry's: the same config, replayed and extended)
        rng = random.Random(ep_seed)
        gen = _Gen(rng)
        capacity = rng.choice([1, 2, 3]) * lay.capacity // 2 // lay.page_size * lay.page_size
        ad = make_adapter(lay, fault, capacity)
        if hasattr(ad, "generator"):           # the scheduler drive draws its own episodes
            gen = ad.generator(rng)
        ad.full_scan_every = full_scan_every if ad.incremental_pays else 1
        core = Lockstep(FreeModel(), ad)
        viol: Finding | None = None
        gen = ep.wrap(gen, rng)
        for _ in range(len(ep.prefix) + rng.randint(20, 120)):
            if steps is not None and total >= steps:
                break
            total += 1
            try:
                core.step(Act(*gen.next(ad)))
            except Finding as f:
                viol = f
                break
        hits += ad.hits
        if hasattr(ad, "close"):
            ad.close()
        steer.done(ep, core.program)
        coverage.update(ad.coverage)
        episodes += 1
        if viol is not None and (name := _known(lay, capacity, fault, viol)):
            coverage[f"known:{name}"] += 1      # the episode's scheduler carries the defect: the next one
            first_known.setdefault(name, round(time.monotonic() - t0, 2))
            continue
        if viol is not None and fault is not None and execute(lay, capacity, None, viol.program)[1] is not None:
            coverage["state:release_bug_without_fault"] += 1   # the clean release fails the same steps:
            continue                                            # SGLang's own bug, not the planted fault's
        if viol is not None:
            first_fail_s, first_steps = round(time.monotonic() - t0, 2), total
            small = shrink_small(viol, lay, capacity, fault, shrink_s)
            findings.append(_save(lay, capacity, fault, ep_seed, small, out_dir))
            exit_code = FOR_FINDING.get(small.kind, ExitCode.INVARIANT)
            break
    missing = [a for a in (ACTIONS if lay.drive == "cache" else SCHED_ACTIONS) if not coverage.get(a)]
    if exit_code == 0 and floor_shortfall({"steps": total}, missing):     # the coverage floor
        exit_code = ExitCode.UNDECIDED
    built = sorted(k.split(":", 1)[1] for k in coverage if k.startswith("tree:"))     # the scheduler drive's
    return {
        "sut": "sglang", "sglang_version": sglang_version(), "layout": lay.name, "class": "+".join(built) or lay.cls,
        "seed": seed, "fault": fault, "expected_check": exp,
        "caught": (any(f["check"] == exp for f in findings) if fault else None),
        "steps": total, "episodes": episodes, "elapsed_s": round(time.monotonic() - t0, 2),
        "time_to_failure_s": first_fail_s, "steps_to_failure": first_steps,
        "coverage": {k: coverage[k] for k in sorted(coverage)}, "missing_actions": missing,
        "lookups_with_hit": hits, "findings": findings, "exit_code": exit_code,
        **({"known_first_s": first_known} if first_known else {}),
    }


def replay(trace: Trace | str | Path) -> dict:
    """Replay an SGLang trace on the one replay; report whether it reproduces its violation."""
    if not isinstance(trace, Trace):
        trace = Trace.load(trace)
    meta = trace.meta.get("layout")
    if not isinstance(meta, dict):
        raise LayoutError("trace has no SGLang layout in meta.layout")
    from .layouts import layout_from
    lay = LAYOUTS.get(meta.get("name")) or layout_from(meta, "trace meta.layout")
    from . import swa
    from .scheduler import known
    recognise, swa.STRICT = swa.STRICT, True      # a replay shows the finding itself, known or not
    strict_sched, known.STRICT = known.STRICT, True
    try:
        with setting_up("sglang", sglang_version, ("sglang",), (SglangUnavailable, LayoutError)):
            ad = make_adapter(lay, trace.fault, int(trace.meta.get("capacity", lay.capacity)))
            require(needs(lay), "sglang", sglang_version())
        try:
            code, out = replay_on_core(trace, ad, FreeModel())
        finally:
            if hasattr(ad, "close"):        # the scheduler drive restores the config it published
                ad.close()
    except CannotDrive as e:
        return {**e.result(sut="sglang", sglang_version=sglang_version(), layout=lay.name, fault=trace.fault,
                           steps=len(trace.steps), violation=None), "reproduced": False,
                "expected": (trace.violation or {}).get("check"), "recorded_version": trace.meta.get("sglang_version")}
    finally:
        swa.STRICT, known.STRICT = recognise, strict_sched
    v = out.get("violation")
    want = (trace.violation or {}).get("check")
    return {
        "sut": "sglang", "sglang_version": sglang_version(), "recorded_version": trace.meta.get("sglang_version"),
        "layout": lay.name, "fault": trace.fault, "steps": len(trace.steps),
        "violation": None if v is None else {k: v.get(k) for k in ("kind", "check", "message", "step")},
        "expected": want, "reproduced": want == (v["check"] if v else None), "exit_code": code,
        **({"divergence": out["divergence"]} if "divergence" in out else {}),
    }


def cli_fuzz(layout: str | None, layout_file: str | None, list_only: bool, budget_s: float | None,
             steps: int | None, seed: int, fault: str | None, out_dir: str,
             acknowledged: Mapping[str, Acknowledgement] | None = None,
             strict_known: bool = False, steer: Steer | None = None) -> tuple[dict, str]:
    """What `kvcheck fuzz --sut sglang` prints: (JSON result, text). Raises LayoutError or
    SglangUnavailable (the CLI turns them into one line, exit 2)."""
    if list_only:
        rows = list_layouts()
        text = "\n".join(f"  {r['name'] or '-':28} {r['class']:18} "
                         + ("ok" if r["supported"] else f"not supported: {r['reason']}") for r in rows)
        return {"sglang_version": sglang_version(), "layouts": rows}, f"sglang {sglang_version()}\n{text}"
    if layout_file:
        lay: Layout | str = load_layout_file(layout_file)
    elif layout:
        lay = get_layout(layout)
    else:
        raise LayoutError("--sut sglang needs --layout NAME or --layout-file FILE (see --list-layouts)")
    if fault is not None and fault not in FAULTS:
        raise LayoutError(f"unknown fault {fault!r} for --sut sglang; known: {', '.join(FAULTS)}")
    res = run_campaign(lay, budget_s=budget_s, steps=steps, seed=seed, fault=fault, out_dir=out_dir,
                       acknowledged=acknowledged, strict_known=strict_known, steer=steer)
    if "cannot_drive" in res:
        return res, res["cannot_drive"]["line"]
    lines = [f"kvcheck fuzz --sut sglang --layout {res['layout']} ({res['class']}): exit {res['exit_code']} "
             f"(sglang {res['sglang_version']})",
             f"  {res['steps']} steps in {res['episodes']} episodes, seed {seed}", *steer_lines(res.get("steer")),
             "  actions: " + ", ".join(f"{k} {n}" for k, n in res["coverage"].items())] + undecided_lines(res)
    for f in res["findings"]:
        lines += [f"  FINDING [{f['kind']}] {f['check']}: {f['message']}", f"    replay: {f['replay']}"]
    lines += known_lines(res)
    return res, "\n".join(lines)
