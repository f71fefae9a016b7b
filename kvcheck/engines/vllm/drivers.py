"""Check vLLM's real (v1, hybrid) KV cache manager against the kvcheck spec: the drivers.

The adapter (adapter.py) supplies vLLM's actions, how to apply one and its own checks
(checks.py: safety of every hit, bookkeeping, lost reuse); this module generates seeded
operation sequences in that vocabulary (swarm testing: each episode draws its own weights)
and runs them on the lockstep core with the free model. A failure is shrunk by the one
shrinker, saved by the one trace builder and replayed by the one replay.

``vllm`` is imported lazily; without it :class:`VllmUnavailable` is raised.
Entry points: :data:`LAYOUTS`, :data:`FAULTS`, :func:`run_campaign`, :func:`replay`.
"""
from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter
from typing import Mapping
from pathlib import Path

from kvcheck.fuzz.floor import shortfall as floor_shortfall
from kvcheck.spec.trace import Trace

from kvcheck.spec.verdict import FOR_FINDING, ExitCode
from kvcheck.fuzz.boundary import CannotDrive, as_cannot_drive, setting_up
from kvcheck.fuzz.known import Acknowledgement, judge
from kvcheck.fuzz.lockstep import (Act, Finding, FreeModel, Lockstep)
from kvcheck.fuzz.prompts import PromptGen
from kvcheck.fuzz.shrink import shrink_finding
from kvcheck.fuzz.steer import Steer
from kvcheck.fuzz.traces import replay as replay_on_core, to_trace
from . import known
from .adapter import VllmAdapter
from .build import make_adapter, resolve_layout
from .bookkeeping import FULL_SCAN_EVERY
from .checks import Violation
from .reproducer import write_reproducer
from .engine_repro import write_engine_reproducer
from .twin import TwinAdapter, twin_summary, wants_twin
from .workloads import WORKLOADS, reuse_profile
from .sched import SchedGen
from . import drive_plan, engine_gen, engine_sched
from .layouts import (CONNECTOR_CACHE_EARLY, LAYOUT_DATA, ACTIONS, FAULTS, SINGLE_ACTIONS, STEP_ACTIONS, GENERATED,
                      INSTALL_HINT, LAYOUTS, VOCAB, VllmUnavailable, layout_config, layout_scale,
                      supported_layouts, vllm_version, FILE_LAYOUTS, load_layout_file, register_layout)

__all__ = ["LAYOUTS", "FAULTS", "ACTIONS", "VllmUnavailable", "VllmAdapter", "Violation", "run_campaign",
           "replay", "INSTALL_HINT", "supported_layouts", "vllm_version", "load_layout_file"]


class _Gen(PromptGen):
    """Seeded generator of actions (swarm testing: each episode draws its own weights)."""

    def __init__(self, rng: random.Random, max_len: int = 64) -> None:
        super().__init__(rng, VOCAB, 40 * max_len // 64, SINGLE_ACTIONS, ("lookup", "prefill", "decode"))
        self.max_prompt = 44 * max_len // 64

    def next(self, ad: VllmAdapter) -> tuple[str, dict]:
        rng = self.rng
        en = ad.enabled()
        cands = {a: self.w[a] for a, rs in en.items() if rs}
        if len(ad.reqs) < 5:
            cands["submit"] = self.w["submit"] * (3 if not ad.reqs else 1)
        cands["reset_prefix_cache"] = self.w["reset_prefix_cache"] * 0.15
        cands["evict_blocks"] = self.w["evict_blocks"] * 0.2
        a = self.choose(cands)
        if a == "submit":
            toks = self.prompt(self.max_prompt)
            salt = rng.choice([None, None, None, "s1"])
            return a, {"r": f"r{ad.next_id}", "tokens": toks, "salt": salt}
        if a == "reset_prefix_cache":
            return a, {}
        if a == "evict_blocks":
            return a, {"block_ids": [rng.randrange(1, ad.num_blocks) for _ in range(rng.randint(1, 3))]}
        r = rng.choice(en[a])
        if a == "lookup":
            rem = ad.reqs[r].obj.num_tokens
            return a, {"r": r, "chunk": rng.choice([rem, rem, rng.randint(1, max(1, rem))])}
        if a == "prefill":
            o = ad.reqs[r].obj
            rem = o.num_tokens - o.num_computed_tokens
            return a, {"r": r, "chunk": rng.choice([rem, rng.randint(1, rem)])}
        if a == "decode":
            return a, {"r": r, "tok": rng.randrange(VOCAB)}
        return a, {"r": r}


DRIVES = drive_plan.DRIVES             # auto (the default) resolves to engine or mixed: drive_plan.py


def execute(layout: str, num_blocks: int, fault: str | None, program: list[Act],
            strict: bool = False, twin: bool = False, sched_policy: str = "fcfs") -> tuple[VllmAdapter, Finding | None]:
    """Run steps on a fresh manager (with its dense twin if `twin`), on the core; a step vLLM
    refuses (possible after shrinking) is skipped. Returns the adapter and the finding, if any."""
    ad = make_adapter(layout, num_blocks, fault, strict, twin, sched_policy)
    known.install(ad, vllm_version())
    f = Lockstep(FreeModel(), ad).run(program)
    if f is not None and (name := known.of_finding(ad, f, vllm_version())):
        f.checks = [f"known:{name}"]     # (so the shrinker never trades a finding for a known defect)
    return ad, f


def _incremental(ad: VllmAdapter) -> None:
    """Campaigns check bookkeeping incrementally (bookkeeping.py), a full scan every
    FULL_SCAN_EVERY steps; execute and replay keep the exact mode (a full scan per step)."""
    for a in (ad, getattr(ad, "twin", None)):
        if a is not None:
            a.full_scan_every = FULL_SCAN_EVERY


def _shrink(layout: str, num_blocks: int, fault: str | None, f: Finding, strict: bool,
            seconds: float, twin: bool = False, sched_policy: str = "fcfs") -> Finding:
    """The one shrinker, while the same check still fails. The finding is first re-located in
    the exact mode: a violation the incremental check saw late is reported where it happened."""
    run = lambda prog: execute(layout, num_blocks, fault, prog, strict, twin, sched_policy)[1]   # noqa: E731
    exact = run(f.program)
    if exact is not None:
        f = exact
    return shrink_finding(f, run, lambda g: g.checks == f.checks, seconds, _alternatives(num_blocks), _requests)


def _requests(prog: list[Act]) -> list[list[int]]:
    """Steps the shrinker deletes together: one request's steps (submit to finish), and any
    two of them (a preempt with the re-admission after it, two decodes), no chunk holds."""
    by: dict[str, list[int]] = {}
    for i, x in enumerate(prog):
        r = x.params.get("r")
        if isinstance(r, str):
            by.setdefault(r, []).append(i)
    pairs = [[a, b] for g in by.values() for k, a in enumerate(g) for b in g[k + 1:]]
    return list(by.values()) + pairs


def _alternatives(num_blocks: int):
    """Per step, steps that may stand for it and let more go: a lookup or prefill that takes
    the whole prompt (the following prefills then have nothing left: they go), a shorter
    prompt, and an eviction of one cached block (the connector's `evict_blocks`) in place of
    any step, which can stand for the requests whose allocations pushed that block out."""
    evictions = [Act("evict_blocks", {"block_ids": [b]}) for b in range(1, num_blocks)]

    def alts(prog: list[Act]) -> list[list[Act]]:
        out: list[list[Act]] = []
        for x in prog:
            p, mine = x.params, []
            if x.action in ("lookup", "prefill") and p.get("chunk", 0) < 10**6:
                mine.append(Act(x.action, {**p, "chunk": 10**6}))
            elif x.action == "submit" and len(p.get("tokens", ())) > 2:
                t = list(p["tokens"])
                mine += [Act("submit", {**p, "tokens": t[:n]}) for n in sorted({len(t) // 2, len(t) - 1}) if n >= 1]
            if x.action != "evict_blocks":
                mine += evictions
            out.append(mine)
        return out
    return alts


def _save(layout: str, num_blocks: int, fault: str | None, seed: int, f: Finding, strict: bool,
          out_dir: str, tag: str, twin: bool = False, size: dict | None = None, sched_policy: str = "fcfs") -> dict:
    knobs = sched_policy if isinstance(sched_policy, engine_gen.SchedKnobs) else None
    trace = to_trace(None, f.trail, seed, engine="vllm-fuzz", cfg=layout_config(layout), sut="vllm",
                     finding=f, fault=fault,
                     meta={"vllm_version": vllm_version(), "layout": layout, "num_blocks": num_blocks,
                           "strict_reuse": strict, "sched_policy": knobs.policy if knobs else sched_policy,
                           **({"drive": "engine", "scheduler": knobs.as_dict()} if knobs else {}),
                           **({"dense_twin": True} if twin else {}),
                           **({"lost_reuse_size": size} if size else {}),
                           **({"layout_file": FILE_LAYOUTS[layout]} if layout in FILE_LAYOUTS else {})})
    path = str(trace.save(Path(out_dir) / f"vllm-{_file_safe(layout)}-{tag}-seed{seed}.json"))
    return {"kind": f.kind, "check": f.checks[0], "message": f.message, "trace": path, "layout": layout,
            "steps": len(trace.steps), "replay": f"kvcheck replay {path} --sut vllm",
            **({"size": size} if size else {}),
            **(write_reproducer(trace, path) if knobs is None else write_engine_reproducer(trace, path))}


def _file_safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def run_campaign(layout: str, budget_s: float | None = 60, steps: int | None = None,
                 seed: int = 0, strict_reuse: bool = False, fault: str | None = None,
                 out_dir: str = "kvcheck-report", twin: bool | None = None,
                 workload: str = "random", drive: str = "auto", sched_policy: str = "fcfs",
                 acknowledged: Mapping[str, Acknowledgement] | None = None, strict_known: bool = False,
                 steer: Steer | None = None) -> dict:
    """`_campaign`, then the core's rule for known defects (fuzz/known.py): a recognised one
    is a finding unless `acknowledged`; a stale acknowledgement fails with `strict_known`.
    `steer`: where episodes come from (fuzz/steer.py; None: fresh random episodes)."""
    steer = steer or Steer("random", seed)
    try:
        res = _campaign(layout, budget_s, steps, seed, strict_reuse, fault, out_dir, twin, workload, drive,
                        sched_policy, steer)
    except (VllmUnavailable, ValueError):
        raise                          # the release lacks it, or bad arguments: one line, exit 2
    except Exception as e:  # noqa: BLE001 - kvcheck's side of the boundary is "cannot drive"
        cd = e if isinstance(e, CannotDrive) else as_cannot_drive(e, "vllm", vllm_version(), ("vllm",))
        if cd is None:
            raise
        return cd.result(sut="vllm", vllm_version=vllm_version(), layout=layout, seed=seed, fault=fault,
                         steps=0, coverage={})
    finally:
        steered = steer.stop()
    res["steer"] = steered
    fails = frozenset(FOR_FINDING) - (frozenset() if strict_reuse else {"lost_reuse"})
    return judge(res, known.defects(), acknowledged, res["vllm_version"], strict_known, fails)


def _campaign(layout: str, budget_s: float | None = 60, steps: int | None = None,
              seed: int = 0, strict_reuse: bool = False, fault: str | None = None,
              out_dir: str = "kvcheck-report", twin: bool | None = None,
              workload: str = "random", drive: str = "auto", sched_policy: str = "fcfs",
              steer: Steer | None = None) -> dict:
    """Fuzz one layout until the budget (seconds and/or steps) is spent or a violation is found.
    Without `strict_reuse`, the first three kinds of lost reuse are saved as findings and the
    campaign goes on. `twin` (default: when the layout sets a retention interval): run the
    dense twin beside it (twin.py). `workload`: "random" or "chat" (workloads.py).
    `drive`: "engine" (vLLM's own Scheduler: engine_sched.py), "single" (one request per step),
    "scheduler" (sched.py: steps of several requests, chunked prefill, preemption), "mixed" (each
    episode draws one of the two) or "auto" (engine where it can run, else mixed: drive_plan.py);
    `sched_policy`: the scheduler's preemption policy, "fcfs" or "priority" (None: drawn per
    episode on the engine drive)."""
    from . import generator as gen_layouts
    steer = steer or Steer("random", seed)
    p = drive_plan.plan(layout, fault, twin, workload, drive, sched_policy, seed)     # once, before the loop
    drive, engine, twin, twin_arg, sched_policy = p.drive, p.engine, p.twin, p.twin_arg, p.sched_policy
    generated = layout == GENERATED       # a layout sampled per episode (generator.py)
    layout_all, sampled = layout, 0
    t0 = time.monotonic()
    if budget_s is None and steps is None:
        budget_s = 60
    deadline = t0 + budget_s if budget_s is not None else float("inf")
    coverage: Counter = Counter()
    findings: list[dict] = []
    lost_seen: set[str] = set()
    total, episodes, hits, lost_total, scheduler_episodes = 0, 0, 0, 0, 0
    exit_code: int = ExitCode.OK
    first_fail_s = first_lost_s = None
    twins: list = []
    first_known: dict[str, float] = {}       # known defect -> seconds to its first sighting
    knobs_seen: dict[str, Counter] = {}      # the scheduler drive: each knob's values over episodes
    while time.monotonic() < deadline and (steps is None or total < steps):
        ep = steer.episode(seed * 1_000_003 + episodes)
        ep_seed = ep.seed                    # (a corpus entry's: the same config, replayed and extended)
        if generated:
            layout, sampled = gen_layouts.sample_layout(ep_seed, fault, engine), sampled + 1
        rng = random.Random(ep_seed)
        if generated:
            twin = wants_twin(layout, fault) if twin_arg is None and not engine else bool(twin_arg)
        gen = _Gen(rng, layout_scale(layout)[1])
        policy: "str | engine_gen.SchedKnobs" = sched_policy     # (engine: the episode's knobs)
        if engine:
            policy = engine_gen.draw_knobs(rng, layout, sched_policy)
            if fault == CONNECTOR_CACHE_EARLY.name:        # (planted in the connector's path: on)
                policy = dataclasses.replace(policy, connector=True)
            gen = engine_gen.EngineGen(gen)
        stepped = drive == "scheduler" or (drive == "mixed" and episodes % 2 == 1)   # mixed: alternate
        scheduler_episodes += engine
        if stepped:
            gen = SchedGen(gen, sched_policy)
            scheduler_episodes += 1
        if workload != "random":
            gen = WORKLOADS[workload](gen)
        per_req = max(16, layout_scale(layout)[1] // min(bs for _, bs, _ in LAYOUT_DATA[layout][1]))
        num_blocks = rng.choice([10, 14, 20, 32]) * max(2, len(LAYOUT_DATA[layout][1])) // 2 * per_req // 16
        num_blocks = policy.num_blocks if engine else num_blocks
        if engine:
            for k, v in policy.as_dict().items():
                knobs_seen.setdefault(k, Counter())[str(v)] += 1
        ad = make_adapter(layout, num_blocks, fault, strict_reuse, twin, policy)
        _incremental(ad)
        known.install(ad, vllm_version())     # known defects counted here, judged by run_campaign
        core = Lockstep(FreeModel(), ad)
        viol: Finding | None = None
        gen = ep.wrap(gen, rng)
        for _ in range(len(ep.prefix) + rng.randint(20, 120)):
            if steps is not None and total >= steps:
                break
            total += 1
            n_lost = len(ad.lost)
            try:
                core.step(Act(*gen.next(ad)))
            except Finding as f:
                viol = f
            if viol is not None and (name := known.of_finding(ad, viol, vllm_version())):
                coverage[f"known:{name}"] += 1
                first_known.setdefault(name, round(time.monotonic() - t0, 2))
                viol = None
                break                           # the episode's manager carries the defect: the next one
            names, rest = known.sort_lost(ad, n_lost, core.program[-1], vllm_version()) \
                if len(ad.lost) > n_lost else ([], [])
            for name in names:
                coverage[f"known:{name}"] += 1
                first_known.setdefault(name, round(time.monotonic() - t0, 2))
            if rest:
                lost_total += 1
                first = first_lost_s is None
                if first:
                    first_lost_s = round(time.monotonic() - t0, 2)
                last = rest[-1]
                key = f"{last.check}:{last.message.split(': ')[0]}"      # per check and layout (gen:SEED, file:NAME)
                if not strict_reuse and key not in lost_seen and len(lost_seen) < 3:
                    lost_seen.add(key)
                    lv = core.stamp(Finding("lost_reuse", [last.check], last.message))
                    small = _shrink(layout, num_blocks, fault, lv, True, min(deadline - time.monotonic(), 20), twin,
                                    policy)
                    if small.checks[0].startswith("known:"):      # shrunk, it is a known defect's
                        coverage[small.checks[0]] += 1
                        first_known.setdefault(small.checks[0][6:], round(time.monotonic() - t0, 2))
                        lost_total -= 1
                        first_lost_s = None if first else first_lost_s
                        continue
                    findings.append(_save(layout, num_blocks, fault, ep_seed, small, True, out_dir,
                                          f"{last.check}{len(lost_seen)}", twin,
                                          _size_of(layout, num_blocks, fault, small, twin, policy), policy))
            if viol is not None:
                break
        hits += ad.hits
        steer.done(ep, core.program)
        coverage.update(ad.coverage)
        if twin:
            twins.append(ad)
        episodes += 1
        if generated and not any(f["layout"] == layout for f in findings) and viol is None:
            gen_layouts.forget(layout)
        if viol is not None:
            at = round(time.monotonic() - t0, 2)
            strict = viol.kind == "lost_reuse"
            small = _shrink(layout, num_blocks, fault, viol, strict, 30, twin, policy)
            if small.checks[0].startswith("known:"):              # shrunk, it is a known defect's:
                coverage[small.checks[0]] += 1                    # counted, and the campaign goes on
                first_known.setdefault(small.checks[0][6:], at)
                continue
            first_fail_s = at
            findings.append(_save(layout, num_blocks, fault, ep_seed, small, strict, out_dir, viol.checks[0],
                                  twin, _size_of(layout, num_blocks, fault, small, twin, policy) if strict else None,
                                  policy))
            exit_code = FOR_FINDING[viol.kind]
            break
    declared = engine_sched.ENGINE_ACTIONS if engine else ACTIONS
    missing = [a for a in declared if not coverage.get(a) and (engine or scheduler_episodes or a not in STEP_ACTIONS)]
    if exit_code == 0 and floor_shortfall({"steps": total}, missing):     # the coverage floor
        exit_code = ExitCode.UNDECIDED
    return {
        "sut": "vllm", "vllm_version": vllm_version(), "layout": layout_all, "seed": seed,
        **({"layouts_sampled": sampled, "layouts_refused_by_vllm": dict(gen_layouts.REFUSALS)} if generated else {}),
        "fault": fault, "expected_check": FAULTS[fault][0] if fault else None,
        "caught": (any(f["check"] == FAULTS[fault][0] for f in findings) if fault else None),
        "strict_reuse": strict_reuse, "steps": total, "episodes": episodes,
        "drive": drive, "drive_reason": p.reason,          # (the drive that ran: never auto)
        "sched_policy": sched_policy or "drawn per episode", "scheduler_episodes": scheduler_episodes,
        **({"scheduler": engine_gen.describe(knobs_seen)} if engine else {}),
        "elapsed_s": round(time.monotonic() - t0, 2), "time_to_failure_s": first_fail_s,
        "time_to_first_lost_reuse_s": first_lost_s, "time_to_first_known_s": first_known,
        "coverage": {k: coverage[k] for k in sorted(coverage)}, "missing_actions": missing,
        "lookups_with_hit": hits, "lost_reuse_lookups": lost_total,
        "findings": findings, "exit_code": exit_code, "workload": workload,
        **({"dense_twin": twin_summary(twins)} if twin else {}),
        "reuse_profile": reuse_profile(layout) if twin and not generated else {},   # (generated: forgotten)
    }


def _size_of(layout: str, num_blocks: int, fault: str | None, f: Finding, twin: bool,
             sched_policy: str = "fcfs") -> dict | None:
    """The size (tokens lost, share of the prompt) of a shrunk lost-reuse finding: its program
    is run once more and the last lost reuse measured (the map-based check records none)."""
    ad, _ = execute(layout, num_blocks, fault, f.program, True, twin, sched_policy)
    return getattr(ad.lost[-1], "size", None) if ad.lost else None


def replay(trace: Trace | str | Path) -> dict:
    """Replay a vLLM trace on the one replay; report whether it reproduces its recorded violation."""
    if not isinstance(trace, Trace):
        trace = Trace.load(trace)
    layout = resolve_layout(trace)
    try:
        with setting_up("vllm", vllm_version, ("vllm",), (VllmUnavailable, ValueError)):
            ad = make_adapter(layout, int(trace.meta.get("num_blocks", 24)), trace.fault,
                              bool(trace.meta.get("strict_reuse")), bool(trace.meta.get("dense_twin")),
                              engine_gen.knobs_of(trace.meta) or trace.meta.get("sched_policy", "fcfs"))
        code, out = replay_on_core(trace, ad, FreeModel())
    except CannotDrive as e:
        return {**e.result(sut="vllm", vllm_version=vllm_version(), layout=layout, fault=trace.fault,
                           steps=len(trace.steps), violation=None),
                "expected": (trace.violation or {}).get("check"), "reproduced": False}
    v = out.get("violation")
    want = (trace.violation or {}).get("check")
    return {
        "sut": "vllm", "vllm_version": vllm_version(), "layout": layout, "fault": trace.fault,
        "steps": len(trace.steps), "sched_policy": trace.meta.get("sched_policy", "fcfs"),
        "violation": None if v is None else {k: v[k] for k in ("kind", "check", "message", "step")},
        "expected": want, "reproduced": want == (v["check"] if v else None),
        "lost_reuse": [str(x) for x in ad.lost], "exit_code": code,
    }
