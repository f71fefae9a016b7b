"""One definition, several semantics: concrete, compiled and z3 agree; z3 proves induction."""
from __future__ import annotations

import random

import pytest
import z3

from kvcheck.spec.actions import ACTIONS, Ctx, run_body
from kvcheck.spec.config import Config
from kvcheck.spec.invariants import invariants_for
from kvcheck.spec.logic import CONCRETE, Expr, TRACE, Z3Logic
from kvcheck.spec.state import View
from kvcheck.spec.system import Spec


def walk_states(spec: Spec, n: int, seed: int) -> list[tuple]:
    rng, s, out = random.Random(seed), spec.init(), []
    for _ in range(n):
        en = spec.enabled(s)
        if not en or rng.random() < 0.01:
            s = spec.init()
            continue
        s = rng.choice(en).effect(s)
        out.append(s)
    return out


@pytest.fixture(scope="module")
def spec() -> Spec:
    return Spec(Config(blocks=3))


def test_compiled_equals_interpreted(spec: Spec) -> None:
    """The compiled guards/effects are the definitions read directly (CONCRETE)."""
    states = walk_states(spec, 400, seed=1)
    rng = random.Random(2)
    checked = 0
    for s in states[::4]:
        for inst in rng.sample(spec.instances, 25):
            g, succ = spec.interpret(s, inst)
            assert bool(g) == inst.guard(s), inst.label()
            if g:
                assert succ == inst.effect(s), inst.label()
                checked += 1
    assert checked > 50


def test_invariants_compiled_equal_interpreted(spec: Spec) -> None:
    for s in walk_states(spec, 300, seed=3)[::10]:
        direct = spec.interpret_invariants(s)
        compiled = {k.invariant for k in spec.conjuncts if not k.fn(s)}
        assert {n for n, ok in direct.items() if not ok} == compiled


def test_same_invariant_concrete_and_z3_on_same_state(spec: Spec) -> None:
    """Evaluate every invariant on a concrete state both in Python and in z3 (state slots as
    z3 constants fixed to the same values): the answers agree, including a violating state."""
    Z = Z3Logic()
    vec = [z3.Int(f"s{i}") for i in range(spec.lay.size)]
    sym = {name: Z.And(*[p for _, p in inv.conjuncts(Ctx(View(vec, spec.lay), Z, spec.lay, None))])
           for name, inv in invariants_for(spec.cfg).items()}
    states = walk_states(spec, 200, seed=4)[::20]
    bad = list(states[-1])
    bad[spec.lay.o(0, "swa_window", 0, "ref")] += 1          # a refcount that matches no holder
    for s in states + [tuple(bad)]:
        conc = spec.interpret_invariants(s)
        fix = [v == val for v, val in zip(vec, s)]
        for name, term in sym.items():
            solver = z3.Solver()
            solver.add(*fix)
            solver.add(term)
            assert (solver.check() == z3.sat) == conc[name], name
    assert not spec.interpret_invariants(tuple(bad))["refcount_equals_holders"]


def test_z3_proves_refcount_inductive_at_small_bound() -> None:
    """(all invariants) ∧ TypeOK ∧ action ⇒ refcount_equals_holders′, for every action, and a
    planted fault makes the same query satisfiable (the proof can fail)."""
    for fault, expect_proved in ((None, True), ("refcount_double_decrement", False)):
        spec = Spec(Config(blocks=2), fault)
        Z = Z3Logic()
        pre = [z3.Int(f"s{i}") for i in range(spec.lay.size)]
        dom = [z3.And(x >= lo, x <= hi) for x, (lo, hi) in zip(pre, spec.lay.domains())]

        def invs(vec):
            c = Ctx(View(vec, spec.lay), Z, spec.lay, fault)
            return {n: Z.And(*[p for _, p in inv.conjuncts(c)]) for n, inv in invariants_for(spec.cfg).items()}

        hyp = list(invs(pre).values())
        failed = []
        for inst in spec.instances:
            g, w = run_body(ACTIONS[inst.action], View(pre, spec.lay), Z, spec.lay, fault, inst.params)
            post = [w.get(i, x) for i, x in enumerate(pre)]
            solver = z3.Solver()
            solver.add(*dom, *hyp, g, z3.Not(invs(post)["refcount_equals_holders"]))
            if solver.check() != z3.unsat:
                failed.append(inst.label())
        assert (not failed) == expect_proved, failed
        if not expect_proved:
            assert all(f.startswith("finish") for f in failed)


def test_expr_refuses_python_branching() -> None:
    with pytest.raises(TypeError):
        bool(Expr("s[0]", frozenset({0})) == 1)


def test_trace_logic_folds_constants() -> None:
    x = Expr("s[1]", frozenset({1}))
    assert TRACE.And(True, x) is x
    assert TRACE.And(False, x) is False
    assert TRACE.Or(True, x) is True
    assert TRACE.If(True, x, 3) is x
    assert CONCRETE.If(False, 1, 2) == 2
