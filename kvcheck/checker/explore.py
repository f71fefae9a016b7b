"""`kvcheck explore`: exhaustive explicit-state exploration of the spec (breadth first).

Owns the explicit-state engine. States are the spec's flat tuples; successors come from the
compiled action instances (`Spec.instances`). Request slots are interchangeable in the spec
(every per-request action exists for every slot, invariants and decisions quantify over all
slots, no slot index is stored in the state), so states are canonicalised by sorting the
per-request field blocks (symmetry reduction; tests check it against a brute-force count and
that successor sets commute with the permutation). BFS order makes the first violating state
found a shortest one; its path is saved as a trace in the shared format.

Also reported: per-action coverage, `sometimes` properties (every decision kind and every object
state reached: the vacuity check), deadlocks (a request not idle and nothing enabled), states
from which "every request idle" is unreachable, and the per-kind state diagrams observed.
"""
from __future__ import annotations

import shlex
import time
from ..spec.outputs import file_stem
from array import array
from collections import Counter, deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..fuzz import faults as faultlib
from ..spec.config import Config, LayerSpec
from ..spec.objects import DECISIONS, DECISION_KINDS, KIND, R_IDLE, state_name
from ..spec.outputs import write_atomic
from ..spec.system import Spec
from ..spec.verdict import ExitCode
from .diagrams import write_diagrams

# The CI profile: configs small enough to be explored EXHAUSTIVELY in well under a minute on
# one core (the four version counters multiply every object's stamps, so no single config with
# versions, tiers and two blocks fits; the profile splits them):
#  - "versions": one csa group (compressed_kv, indexer, SWA branch), 1 block, versions may bump
#    once, device tier only: bumps, stale leases (use_stale), REUSE/RECOMPUTE, TOCTOU at use.
#  - "tiers": one swa group (W=5), 2 blocks, no version bumps, host/disk tiers: PARTIAL and
#    PREFETCH decisions, window slides, every on-disk state (offload, prefetch, verify, quarantine).
CI_PROFILE: dict[str, Config] = {
    "versions": Config(layers=(LayerSpec("csa", window=6, m=4, topk=1),), blocks=1, requests=1,
                       max_version=1, tiers=("device",), reserve=0,
                       capacity={"compressed_kv": 1, "swa_window": 1, "indexer": 1},
                       max_inflight=1, max_active=1),
    "tiers": Config(layers=(LayerSpec("swa", window=5),), blocks=2, requests=1, max_version=0,
                    reserve=0, capacity={"swa_window": 2}, max_inflight=1, max_active=1),
}
CI_CONFIG = CI_PROFILE["versions"]
# Planted faults: BFS stops at the first (shortest) violation, long before exhaustion. One csa
# group with m = 3 blocks (so a tail snapshot other than the one at the hit point exists), a
# window of two pages, disk tier, versions.
FAULT_CONFIG = Config(layers=(LayerSpec("csa", window=6, m=12, topk=1),), blocks=3, requests=1,
                      capacity={"compressed_kv": 1, "tail": 2, "swa_window": 3, "indexer": 1},
                      max_inflight=1, max_active=1)
# admission_ignored needs a pool smaller than its objects (here 2 SWA pages for 3 blocks).
# The content faults (prompts > 1) need a request to recompute a block under another prompt and
# a later one to hit it: one full-attention group over 2 blocks keeps that within BFS reach.
_CONTENT = Config(layers=(LayerSpec("full"),), blocks=2, requests=1, max_version=0, prompts=2,
                  tiers=("device",), capacity={"swa_window": 2}, max_inflight=1, max_active=1)
# Content on disk: an offloaded copy carries its lineage (dcid); one block, restored only under
# its own content (9,923 states, exhaustive).
_CONTENT_DISK = replace(_CONTENT, blocks=1, tiers=("device", "disk"), reserve=0)
# alloc = evict: one SWA group whose window covers one block, two pages for three blocks: an
# append finds the pool full and evicts a page slid out of the window, or fails and preempts.
_ALLOC = Config(layers=(LayerSpec("swa", window=4),), blocks=3, requests=1, max_version=0,
                tiers=("device",), reserve=0, capacity={"swa_window": 2}, max_inflight=1,
                max_active=1, alloc="evict")
# duplicates = allow: two requests recompute block 0 (a second copy), one finishes, the other
# appends block 1 into the full pool, evicting the unreferenced copy (full attention's one
# victim). Exhaustive: 89,178 states (a test: -m slow); to depth 12 it reaches append_evict_copy.
_DUP = Config(layers=(LayerSpec("full"),), blocks=2, requests=2, max_version=0, tiers=("device",),
              capacity={"swa_window": 2}, max_inflight=1, max_active=2, alloc="evict",
              duplicates="allow")
FAULT_OVERRIDES: dict[str, Config] = {
    "admission_ignored": replace(FAULT_CONFIG, capacity={"compressed_kv": 1, "tail": 1,
                                                         "swa_window": 2, "indexer": 1}),
    "hash_ignores_parent": _CONTENT,
    "stale_hash_after_reuse": _CONTENT,
    "hash_missing_salt": replace(_CONTENT, salted_prompts=1),
    "copy_ignores_capacity": replace(_DUP, capacity={"swa_window": 1}),
    "restore_under_stale_key": _CONTENT_DISK,
}


def fault_config(fault: str | None) -> Config:
    """The config a planted fault is explored in (with the semantic it lives in switched on)."""
    if fault is None:
        return CI_CONFIG
    return FAULT_OVERRIDES.get(fault) or faultlib.get(fault).config_for(FAULT_CONFIG)


class Canon:
    """Symmetry reduction over request slots: sort the per-request field blocks."""

    def __init__(self, spec: Spec) -> None:
        lay = spec.lay
        self.n = spec.cfg.requests
        self.lo = lay.r(0, "rst")
        self.w = lay.r(1, "rst") - self.lo if self.n > 1 else 0
        self.hi = self.lo + self.w * self.n

    def __call__(self, s: tuple) -> tuple:
        if self.n == 1:
            return s
        lo, w = self.lo, self.w
        blocks = sorted(s[lo + i * w: lo + (i + 1) * w] for i in range(self.n))
        out = s[:lo]
        for b in blocks:
            out += b
        return out + s[self.hi:]


@dataclass
class ExploreResult:
    states: int
    transitions: int
    depth: int
    seconds: float
    exhaustive: bool
    violation: dict[str, Any] | None
    report: dict[str, Any]


def explore(cfg: Config, fault: str | None = None, max_states: int = 2_000_000,
            symmetry: bool = True, keep_graph: bool = False, liveness: bool = True,
            seconds: float | None = None, max_depth: int | None = None) -> tuple[Spec, ExploreResult, Any]:
    spec = Spec(cfg, fault)
    canon = Canon(spec) if symmetry else (lambda s: s)
    insts = spec.instances
    t0 = time.perf_counter()
    init = canon(spec.init())
    ids: dict[tuple, int] = {init: 0}
    states: list[tuple] = [init]
    parent = array("l", [-1])
    via = array("l", [-1])
    depth_of = array("l", [0])
    src, dst = array("l"), array("l")          # edges (quotient graph), kept for liveness/graph
    keep_edges = liveness or keep_graph
    act_count: Counter = Counter()
    trans: set[tuple[str, int, int]] = set()
    deadlocks = 0
    deadlock_example = -1
    rst_slots = [spec.lay.r(r, "rst") for r in range(cfg.requests)]
    violation = None
    bad0 = spec.check(init)
    if bad0:
        violation = (0, None, bad0)
    q = 0
    exhaustive = True
    deadline = t0 + seconds if seconds else None
    while violation is None and q < len(states):
        if len(states) >= max_states or (deadline and time.perf_counter() > deadline):
            exhaustive = False
            break
        s = states[q]
        sid = q
        q += 1
        d1 = depth_of[sid] + 1
        if max_depth is not None and d1 > max_depth:
            exhaustive = False
            continue
        any_enabled = False
        for inst in insts:
            if not inst.guard(s):
                continue
            any_enabled = True
            t = inst.effect(s)
            act_count[inst.index] += 1
            for slot, kind in inst.state_slots:
                a, b = s[slot], t[slot]
                if a != b:
                    trans.add((kind, a, b))
            c = canon(t)
            tid = ids.get(c)
            if tid is None:
                tid = len(states)
                ids[c] = tid
                states.append(c)
                parent.append(sid)
                via.append(inst.index)
                depth_of.append(d1)
                bad = spec.check_after(inst, t)
                if bad:
                    violation = (tid, inst, bad)
                    break
            if keep_edges:
                src.append(sid)
                dst.append(tid)
        if not any_enabled and any(s[i] != R_IDLE for i in rst_slots):
            deadlocks += 1
            if deadlock_example < 0:
                deadlock_example = sid
    if violation is not None:
        exhaustive = False
    seconds_taken = time.perf_counter() - t0
    n = len(states)

    # ---- coverage and sometimes properties ---------------------------------------------
    by_action: Counter = Counter()
    for idx, cnt in act_count.items():
        by_action[insts[idx].action] += cnt
    for a in spec.actions:
        by_action.setdefault(a, 0)
    lay = spec.lay
    rdec = [lay.r(r, "rdec") for r in range(cfg.requests)]
    dec_seen = {DECISIONS[v] for v in {s[i] for s in states for i in rdec}} & set(DECISION_KINDS)
    obj_states: set[str] = set()
    kinds_present = {o.kind for o in lay.objects}
    for k in kinds_present:
        obj_states.add(f"{k}:free")
    if cfg.offload_enabled:
        obj_states.add("on_disk:none")
    for kind, a, b in trans:
        obj_states.add(f"{kind}:{state_name(kind, b)}")
    required = [f"{k}:{st}" for k in sorted(kinds_present) for st in
                KIND[k].states[:1] + KIND[k].reachable_states()]
    if cfg.offload_enabled:
        required += [f"on_disk:{st}" for st in KIND["on_disk"].states]
    sometimes = {f"decision {d}": d in dec_seen for d in DECISION_KINDS}
    sometimes.update({f"state {s_}": s_ in obj_states for s_ in required})
    sometimes.update({f"action {a}": by_action[a] > 0 for a in spec.actions})

    # ---- liveness: can every request get back to idle? -----------------------------------
    stuck = None
    if liveness and exhaustive:
        idle = [i for i, s in enumerate(states) if all(s[j] == R_IDLE for j in rst_slots)]
        radj: list[list[int]] = [[] for _ in range(n)]
        for a, b in zip(src, dst):
            radj[b].append(a)
        good = bytearray(n)
        dq = deque(idle)
        for i in idle:
            good[i] = 1
        while dq:
            x = dq.popleft()
            for p in radj[x]:
                if not good[p]:
                    good[p] = 1
                    dq.append(p)
        stuck_ids = [i for i in range(n) if not good[i]]
        stuck = {"count": len(stuck_ids)}
        if stuck_ids:
            first = min(stuck_ids, key=lambda i: depth_of[i])
            stuck["example_path"] = [insts[i].label() for i in _path(parent, via, first)]

    graph = None
    if keep_graph:
        import networkx as nx
        graph = nx.DiGraph()
        for i, st in enumerate(states):
            graph.add_node(i, state=",".join(map(str, st)), depth=int(depth_of[i]))
        for a, b in zip(src, dst):
            graph.add_edge(a, b)

    viol_rep = None
    if violation is not None:
        tid, inst, bad = violation
        path = [insts[i] for i in _path(parent, via, tid)]
        viol_rep = {"depth": len(path), "action": inst.label() if inst else "init",
                    "invariants": sorted({i for i, _ in bad}),
                    "where": [f"{i}: {w}" for i, w in bad][:20],
                    "path": path}
    report = {
        "states": n, "transitions": len(src) if keep_edges else sum(act_count.values()),
        "depth": max(depth_of) if n else 0, "seconds": round(seconds_taken, 3),
        "states_per_s": round(n / max(seconds_taken, 1e-9)), "exhaustive": exhaustive,
        "max_states": max_states, "symmetry": symmetry and cfg.requests > 1,
        "actions": dict(sorted(by_action.items())),
        "decisions": sorted(dec_seen, key=DECISION_KINDS.index),
        "object_states": sorted(obj_states),
        "transitions_observed": sorted(f"{k}:{state_name(k, a)}->{state_name(k, b)}" for k, a, b in trans),
        "sometimes": sometimes,
        "sometimes_missing": [k for k, ok in sometimes.items() if not ok],
        "deadlocks": deadlocks,
        "deadlock_example": ([insts[i].label() for i in _path(parent, via, deadlock_example)]
                             if deadlock_example >= 0 else None),
        "idle_unreachable": stuck,
    }
    res = ExploreResult(n, report["transitions"], report["depth"], seconds_taken, exhaustive,
                        viol_rep, report)
    return spec, res, graph


def _path(parent: array, via: array, tid: int) -> list[int]:
    out = []
    while parent[tid] >= 0:
        out.append(via[tid])
        tid = parent[tid]
    return out[::-1]


def concrete_steps(spec: Spec, path: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    """The BFS path runs on canonical states; re-play it concretely from Init, choosing at each
    step the instance (same action) whose successor has the expected canonical form."""
    canon = Canon(spec)
    s = spec.init()
    cs = canon(s)
    out = []
    for inst in path:
        target = canon(inst.effect(cs))
        for cand in spec.instances:
            if cand.action == inst.action and cand.guard(s) and canon(cand.effect(s)) == target:
                out.append((cand.action, dict(cand.params)))
                s = cand.effect(s)
                cs = target
                break
        else:  # pragma: no cover - symmetry reduction unsound
            raise RuntimeError(f"could not concretise step {inst.label()}")
    return out


# ---- the command ------------------------------------------------------------------------

def run_explore(cfg: Config, out: Path | None = None, fault: str | None = None,
                max_states: int = 2_000_000, graph_file: str | None = None,
                config_path: str | None = None, seconds: float | None = None) -> tuple[int, dict[str, Any]]:
    if fault is not None:
        f = faultlib.get(fault)
        if f.layer != "spec":
            raise faultlib.UnknownFault(f"{fault} (a {f.layer} fault: explore plants spec faults only)")
    spec, res, graph = explore(cfg, fault, max_states, keep_graph=graph_file is not None,
                               liveness=fault is None, seconds=seconds)
    rep = dict(res.report)
    cmd = ["kvcheck", "explore"] + (["--config", config_path] if config_path else []) \
        + (["--fault", fault] if fault else [])
    rep.update({"command": shlex.join(cmd), "fault": fault, "config": cfg.to_dict()})
    code = ExitCode.OK
    if res.violation is not None:
        v = res.violation
        steps = concrete_steps(spec, v.pop("path"))
        from ..fuzz.walk import to_trace
        tr = to_trace(spec, steps, None, engine="explore")
        tr.meta = {"depth": len(steps), "found_by": "kvcheck explore (BFS: shortest)"}
        dest = (out or Path("kvcheck-report")) / f"explore-counterexample-{file_stem(fault or 'clean')}.json"
        path = tr.save(dest)
        v["trace"] = str(path)
        v["steps"] = [s.label() for s in tr.steps]
        v["replay"] = f"kvcheck replay {shlex.quote(str(path))}"
        rep["violation"] = v
        code = ExitCode.INVARIANT
        if fault:
            expected = faultlib.get(fault).expected
            rep["fault_result"] = {"expected": expected, "caught_by": v["invariants"],
                                   "caught": expected in v["invariants"]}
        rep["verdict"] = "violated"
    elif fault:
        rep["fault_result"] = {"expected": faultlib.get(fault).expected, "caught_by": [], "caught": False}
        rep["verdict"] = "fault survived" + ("" if res.exhaustive else " (max-states hit)")
        code = ExitCode.OK if res.exhaustive else ExitCode.UNDECIDED
    elif not res.exhaustive and rep["sometimes_missing"]:
        rep["verdict"] = "undecided: max-states hit before exhaustion, coverage incomplete"
        code = ExitCode.UNDECIDED
    else:
        rep["verdict"] = "holds" + ("" if res.exhaustive else " (bounded: max-states hit)")
    if out is not None:
        rep["diagrams"] = write_diagrams(rep, out)
    if graph is not None and graph_file:
        import networkx as nx
        gp = Path(graph_file)
        if gp.suffix == ".dot":
            lines = ["digraph states {"] + [f"  {a} -> {b};" for a, b in graph.edges] + ["}"]
            write_atomic(gp, "\n".join(lines) + "\n")
        else:
            write_atomic(gp, "\n".join(nx.generate_graphml(graph)) + "\n")
        rep["graph"] = str(gp)
    rep["exit_code"] = code
    return code, rep


def run_profile(out: Path | None = None, max_states: int = 2_000_000) -> tuple[int, dict[str, Any]]:
    """Explore every CI profile config exhaustively and merge their coverage."""
    parts: dict[str, dict[str, Any]] = {}
    codes = []
    for name, cfg in CI_PROFILE.items():
        code, rep = run_explore(cfg, None, None, max_states)
        rep.pop("diagrams", None)
        parts[name] = rep
        codes.append(code)
    reps = list(parts.values())
    sometimes: dict[str, bool] = {}
    for r in reps:
        for k, ok in r["sometimes"].items():
            sometimes[k] = sometimes.get(k, False) or ok
    actions: Counter = Counter()
    for r in reps:
        actions.update(r["actions"])
    merged: dict[str, Any] = {
        "profile": {n: {k: r[k] for k in ("states", "transitions", "depth", "seconds", "states_per_s",
                                          "exhaustive", "sometimes_missing", "deadlocks",
                                          "idle_unreachable", "config", "verdict", "exit_code")}
                    for n, r in parts.items()},
        "states": sum(r["states"] for r in reps), "transitions": sum(r["transitions"] for r in reps),
        "depth": max(r["depth"] for r in reps), "seconds": round(sum(r["seconds"] for r in reps), 3),
        "exhaustive": all(r["exhaustive"] for r in reps), "symmetry": any(r["symmetry"] for r in reps),
        "max_states": max_states, "actions": dict(sorted(actions.items())),
        "decisions": [d for d in DECISION_KINDS if any(d in r["decisions"] for r in reps)],
        "object_states": sorted({x for r in reps for x in r["object_states"]}),
        "transitions_observed": sorted({x for r in reps for x in r["transitions_observed"]}),
        "sometimes": sometimes, "sometimes_missing": [k for k, ok in sometimes.items() if not ok],
        "deadlocks": sum(r["deadlocks"] for r in reps),
        "idle_unreachable": {"count": sum((r["idle_unreachable"] or {}).get("count", 0) for r in reps)},
        "command": "kvcheck explore", "fault": None, "config": None,
    }
    merged["states_per_s"] = round(merged["states"] / max(merged["seconds"], 1e-9))
    viol = next((r for r in reps if "violation" in r), None)
    if viol is not None:
        merged["violation"] = viol["violation"]
        code, verdict = ExitCode.INVARIANT, "violated"
    elif ExitCode.UNDECIDED in codes:
        code, verdict = ExitCode.UNDECIDED, "undecided: max-states hit before exhaustion, coverage incomplete"
    elif merged["sometimes_missing"]:
        code, verdict = ExitCode.UNDECIDED, "undecided: a sometimes-property is never reached (vacuity)"
    else:
        code, verdict = ExitCode.OK, "holds (CI profile explored exhaustively)"
    merged["verdict"], merged["exit_code"] = verdict, code
    if out is not None:
        merged["diagrams"] = write_diagrams(merged, out)
    return code, merged


def mutant_engine(cfg: Config, fault: str | None, budget_s: float, seed: int) -> dict[str, Any]:
    """`kvcheck mutants` entry: BFS on the fault config (the clean control explores the same
    config), within the per-fault budget. Shortest traces, so `trace_len` is minimal."""
    import tempfile
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        code, rep = run_explore(fault_config(fault), Path(d), fault, seconds=budget_s)
    v = rep.get("violation")
    return {"detected": v is not None, "caught_by": v["invariants"] if v else [],
            "seconds": round(time.perf_counter() - t0, 2), "trace_len": len(v["steps"]) if v else None,
            "states": rep.get("states"), "exhaustive": rep.get("exhaustive")}
