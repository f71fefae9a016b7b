"""The SGLang checks after a step, incremental: what did not change is not checked again.

A full scan after every step (walk the tree, every node's slots against the shadow, every
lock, both pools, SGLang's own sanity_check) was most of a campaign's time. A step changes
SGLang's tree only through the cache's methods, and its pools through allocation, frees and
writes. In the incremental mode the cache's public methods are wrapped to note that a step
called one (`touched`); each check then
  * reuses the last check's walk of the tree when the step did not call the cache (a submit,
    a decode with room: the tree, its lock references and sizes are as they were), and skips
    the lock comparison when moreover the running requests are the same, and SGLang's
    sanity_check when it passed since the cache was last called;
  * runs the per-position checks (slot live, holds its prefix, its bytes, its SWA slot) only
    on nodes whose key, values, path or component values are other objects than at the last
    check, and on nodes and held prefixes holding a slot whose state changed since then
    (found by diffing a snapshot of the pools and the shadow each step: free or not, the
    prefix written to it, its bytes, its SWA mapping); conversions (a key's tokens, a value's
    slots, a node's path) are kept while their objects are the same;
  * counts every step: the pools' accounting (owned + free = capacity, disjoint).

What no step announces (a node edited in place, a method the wrappers missed) the full scan
sees: it runs every `full_scan_every` steps (a violation only it saw is counted,
`state:full_scan_only`), and the shrinker re-locates a campaign's finding in the exact mode
(the full scan after every step, no memo: `execute`, `replay`). When the incremental check
finds a violation, the full scan runs at once and reports what the exact mode reports at this
step; if it finds none, the incremental check erred (counted, `state:incremental_false_alarm`;
the tests require none).
"""
from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .violation import Violation

FULL_SCAN_EVERY = 32        # the campaigns' period (steps) of the full scan


class Inc:
    """One incremental check: whether the cache was called since the last check (`same`:
    not), whether the running requests are the same (`reqs_same`), the slots whose state
    changed per pool (`dirty`), and the node signatures of the last check."""

    __slots__ = ("dirty", "old", "new", "reqs_old", "reqs_new", "same", "reqs_same")

    def __init__(self, dirty: dict[str, set], old: dict[tuple[int, str], tuple], reqs_old: dict[str, tuple],
                 same: bool = False, reqs_same: bool = False) -> None:
        self.dirty, self.old = dirty, old
        self.new: dict[tuple[int, str], tuple] = {}
        self.reqs_old, self.reqs_new = reqs_old, {}
        self.same, self.reqs_same = same, same and reqs_same

    def fresh(self, node: Any, sig: tuple, tag: str = "") -> bool:
        """Record a node's signature (one per check, `tag`); whether it is new or other than at
        the last check."""
        if self.same:
            return False            # the cache was not called: every node is as it was
        k = (id(node), tag)
        self.new[k] = (node, sig)
        o = self.old.get(k)
        return o is None or o[0] is not node or o[1] != sig

    def clean(self, node: Any, sig: tuple, tag: str = "", **slots: Any) -> bool:
        """The node is as at the last check and none of its slots (per pool) changed state."""
        return not self.fresh(node, sig, tag) and self._slots_clean(slots)

    def req_clean(self, rid: str, sig: tuple, **slots: Any) -> bool:
        """A running request's held prefix: as at the last check, and none of its slots changed."""
        self.reqs_new[rid] = sig
        return self.reqs_old.get(rid) == sig and self._slots_clean(slots)

    def _slots_clean(self, slots: dict[str, Any]) -> bool:
        """None of these slots (per pool) changed state since the last check."""
        d = self.dirty
        return all(not s or d.get(pool, _EMPTY).isdisjoint(s) for pool, s in slots.items())


_EMPTY: frozenset = frozenset()


def _diff(a: Any, b: Any) -> set:
    """The keys or indices at which two snapshots of one part differ (they are not equal)."""
    if isinstance(a, (set, frozenset)):
        return set(a ^ b)
    if isinstance(a, dict):
        out = {k for k, v in a.items() if b.get(k) is not v}
        out.update(b.keys() - a.keys())
        return out
    n = min(len(a), len(b))
    out = {i for i in range(n) if a[i] != b[i]}
    out.update(range(n, max(len(a), len(b))))
    return out


class IncState:
    """The memo of one cache (a fresh cache gets a fresh memo): conversions kept per object,
    the last check's snapshot, walk, node signatures and requests, the step count."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.conv: dict[int, tuple[Any, Any]] = {}        # id(obj) -> (obj, what it converts to)
        self.pref: dict[tuple[int, int], tuple[Any, Any, tuple]] = {}   # (id(path), id(key)) -> prefix
        self.snap: dict[str, list] | None = None
        self.sigs: dict[tuple[int, str], tuple] = {}
        self.reqs: dict[str, tuple] = {}
        self.req_sig: Any = None
        self.walked: Any = None         # the last check's walk of the tree
        self.steps = 0
        self.full = True            # the first check is a full scan (it builds the memo)
        self.bypass = False         # during a full scan: convert afresh (keep the old object if equal)
        self.touched = True         # a cache method was called since the last check
        self.epoch = 0              # cache methods called so far (outside the checks)
        self.checking = False       # (the checks' own calls do not count)
        self.sane = False           # sanity_check passed since the cache was last called


@functools.lru_cache(maxsize=None)
def _methods(cls: type) -> tuple[str, ...]:
    """A class's public plain methods (the ones a step may call)."""
    return tuple(n for n in dir(cls) if not n.startswith("_") and inspect.isfunction(inspect.getattr_static(cls, n)))


def _noting(st: IncState, fn: Callable) -> Callable:
    def called(*a: Any, **k: Any) -> Any:
        if not st.checking:
            st.touched = True
            st.epoch += 1
        return fn(*a, **k)
    called.__wrapped__ = fn             # type: ignore[attr-defined]
    return called


class Incremental:
    """Mixed into the adapters' checks. A class supplies `check_state(inc)` (its checks; `inc`
    None: the full scan of the exact mode) and `snapshot()` (per pool, the parts whose change
    dirties a slot: sets of free slots, shadow dicts slot -> prefix, per-slot lists); its
    checks take the walk from `walk(inc, fn)` and skip what `inc` says is unchanged."""

    full_scan_every: int = 1        # exact by default; run_campaign sets FULL_SCAN_EVERY where it pays
    # Where campaigns check incrementally: measured per class (benchmarks/drivers.py, CPU time).
    # On the default layouts' trees (48-96 slots) the full scan of RadixCache, PureSWARadixCache,
    # SWARadixCache, MambaRadixCache and HiRadixCache costs less than the incremental check's
    # snapshot, diff and signatures (incremental: as fast, or up to ~30% fewer steps per second);
    # UnifiedRadixCache's node views, per-component accounting and the lockstep's questions along
    # every key cost more (incremental: 5-30% more steps per second). The tests run every class
    # in both modes (test_sglang_incremental.py).
    incremental_pays: bool = False

    def _inc_state(self) -> IncState | None:
        """The memo of the current cache; None in the exact mode (nothing kept)."""
        if self.full_scan_every <= 1:
            return None
        st = getattr(self, "_inc_st", None)
        if st is None or st.cache is not self.cache:
            st = self._inc_st = IncState(self.cache)
            self._watch(st)
        return st

    def _watch(self, st: IncState) -> None:
        """Wrap the cache's public methods (on this instance; a planted fault's wrapper included)
        to note that a step called one."""
        c = self.cache
        for name in _methods(type(c)):
            try:
                setattr(c, name, _noting(st, getattr(c, name)))
            except (AttributeError, TypeError):
                st.touched = None       # type: ignore[assignment]   # cannot watch: always walk
                return

    def conv(self, obj: Any, fn: Callable[[Any], Any]) -> Any:
        """fn(obj) (None for None), kept while obj is the same object (incremental mode, inside
        the checks only: what an action judges by, it converts afresh)."""
        if obj is None:
            return None
        st = self._inc_state()
        if st is None or not st.checking:
            return fn(obj)
        e = st.conv.get(id(obj))
        if e is not None and e[0] is obj:
            if not st.bypass:
                return e[1]
            out = fn(obj)
            if out == e[1]:
                return e[1]
        else:
            out = fn(obj)
        st.conv[id(obj)] = (obj, out)
        return out

    def prefix_of(self, path: tuple, key: Any, tokens: Callable[[Any], tuple]) -> tuple:
        """path + the key's tokens; the same tuple object while path and key are the same."""
        st = self._inc_state()
        if st is None or not st.checking:
            return path + tokens(key)
        k = (id(path), id(key))
        e = st.pref.get(k)
        if e is not None and e[0] is path and e[1] is key and not st.bypass:
            return e[2]
        out = path + self.conv(key, tokens)
        if e is not None and e[0] is path and e[1] is key and out == e[2]:
            return e[2]
        st.pref[k] = (path, key, out)
        return out

    @contextmanager
    def checking(self) -> Iterator[None]:
        """Calls the checks make (outside check_all) are no step's."""
        st = self._inc_state()
        if st is None or st.checking:
            yield
            return
        st.checking = True
        try:
            yield
        finally:
            st.checking = False

    def epoch(self) -> int | None:
        """How many cache calls so far (None: exact mode, or the cache cannot be watched)."""
        st = self._inc_state()
        return None if st is None or st.touched is None else st.epoch

    def walk(self, inc: Inc | None, fn: Callable[[], Any]) -> Any:
        """The tree's walk: the last check's when the cache was not called since."""
        st = getattr(self, "_inc_st", None)
        if inc is not None and inc.same and st is not None and st.walked is not None:
            return st.walked
        out = fn()
        if inc is not None and st is not None:
            st.walked = out
        return out

    def sanity_due(self, inc: Inc | None) -> bool:
        """SGLang's sanity_check: not again while the cache was not called since it passed."""
        st = getattr(self, "_inc_st", None)
        return inc is None or st is None or not (inc.same and st.sane)

    def sanity_passed(self, inc: Inc | None) -> None:
        if inc is not None and getattr(self, "_inc_st", None) is not None:
            self._inc_st.sane = True

    def snapshot(self) -> dict[str, list]:
        return {}

    def req_sig(self) -> Any:
        """What the lock references' holders depend on: the running requests and their nodes."""
        return tuple((rid, id(r.node), r.hit) for rid, r in self.reqs.items() if r.state == "running")

    def own_sig(self) -> Any:
        """How many slots each running request owns (the pools' accounting reads them)."""
        return tuple((rid, len(r.slots), len(r.spare)) for rid, r in self.reqs.items() if r.state == "running")

    def check_all(self) -> None:
        """After every step: the full scan (exact mode; the first check of a cache; after a
        violation) or the incremental check, and every `full_scan_every` steps the full scan
        after it (see the module doc)."""
        st = self._inc_state()
        if st is None:
            self.check_state(None)
            return
        st.steps += 1
        st.checking = True
        try:
            snap, rs = self.snapshot(), (self.req_sig(), self.own_sig())
            if st.full or st.snap is None:
                inc = self._full_scan(st)
            else:
                inc = self._incremental(st, snap, rs)
                if st.steps % self.full_scan_every == 0:
                    try:
                        inc = self._full_scan(st)
                    except Violation:
                        self.coverage["state:full_scan_only"] += 1     # the incremental check missed it
                        raise
            st.snap, st.reqs, st.req_sig, st.full = snap, inc.reqs_new, rs, False
            if not inc.same:
                st.sigs = inc.new
            if st.touched is not None:
                st.touched = False
        finally:
            st.checking = False

    def _incremental(self, st: IncState, snap: dict[str, list], rs: Any) -> Inc:
        """The incremental check; on a violation, the full scan reports (what the exact mode
        reports at this step)."""
        old, dirty, changed = st.snap or {}, {}, False
        for p, parts in snap.items():
            o = old.get(p, ())
            if parts == o:              # (C-level, the common case)
                dirty[p] = _EMPTY
                continue
            d: set = set()
            for a, b in zip(parts, o):
                if a != b:
                    d |= _diff(a, b)
            dirty[p], changed = d, changed or bool(d)
        same = st.touched is False
        if not same:
            st.sane = False
        inc = Inc(dirty, st.sigs, st.reqs, same, st.req_sig is not None and rs[0] == st.req_sig[0])
        if inc.reqs_same and rs == st.req_sig and not changed:
            inc.reqs_new = st.reqs      # nothing the checks read changed: as at the last check
            self.coverage["state:check_unchanged"] += 1
            return inc
        try:
            self.check_state(inc)
        except Violation:
            inc = self._full_scan(st)   # raises, or the incremental check erred:
            self.coverage["state:incremental_false_alarm"] += 1
        return inc

    def _full_scan(self, st: IncState) -> Inc:
        """Every check on every node, reading everything afresh; records the signatures."""
        st.full = st.bypass = True
        st.sane = False
        try:
            inc = Inc({}, {}, {})       # not `same`, no old signatures: everything is checked
            self.check_state(inc)
        finally:
            st.bypass = False
        return inc
