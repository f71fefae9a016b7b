"""The spec instantiated for one config (and optionally one planted fault).

Owns the bridge from the definitions to engines: every (action, parameters) pair becomes an
instance with a compiled guard and effect; every invariant conjunct a compiled predicate with
its read set. An instance's write set is static, so after a step only the conjuncts that read
a written slot can change value: `check_after` evaluates exactly those (the others held before
and their inputs did not change). `check` evaluates everything; tests show both agree.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from . import faults as faultlib
from .actions import ACTIONS, Action, Ctx, run_body
from .config import Config
from .funnel import Decision
from .invariants import invariants_for
from .logic import CONCRETE, TRACE, Expr, Logic
from .objects import DECISIONS, reason_names
from .state import Layout, View

_NAME = re.compile(r"_t\d+")


@dataclass
class Instance:
    index: int
    action: str
    params: dict[str, Any]
    guard: Callable[[tuple], bool]
    effect: Callable[[tuple], tuple]
    writes: frozenset[int]
    state_slots: tuple[tuple[int, str], ...]      # written lifecycle slots: (slot, object kind)
    check: Callable[[tuple], int] | None = None   # compiled lazily
    check_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return self.label()

    def label(self) -> str:
        if not self.params:
            return self.action
        return f"{self.action}(" + ", ".join(f"{k}={v}" for k, v in self.params.items()) + ")"


@dataclass
class Conjunct:
    invariant: str
    where: str
    src: str
    reads: frozenset[int]
    fn: Callable[[tuple], bool] = field(repr=False, default=None)  # type: ignore[assignment]


def _sym_vec(n: int) -> list[Expr]:
    return [Expr(f"s[{i}]", frozenset((i,))) for i in range(n)]


def _emit(frame: list[tuple[str, str]], exprs: list[str]) -> list[str]:
    """The bindings (in order) that the given sources need, transitively."""
    need: set[str] = set()
    for e in exprs:
        need.update(_NAME.findall(e))
    keep = []
    for name, src in reversed(frame):
        if name in need:
            keep.append((name, src))
            need.update(_NAME.findall(src))
    return [f"    {n} = {s}" for n, s in reversed(keep)]


# Python's parser refuses more than 200 nested parentheses (and its compiler recursion is
# bounded too); a sum over 64 blocks' objects nests deeper than that. Lines nested deeper than
# _MAX_DEPTH are split: the group opening at _SPLIT_AT becomes a local computed on the line
# before (the state functions are pure, so evaluating a subterm a line earlier changes nothing).
_MAX_DEPTH, _SPLIT_AT = 60, 30


def _depth(line: str) -> int:
    d = best = 0
    for ch in line:
        if ch == "(":
            d += 1
            best = max(best, d)
        elif ch == ")":
            d -= 1
    return best


def _split(line: str, fresh: Callable[[], str]) -> tuple[str, str]:
    """Hoist the first group that opens at depth _SPLIT_AT: (binding line, rewritten line)."""
    d, start = 0, -1
    for i, ch in enumerate(line):
        if ch == "(":
            d += 1
            if d == _SPLIT_AT and start < 0:
                start = i
        elif ch == ")":
            if d == _SPLIT_AT and start >= 0:
                name = fresh()
                indent = line[:len(line) - len(line.lstrip())]
                return f"{indent}{name} = {line[start:i + 1]}", line[:start] + name + line[i + 1:]
            d -= 1
    raise AssertionError("no group to split")   # pragma: no cover - _depth said there is one


def _unnest(src: str) -> str:
    """`src` with every line nested at most _MAX_DEPTH parentheses deep."""
    counter = iter(range(1 << 30))
    out: list[str] = []
    for line in src.split("\n"):
        todo = [line]
        done: list[str] = []
        while todo:
            cur = todo.pop()
            if _depth(cur) <= _MAX_DEPTH:
                done.append(cur)
                continue
            bind, rest = _split(cur, lambda: f"_n{next(counter)}")
            todo += [rest, bind]        # the binding is emitted (and split further) first
        out += done
    return "\n".join(out)


def _compile(src: str, name: str) -> Callable:
    ns: dict[str, Any] = {}
    if max(map(_depth, src.split("\n"))) > _MAX_DEPTH:
        src = _unnest(src)
    exec(compile(src, f"<kvcheck-spec:{name}>", "exec"), ns)
    return ns[name]


def _src(x: Any) -> str:
    return x.src if isinstance(x, Expr) else repr(x)


_CACHE: dict[tuple[str, str | None], "Spec"] = {}


def spec_for(cfg: Config, fault: str | None = None) -> "Spec":
    """The compiled spec for (config, fault), built once per process (compiling takes ~0.2 s)."""
    key = (json.dumps(cfg.to_dict(), sort_keys=True), fault)
    if key not in _CACHE:
        _CACHE[key] = Spec(cfg, fault)
    return _CACHE[key]


class Spec:
    def __init__(self, cfg: Config | None = None, fault: str | None = None) -> None:
        self.cfg = cfg or Config()
        self.cfg.check_modelled()
        self.fault = fault
        self.planted = faultlib.planted_spec_fault(fault)      # UnknownFault if not a spec fault
        self.lay = Layout(self.cfg)
        self.sym = _sym_vec(self.lay.size)
        self.instances: list[Instance] = []
        self.by_key: dict[tuple, Instance] = {}
        for act in ACTIONS.values():
            for params in act.params(self.lay):
                inst = self._build(act, params)
                if inst is not None:
                    self.instances.append(inst)
                    self.by_key[(inst.action, tuple(sorted(inst.params.items())))] = inst
        self.actions = sorted({i.action for i in self.instances}, key=list(ACTIONS).index)
        self.conjuncts: list[Conjunct] = []
        self._build_invariants()
        self._full = self._check_fn(list(range(len(self.conjuncts))), "check_all")
        self._decide = [self._build_decision(r) for r in range(self.cfg.requests)]
        f = self.planted.fault
        if f is not None and f.name not in self.planted.asked:
            raise faultlib.FaultError(f"fault {f.name!r} plants nothing in this config: its site "
                                      f"({f.site}) is never reached by any action or lookup")

    # ---- compilation ----------------------------------------------------------------
    def _build(self, act: Action, params: dict[str, Any]) -> Instance | None:
        TRACE.frames.append([])
        try:
            guard, writes = run_body(act, View(self.sym, self.lay), TRACE, self.lay, self.planted, params)
        finally:
            frame = TRACE.frames.pop()
        if guard is False:
            return None
        writes = {i: e for i, e in writes.items() if _src(e) != f"s[{i}]"}
        tag = f"{act.name}_{len(self.instances)}"
        g = _compile(self._guard_src(guard, frame), "guard")
        wsrc = {i: _src(e) for i, e in writes.items()}
        lines = _emit(frame, list(wsrc.values()))
        lines.append("    t = list(s)")
        lines += [f"    t[{i}] = {src}" for i, src in sorted(wsrc.items())]
        lines.append("    return tuple(t)")
        eff = _compile("def effect(s):\n" + "\n".join(lines) + "\n", "effect")
        slots = tuple((i, self.lay.names[i][2] if self.lay.names[i][0] == "o" else "on_disk")
                      for i in sorted(writes) if self.lay.names[i][-1] in ("st", "dst"))
        del tag
        return Instance(len(self.instances), act.name, dict(params), g, eff, frozenset(writes), slots)

    @staticmethod
    def _guard_src(guard: Any, frame: list[tuple[str, str]]) -> str:
        """Conjunct by conjunct, computing shared subterms only once a cheap prefix passed."""
        parts = guard.parts if isinstance(guard, Expr) and guard.parts else (guard,)
        lines, done = ["def guard(s):"], set()
        for p in parts:
            src = _src(p)
            for line in _emit(frame, [src]):
                name = line.split("=", 1)[0].strip()
                if name not in done:
                    done.add(name)
                    lines.append(line)
            lines.append(f"    if not ({src}): return False")
        lines.append("    return True")
        return "\n".join(lines) + "\n"

    def _build_invariants(self) -> None:
        for inv in invariants_for(self.cfg).values():
            c = Ctx(View(self.sym, self.lay), TRACE, self.lay, self.planted)
            for where, pred in inv.conjuncts(c):
                if pred is True:
                    continue
                e = pred if isinstance(pred, Expr) else Expr(repr(bool(pred)))
                self.conjuncts.append(Conjunct(inv.name, where, e.src, e.reads))
        for k in self.conjuncts:
            k.fn = _compile(f"def conj(s):\n    return {k.src}\n", "conj")

    def _check_fn(self, ids: list[int], name: str) -> Callable[[tuple], int]:
        lines = [f"def {name}(s):"]
        for n, cid in enumerate(ids):
            lines.append(f"    if not ({self.conjuncts[cid].src}): return {n}")
        lines.append("    return -1")
        return _compile("\n".join(lines) + "\n", name)

    def _build_decision(self, r: int) -> Callable[[tuple], tuple]:
        TRACE.frames.append([])
        try:
            d = Decision(View(self.sym, self.lay), TRACE, self.cfg, r, self.planted)
            outs = [_src(d.kind), _src(d.k), _src(d.logical), _src(d.reasons)]
        finally:
            frame = TRACE.frames.pop()
        lines = _emit(frame, outs) + [f"    return ({', '.join(outs)})"]
        return _compile("def decide(s):\n" + "\n".join(lines) + "\n", "decide")

    # ---- concrete engine API --------------------------------------------------------
    def init(self) -> tuple[int, ...]:
        return self.lay.init()

    def enabled(self, s: tuple) -> list[Instance]:
        return [i for i in self.instances if i.guard(s)]

    def check(self, s: tuple) -> list[tuple[str, str]]:
        """Every violated conjunct: [(invariant, where)]."""
        if self._full(s) < 0:
            return []
        return [(k.invariant, k.where) for k in self.conjuncts if not k.fn(s)]

    def check_after(self, inst: Instance, s: tuple) -> list[tuple[str, str]]:
        """Violations after `inst` fired from a state where every invariant held."""
        if inst.check is None:
            ids = [n for n, k in enumerate(self.conjuncts) if k.reads & inst.writes]
            inst.check_ids = tuple(ids)
            inst.check = self._check_fn(ids, "check_inst")
        if inst.check(s) < 0:
            return []
        return [(self.conjuncts[n].invariant, self.conjuncts[n].where)
                for n in inst.check_ids if not self.conjuncts[n].fn(s)]

    def decide(self, s: tuple, r: int) -> dict[str, Any]:
        """What a lookup by request r would answer in state s."""
        kind, k, logical, bits = self._decide[r](s)
        return {"kind": DECISIONS[kind], "k": k, "logical": logical, "reasons": reason_names(bits)}

    def instance(self, action: str, params: dict[str, Any]) -> Instance:
        try:
            inst = self.by_key.get((action, tuple(sorted(params.items()))))
        except TypeError:
            inst = None
        if inst is None:
            raise KeyError(f"no action {action} with parameters {params} in this config")
        return inst

    # ---- the definitions read directly (the reviewer's semantics) -------------------
    def interpret(self, s: tuple, inst: Instance, L: Logic = CONCRETE) -> tuple[Any, tuple]:
        """Guard and successor of `inst` evaluated straight from the definitions."""
        guard, writes = run_body(ACTIONS[inst.action], View(s, self.lay), L, self.lay,
                                 self.planted, inst.params)
        t = list(s)
        for i, val in writes.items():
            t[i] = int(val)
        return guard, tuple(t)

    def interpret_invariants(self, s: tuple, L: Logic = CONCRETE) -> dict[str, bool]:
        out = {}
        for inv in invariants_for(self.cfg).values():
            c = Ctx(View(s, self.lay), L, self.lay, self.planted)
            out[inv.name] = bool(L.And(*[p for _, p in inv.conjuncts(c)]))
        return out
