"""The two-semantics layer: every guard, effect, decision and invariant of the spec is written
once against a `Logic`, and means different things depending on which one it is given.

- `CONCRETE`: Python values in, Python values out (the reading a reviewer checks by hand).
- `Z3Logic`: z3 terms in, z3 terms out (the model Z3 proves).
- `TRACE`: symbolic Python source in, source out; compiled once into plain functions so that
  random walks and explicit exploration run at interpreter speed. It also records which state
  slots an expression reads, which gives exact frame conditions for incremental checking.

Comparisons and arithmetic use Python operators (ints and z3 terms both overload them);
logic uses the methods below, never `and`/`or`/`if` on state values (Expr refuses `bool()`).
"""
from __future__ import annotations

from typing import Any, Iterable


class Logic:
    name = "abstract"

    def And(self, *xs: Any) -> Any: raise NotImplementedError
    def Or(self, *xs: Any) -> Any: raise NotImplementedError
    def Not(self, x: Any) -> Any: raise NotImplementedError
    def If(self, c: Any, a: Any, b: Any) -> Any: raise NotImplementedError

    def Implies(self, a: Any, b: Any) -> Any:
        return self.Or(self.Not(a), b)

    def Sum(self, xs: Iterable[Any]) -> Any:
        total: Any = 0
        for x in xs:
            total = total + x
        return total

    def Count(self, conds: Iterable[Any]) -> Any:
        return self.Sum(self.If(c, 1, 0) for c in conds)

    def In(self, x: Any, values: Iterable[int]) -> Any:
        return self.Or(*[x == v for v in values])

    def Table(self, x: Any, values: list[int]) -> Any:
        """values[x] for a state-dependent x in range(len(values))."""
        if isinstance(x, int):
            return values[x]
        out: Any = values[-1]
        for i in range(len(values) - 2, -1, -1):
            out = self.If(x == i, values[i], out)
        return out

    def let(self, x: Any) -> Any:
        """Name a shared subterm (compiled code evaluates it once)."""
        return x

    def Max(self, a: Any, b: Any) -> Any:
        return self.If(a >= b, a, b)

    def Min(self, a: Any, b: Any) -> Any:
        return self.If(a <= b, a, b)


class ConcreteLogic(Logic):
    name = "concrete"

    def And(self, *xs: Any) -> bool:
        return all(xs)

    def Or(self, *xs: Any) -> bool:
        return any(xs)

    def Not(self, x: Any) -> bool:
        return not x

    def If(self, c: Any, a: Any, b: Any) -> Any:
        return a if c else b


CONCRETE = ConcreteLogic()


# ---- symbolic Python (the compiled concrete semantics) ---------------------------------

class Expr:
    """A fragment of Python source over the flat state tuple `s`. `reads` is the set of state
    slots it depends on."""

    __slots__ = ("src", "reads", "parts")

    def __init__(self, src: str, reads: frozenset[int] = frozenset(),
                 parts: tuple["Expr", ...] = ()) -> None:
        self.src = src
        self.reads = reads
        self.parts = parts      # the conjuncts, when this is an And (for lazy guards)

    def __bool__(self) -> bool:  # a definition branched on a state value: a spec bug
        raise TypeError("spec definitions must use Logic.If/And/Or, not Python `if`/`and`/`or`, "
                        f"on state values (got {self.src})")

    def __repr__(self) -> str:
        return f"Expr({self.src})"

    __hash__ = None  # type: ignore[assignment]

    def _bin(self, op: str, other: Any, rev: bool = False) -> "Expr":
        o = lift(other)
        a, b = (o, self) if rev else (self, o)
        return Expr(f"({a.src} {op} {b.src})", a.reads | b.reads)

    def __add__(self, o): return self._bin("+", o)
    def __radd__(self, o): return self._bin("+", o, True)
    def __sub__(self, o): return self._bin("-", o)
    def __rsub__(self, o): return self._bin("-", o, True)
    def __mul__(self, o): return self._bin("*", o)
    def __rmul__(self, o): return self._bin("*", o, True)
    def __floordiv__(self, o): return self._bin("//", o)
    def __mod__(self, o): return self._bin("%", o)
    def __eq__(self, o): return self._bin("==", o)  # type: ignore[override]
    def __ne__(self, o): return self._bin("!=", o)  # type: ignore[override]
    def __lt__(self, o): return self._bin("<", o)
    def __le__(self, o): return self._bin("<=", o)
    def __gt__(self, o): return self._bin(">", o)
    def __ge__(self, o): return self._bin(">=", o)
    def __neg__(self): return Expr(f"(-{self.src})", self.reads)


def lift(x: Any) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, bool) or isinstance(x, int):
        return Expr(repr(x))
    raise TypeError(f"cannot use {x!r} in a spec expression")


class TraceLogic(Logic):
    """Builds Python source. Folds constants so that definitions written with concrete
    indices (loops over blocks) compile to short straight-line code."""

    name = "trace"

    def __init__(self) -> None:
        self.frames: list[list[tuple[str, str]]] = []
        self.counter = 0

    def let(self, x: Any) -> Any:
        if not isinstance(x, Expr) or not self.frames or x.src.startswith("s["):
            return x
        name = f"_t{self.counter}"
        self.counter += 1
        self.frames[-1].append((name, x.src))
        return Expr(name, x.reads)

    def And(self, *xs: Any) -> Any:
        parts = []
        for x in xs:
            if isinstance(x, Expr):
                parts.append(x)
            elif not x:
                return False
        if not parts:
            return True
        if len(parts) == 1:
            return parts[0]
        flat: list[Expr] = []
        for p in parts:
            flat.extend(p.parts or (p,))
        return Expr("(" + " and ".join(p.src for p in parts) + ")",
                    frozenset().union(*(p.reads for p in parts)), tuple(flat))

    def Or(self, *xs: Any) -> Any:
        parts = []
        for x in xs:
            if isinstance(x, Expr):
                parts.append(x)
            elif x:
                return True
        if not parts:
            return False
        if len(parts) == 1:
            return parts[0]
        return Expr("(" + " or ".join(p.src for p in parts) + ")",
                    frozenset().union(*(p.reads for p in parts)))

    def Not(self, x: Any) -> Any:
        if isinstance(x, Expr):
            return Expr(f"(not {x.src})", x.reads)
        return not x

    def If(self, c: Any, a: Any, b: Any) -> Any:
        if not isinstance(c, Expr):
            return a if c else b
        if not isinstance(a, Expr) and not isinstance(b, Expr) and a == b:
            return a
        ea, eb = lift(a), lift(b)
        return Expr(f"({ea.src} if {c.src} else {eb.src})", c.reads | ea.reads | eb.reads)


TRACE = TraceLogic()


# ---- z3 ------------------------------------------------------------------------------

class Z3Logic(Logic):
    """z3 terms. Imported lazily so that the concrete paths never pay for z3.

    `width=None` reads state slots as mathematical integers (linear integer arithmetic);
    `width=W` reads them as W-bit signed bit-vectors, which z3 bit-blasts to SAT: every slot
    has a small finite domain, so for W wide enough that no sum of slots can overflow (the
    prover's `bv_width`) the two readings agree, and the bit-vector one is far faster for
    bounded model checking (a 13-step counterexample in seconds instead of minutes).
    """

    name = "z3"

    def __init__(self, width: int | None = None) -> None:
        import z3
        self.z3, self.width = z3, width

    def var(self, name: str) -> Any:
        return self.z3.Int(name) if self.width is None else self.z3.BitVec(name, self.width)

    def val(self, v: int) -> Any:
        return self.z3.IntVal(v) if self.width is None else self.z3.BitVecVal(v, self.width)

    def num(self, e: Any) -> int:
        """A model value of a state slot as a Python int."""
        return e.as_long() if self.width is None else e.as_signed_long()

    def _b(self, x: Any) -> Any:
        return self.z3.BoolVal(bool(x)) if isinstance(x, bool) else x

    def And(self, *xs: Any) -> Any:
        if not xs:
            return self.z3.BoolVal(True)
        return self.z3.And(*[self._b(x) for x in xs])

    def Or(self, *xs: Any) -> Any:
        if not xs:
            return self.z3.BoolVal(False)
        return self.z3.Or(*[self._b(x) for x in xs])

    def Not(self, x: Any) -> Any:
        return self.z3.Not(self._b(x))

    def If(self, c: Any, a: Any, b: Any) -> Any:
        if isinstance(c, bool):
            return a if c else b
        if isinstance(a, bool) and isinstance(b, bool):
            a, b = self.z3.BoolVal(a), self.z3.BoolVal(b)
        elif self.width is not None:
            a = self.val(a) if isinstance(a, int) and not isinstance(a, bool) else a
            b = self.val(b) if isinstance(b, int) and not isinstance(b, bool) else b
        return self.z3.If(c, a, b)

    def Implies(self, a: Any, b: Any) -> Any:
        return self.z3.Implies(self._b(a), self._b(b))
