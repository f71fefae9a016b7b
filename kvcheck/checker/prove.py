"""`kvcheck prove`: Z3 inductive proofs, bounded model checking and the hit-soundness theorem,
all from the spec's symbolic semantics (the same action bodies and invariants, given `Z3Logic`).

Owns three obligations:

- **Induction** per invariant I: Init => I, and, for every action instance separately,
  TypeOK /\\ (every invariant) /\\ (every auxiliary invariant) /\\ guard => I' (the post-state
  after the instance's writes). Exact frame reasoning: a conjunct whose read set (from the
  compiled spec) misses the instance's write set cannot change and is not re-checked. A failure
  is a counterexample-to-induction (CTI): a pre-state, an action and a post-state, which need not
  be reachable.
- **BMC** from Init to depth K (one incremental solver, a push/pop per depth): a real
  violation, reported as a trace in the shared trace format with its `kvcheck replay` command.
- **Hit soundness** at the lookup step: under the invariants, a REUSE(k) or PARTIAL(k) decision
  of the funnel implies every recovery condition at k (`recovery` of every object kind,
  `layout_ok`, `resident` from objects.py).

The auxiliary invariants (AUX, in prove_aux.py) are what makes the named invariants inductive; they are
proved by the same induction (they are part of the hypothesis and each is itself an obligation).
"""
from __future__ import annotations

import shlex
import time
from ..spec.outputs import file_stem
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..fuzz import faults as faultlib
from ..spec.actions import ACTIONS, Ctx, run_body
from ..spec.config import Config
from ..spec.content import holds_prefix
from ..spec.funnel import Decision
from ..spec.invariants import blocks_read, invariants_for
from ..spec.logic import CONCRETE, TRACE, Expr
from ..spec.objects import DEVICE_KINDS, PARTIAL, REUSE, layout_ok, recovery, resident
from ..spec.state import View
from ..spec.system import Spec
from ..spec.verdict import ExitCode
from .prove_aux import AUX, aux_for  # noqa: F401  (AUX: re-exported)


# ---- results ----------------------------------------------------------------------------

@dataclass
class Obligation:
    name: str
    kind: str                 # invariant | auxiliary | theorem
    status: str = "proved"    # proved | violated | unknown
    method: str = "induction"
    bound: int | None = None
    seconds: float = 0.0
    trace: str | None = None
    cti: dict[str, Any] | None = None
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "kind": self.kind, "status": self.status, "method": self.method,
             "bound": self.bound, "seconds": round(self.seconds, 3), "trace": self.trace}
        if self.cti:
            d["cti"] = self.cti
        if self.note:
            d["note"] = self.note
        return d


def bv_width(lay: Any) -> int:
    """Bits per slot such that the bit-vector reading equals the integer one: signed, wide
    enough for any sum of every slot at its largest value (counts, refcount deltas)."""
    hi = max(max(abs(lo), abs(h)) for lo, h in lay.domains())
    return (lay.size * max(hi, 1) * 2).bit_length() + 1


class Prover:
    def __init__(self, cfg: Config, fault: str | None = None, timeout_ms: int = 60_000) -> None:
        import z3
        from ..spec.logic import Z3Logic
        self.cfg, self.fault = cfg, fault
        self.spec = Spec(cfg, fault)
        self.lay = self.spec.lay
        self.aux = aux_for(cfg)
        # Induction and the theorem read slots as integers (measured 2x faster there than
        # bit-vectors); BMC reads them as bit-vectors (a 13-step counterexample in ~6 s where
        # integers took > 5 min): `bmc_logic`.
        self.z3, self.Z = z3, Z3Logic()
        self.bmc_logic = Z3Logic(bv_width(self.lay))
        self.timeout_ms = timeout_ms
        self.x = [self.Z.var(f"s{i}") for i in range(self.lay.size)]
        # read sets of every conjunct (named invariants and auxiliaries), from the compiled spec
        self.reads: dict[tuple[str, str], frozenset[int]] = {}
        for k in self.spec.conjuncts:
            self.reads[(k.invariant, k.where)] = k.reads
        c = Ctx(View(self.spec.sym, self.lay), TRACE, self.lay, fault)
        for a in self.aux.values():
            for where, p in a.conjuncts(c):
                self.reads[(a.name, where)] = p.reads if isinstance(p, Expr) else frozenset()
        self.names = list(invariants_for(cfg)) + list(self.aux)

    # ---- symbolic helpers ---------------------------------------------------------------
    def conjuncts(self, vec: list[Any], Z: Any = None) -> dict[str, list[tuple[str, Any]]]:
        c = Ctx(View(vec, self.lay), Z or self.Z, self.lay, self.fault)
        out: dict[str, list[tuple[str, Any]]] = {}
        for name, inv in invariants_for(self.cfg).items():
            out[name] = [(w, p) for w, p in inv.conjuncts(c) if p is not True]
        for name, a in self.aux.items():
            out[name] = [(w, p) for w, p in a.conjuncts(c) if p is not True]
        return out

    def _b(self, p: Any) -> Any:
        return self.z3.BoolVal(bool(p)) if isinstance(p, bool) else p

    def step(self, vec: list[Any], inst: Any, Z: Any = None) -> tuple[Any, dict[int, Any]]:
        Z = Z or self.Z
        guard, writes = run_body(ACTIONS[inst.action], View(vec, self.lay), Z, self.lay,
                                 self.fault, inst.params)
        writes = {i: (Z.val(e) if isinstance(e, int) else e) for i, e in writes.items()}
        writes = {i: e for i, e in writes.items() if not e.eq(vec[i])}
        return self._b(guard), writes

    def _substituter(self, writes: dict[int, Any]) -> Callable[[Any], Any]:
        """e -> e[x_i := writes[i]], through the C API with the pair arrays built once (the
        Python `z3.substitute` re-checks every pair on every call: 10 s at 8 blocks)."""
        z3, n = self.z3, len(writes)
        src, dst = (z3.Ast * n)(), (z3.Ast * n)()
        for k, (i, e) in enumerate(writes.items()):
            src[k], dst[k] = self.x[i].as_ast(), e.as_ast()
        ctx = self.x[0].ctx

        def sub(e: Any) -> Any:
            return z3.z3._to_expr_ref(z3.Z3_substitute(ctx.ref(), e.as_ast(), n, src, dst), ctx)
        return sub

    def solver(self) -> Any:
        s = self.z3.Solver()
        s.set("timeout", self.timeout_ms)
        return s

    def model_state(self, m: Any) -> tuple[int, ...]:
        return tuple(self.Z.num(m.eval(xi, model_completion=True)) for xi in self.x)

    def describe_cti(self, pre: tuple[int, ...], inst: Any, post: tuple[int, ...],
                     failed: list[str]) -> dict[str, Any]:
        d_pre, d_post = self.lay.describe(pre), self.lay.describe(post)
        return {"action": inst.label(), "conjuncts": failed[:10],
                "changed": {k: [d_pre[k], d_post[k]] for k in d_pre if d_pre[k] != d_post[k]},
                "pre": d_pre}

    # ---- induction ----------------------------------------------------------------------
    def induction(self, only: set[str] | None = None) -> dict[str, Obligation]:
        z3 = self.z3
        names = [n for n in self.names if only is None or n in only]
        res = {n: Obligation(n, "auxiliary" if n in self.aux else "invariant") for n in names}
        init = [self.Z.val(v) for v in self.lay.init()]
        t0 = time.perf_counter()
        init_conj = self.conjuncts(init)
        for n in names:
            bad = [w for w, p in init_conj[n] if z3.is_false(z3.simplify(self._b(p)))]
            if bad:
                res[n].status = "violated"
                res[n].note = "Init violates it: " + "; ".join(bad[:5])
        per = (time.perf_counter() - t0) / max(len(names), 1)
        for o in res.values():
            o.seconds += per
        pre = self.conjuncts(self.x)
        hyp = [p for ps in pre.values() for _, p in ps]
        for inst in self.spec.instances:
            t1 = time.perf_counter()
            guard, writes = self.step(self.x, inst)
            ws = set(writes)
            sub = self._substituter(writes)
            # I' for the conjuncts the instance can change: the pre-state terms with the
            # written slots substituted (z3 does it in C++; rebuilding every conjunct over the
            # post-state in Python was 85% of the induction time)
            goals: dict[str, list[tuple[str, Any]]] = {}
            for n in names:
                aff = [(w, sub(self._b(p))) for w, p in pre[n]
                       if self.reads.get((n, w), frozenset()) & ws]
                if aff:
                    goals[n] = aff
            build = time.perf_counter() - t1
            if not goals:
                continue
            s = self.solver()
            s.add(*hyp)
            s.add(guard)
            s.push()
            s.add(z3.Not(z3.And(*[p for g in goals.values() for _, p in g])))
            r = s.check()
            s.pop()
            elapsed = time.perf_counter() - t1
            total = sum(len(g) for g in goals.values())
            if r == z3.unsat:
                for n, g in goals.items():
                    res[n].seconds += elapsed * len(g) / total
                continue
            # split: which invariants fail on this instance
            for n, g in goals.items():
                t2 = time.perf_counter()
                s.push()
                s.add(z3.Not(z3.And(*[p for _, p in g])))
                rr = s.check()
                if rr == z3.sat and res[n].status == "proved":
                    m = s.model()
                    pre_s = self.model_state(m)
                    post_s = inst.effect(pre_s)
                    failed = [w for w, p in g if z3.is_false(m.eval(p, model_completion=True))]
                    res[n].status = "unknown"
                    res[n].cti = self.describe_cti(pre_s, inst, post_s, failed)
                    res[n].note = "not inductive: counterexample-to-induction (CTI) at " + inst.label()
                elif rr == z3.unknown and res[n].status == "proved":
                    res[n].status = "unknown"
                    res[n].note = f"solver unknown at {inst.label()}: {s.reason_unknown()}"
                s.pop()
                res[n].seconds += build * len(g) / total + (time.perf_counter() - t2)
        return res

    # ---- hit soundness ------------------------------------------------------------------
    def hit_soundness(self) -> Obligation:
        z3, Z = self.z3, self.Z
        t0 = time.perf_counter()
        ob = Obligation("hit_soundness_theorem", "theorem")
        v = View(self.x, self.lay)
        s = self.solver()
        s.add(*[p for ps in self.conjuncts(self.x).values() for _, p in ps])
        for r in range(self.cfg.requests):
            d = Decision(v, Z, self.cfg, r, self.fault)
            for k in range(1, self.cfg.blocks + 1):
                sound = Z.And(*[recovery(kind, v, Z, self.cfg, k) for kind in DEVICE_KINDS],
                              layout_ok(v, Z, self.cfg, k), resident(v, Z, self.cfg, k),
                              *[holds_prefix(v, Z, self.cfg, r, j) for j in blocks_read(self.cfg, k)
                                if self.cfg.prompts > 1])
                usable = Z.And(Z.In(d.kind, (REUSE, PARTIAL)), d.k == k)
                s.push()
                s.add(usable, z3.Not(self._b(sound)))
                rr = s.check()
                if rr != z3.unsat and ob.status == "proved":
                    if rr == z3.sat:
                        m = s.model()
                        st = self.model_state(m)
                        dec = self.spec.decide(st, r)
                        ob.status = "unknown"
                        ob.cti = {"request": r, "k": k, "decision": dec, "state": self.lay.describe(st)}
                        ob.note = (f"a state satisfying every invariant where request {r}'s lookup "
                                   f"decides {dec['kind']}({k}) but a recovery condition fails")
                    else:
                        ob.status = "unknown"
                        ob.note = f"solver unknown: {s.reason_unknown()}"
                s.pop()
        ob.seconds = time.perf_counter() - t0
        return ob

    def aux_violations(self, st: tuple[int, ...]) -> list[tuple[str, str]]:
        """The auxiliary invariants a concrete state violates (a fault may break one first:
        `stale_hash_after_reuse` makes a published hash name other content)."""
        c = Ctx(View(st, self.lay), CONCRETE, self.lay, self.fault)
        return [(a.name, w) for a in self.aux.values() for w, p in a.conjuncts(c) if not p]

    # ---- bounded model checking -------------------------------------------------------
    def bmc(self, depth: int, deadline: float | None = None) -> tuple[int, list[Any] | None, list[tuple[str, str]]]:
        """Search for a violation of any invariant (named or auxiliary) within `depth` steps.
        Returns (deepest bound fully checked, instances of the violating path or None,
        violations at its last state)."""
        z3, B = self.z3, self.bmc_logic
        insts = self.spec.instances
        x = [B.var(f"s{i}") for i in range(self.lay.size)]
        # transition relation built once on the symbolic pre-state, substituted per depth
        rel = [self.step(x, inst, B) for inst in insts]
        writers: dict[int, list[tuple[int, Any]]] = {}
        for n, (_, w) in enumerate(rel):
            for i, e in w.items():
                writers.setdefault(i, []).append((n, e))
        bad = z3.Or(*[z3.Not(self._b(p)) for ps in self.conjuncts(x, B).values() for _, p in ps])
        # T(x, a, x'): one formula, substituted once per depth (one substitute call, not one per term)
        A = z3.BitVec("a", len(insts).bit_length() + 1)   # the action chosen at a step
        xp = [B.var(f"t{i}") for i in range(self.lay.size)]
        parts = [z3.ULT(A, len(insts))]
        parts += [z3.Implies(A == n, g) for n, (g, _) in enumerate(rel)]
        for i in range(self.lay.size):
            val = x[i]
            for n, e in reversed(writers.get(i, [])):
                val = z3.If(A == n, e, val)
            parts.append(xp[i] == val)
        T = z3.And(*parts)
        s = z3.SolverFor("QF_BV")     # bit-blasting + SAT; the generic solver is ~10x slower here
        s.set("timeout", self.timeout_ms)
        init = self.lay.init()
        cur = [B.var(f"s0_{i}") for i in range(self.lay.size)]
        s.add(*[c == v for c, v in zip(cur, init)])
        sels = []
        checked = -1
        for d in range(depth + 1):
            s.push()
            s.add(z3.substitute(bad, *zip(x, cur)))
            r = s.check()
            if r == z3.sat:
                m = s.model()
                path = [insts[m.eval(a, model_completion=True).as_long()] for a in sels]
                st = self.spec.init()
                for inst in path:
                    st = inst.effect(st)
                return checked, path, self.spec.check(st) + self.aux_violations(st)
            s.pop()
            if r == z3.unknown:
                return checked, None, []
            checked = d
            if d == depth or (deadline is not None and time.perf_counter() > deadline):
                break
            a = z3.BitVec(f"a{d}", A.size())
            sels.append(a)
            nxt = [B.var(f"s{d + 1}_{i}") for i in range(self.lay.size)]
            s.add(z3.substitute(T, *zip(x, cur), (A, a), *zip(xp, nxt)))
            cur = nxt
        return checked, None, []


# ---- the command -------------------------------------------------------------------------

@dataclass(frozen=True)
class ProveProfile:
    depth: int = 8          # BMC depth for a clean run (induction proves; BMC is a cross-check)
    fault_depth: int = 14   # BMC depth when induction fails (an unproved invariant)
    # with a planted fault: its shortest counterexample's length at least (content faults go
    # deepest: hash_ignores_parent 16, restore_under_stale_key 18 steps, tests/checker/test_prove.py)
    planted_depth: int = 18
    bmc_seconds: float = 240.0


def run_prove(cfg: Config, out: Path | None = None, fault: str | None = None,
              depth: int | None = None, config_path: str | None = None,
              profile: ProveProfile = ProveProfile()) -> tuple[int, dict[str, Any]]:
    if fault is not None:
        f = faultlib.get(fault)
        if f.layer != "spec":
            raise faultlib.UnknownFault(f"{fault} (a {f.layer} fault: prove plants spec faults only)")
    # Z3 answers a SIGINT during check() by cancelling it and returning `unknown`, which would
    # turn Ctrl-C into "undecided" and let the run go on; off, Python's KeyboardInterrupt comes
    # as soon as the current check returns, and the run stops with exit 130.
    import z3
    z3.set_param("ctrl_c", False)
    t0 = time.perf_counter()
    pv = Prover(cfg, fault)
    res = pv.induction()
    theorem = pv.hit_soundness()
    open_ = [o for o in res.values() if o.status != "proved"]
    k = depth if depth is not None else (profile.planted_depth if fault is not None and open_
                                         else profile.fault_depth if open_ else profile.depth)
    t1 = time.perf_counter()
    checked, path, viol = pv.bmc(k, deadline=time.perf_counter() + profile.bmc_seconds)
    bmc_s = time.perf_counter() - t1
    trace_path = replay = None
    if path is not None:
        from ..fuzz.walk import to_trace
        steps = [(i.action, dict(i.params)) for i in path]
        tr = to_trace(pv.spec, steps, None, engine="bmc")
        tr.meta = {"depth": len(path), "found_by": "kvcheck prove (z3 bmc)"}
        name = f"prove-counterexample-{file_stem(fault or 'clean')}.json"
        dest = (out or Path("kvcheck-report")) / name
        trace_path = str(tr.save(dest))
        replay = f"kvcheck replay {shlex.quote(trace_path)}"
        hit = {inv for inv, _ in viol}
        for n in hit:
            o = res.get(n)
            if o is None:
                continue
            o.status, o.method, o.bound, o.trace = "violated", "bmc", len(path), trace_path
            o.note = f"reachable violation in {len(path)} steps: {replay}"
            o.seconds += bmc_s / max(len(hit), 1)
    for o in res.values():
        if o.status == "unknown" and o.method == "induction":
            o.method, o.bound = "bmc", checked
            o.note = (o.note or "") + f"; no violation by BMC to depth {checked}"
            o.seconds += bmc_s / max(len(open_), 1)
        elif o.status == "proved":
            o.bound = checked
    obligations = [o.to_dict() for o in res.values()] + [theorem.to_dict()]
    cmd = ["kvcheck", "prove"] + (["--config", config_path] if config_path else []) \
        + (["--blocks", str(cfg.blocks)] if config_path is None and cfg.blocks != Config().blocks else []) \
        + (["--fault", fault] if fault else [])
    rep: dict[str, Any] = {
        "command": shlex.join(cmd), "fault": fault, "config": cfg.to_dict(),
        "blocks": cfg.blocks, "instances": len(pv.spec.instances), "slots": pv.lay.size,
        "bmc": {"depth": k, "checked": checked, "seconds": round(bmc_s, 3),
                "violation": None if path is None else {
                    "steps": [i.label() for i in path], "invariants": sorted({i for i, _ in viol}),
                    "where": [f"{i}: {w}" for i, w in viol][:20], "trace": trace_path, "replay": replay}},
        "invariants": obligations,
        "auxiliary": [{"name": a.name, "doc": a.doc} for a in pv.aux.values()],
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if fault:
        expected = faultlib.get(fault).expected
        caught_by = sorted({i for i, _ in viol}) if path is not None else []
        rep["fault_result"] = {"expected": expected, "caught_by": caught_by,
                               "caught": expected in caught_by}
    if path is not None:
        code, verdict = ExitCode.Z3, "violated"
    elif any(o["status"] != "proved" for o in obligations):
        code, verdict = ExitCode.UNDECIDED, "unknown"
    else:
        code, verdict = ExitCode.OK, "proved"
    rep["verdict"], rep["exit_code"] = verdict, code
    return code, rep


def mutant_engine(cfg: Config, fault: str | None, budget_s: float, seed: int) -> dict[str, Any]:
    """`kvcheck mutants` entry: induction + BMC on the fault config of the explorer (small
    enough for BMC to reach the shortest counterexamples of most faults)."""
    import tempfile

    from .explore import fault_config
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        code, rep = run_prove(fault_config(fault), Path(d), fault,
                              profile=ProveProfile(bmc_seconds=budget_s))
    v = rep["bmc"]["violation"]
    return {"detected": v is not None, "caught_by": v["invariants"] if v else [],
            "seconds": round(time.perf_counter() - t0, 2), "trace_len": len(v["steps"]) if v else None,
            "verdict": rep["verdict"]}
