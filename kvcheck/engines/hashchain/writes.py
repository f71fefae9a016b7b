"""The hash-chain base class's writes and evictions (base.py): what the manager did when a
request wrote a block — shared a cached one, filled a fresh one (evicting what its memory held,
reported as the spec's events), or computed a second copy — answered as the spec's step it is
(`instead`, copies.py), and the spec's `evict` on the manager's evict callback."""
from __future__ import annotations

from typing import Any

from kvcheck.spec.content import chain as lineage
from kvcheck.spec.objects import EVICTED, R_BOUND, R_DECIDED, R_RUNNING, READY
from kvcheck.spec.sut import ActionRejected
from kvcheck.fuzz.lockstep import Finding
from .copies import dropped_copy, reuse_events, written


class Writes:
    """Mixed into HashChainAdapter: its state (`req`, `state`, `shadow`, ...) is the base's."""

    def _gone(self: Any, j: int) -> None:
        """The manager evicted the last copy of logical block j."""
        self.state[j] = EVICTED
        if self.cfg.eviction == "drop_hash":
            self.published.discard(j)

    def _fill(self: Any, r: int, j: int, block: int) -> tuple[list[Any], bool]:
        """Request r filled `block` with logical block j. Returns what reusing its memory evicted,
        as the spec's events (copies.py), and whether the write is a second copy of a cached
        block. A block another request holds is a TOCTOU break even where another copy of its
        content survives."""
        tenant, toks = self._prompt(r)
        want = (tenant, tuple(toks[:(j + 1) * self.B]))
        others = [h for h in self._held().get(block, []) if h != (r, j)]
        if others and self.shadow.content.get(block) != want:
            y, i = others[0]
            raise Finding("invariant", ["toctou_bound_stable"],
                          f"append(r={r}, j={j}): the manager filled block {block}, which request {y} "
                          f"holds as its block {i} (a bound block was overwritten)")
        copied = self.state[j] == READY and self.want[j] == want and bool(self.copies(j))
        events = reuse_events(self, block, j)
        self.shadow.fill(block, *want)
        self.stale.discard(block)
        self.want[j], self.state[j] = want, READY
        self.lineage[j] = lineage(self.cfg, self.req[r]["p"], j)
        written(self, j, block, copied)
        return events, copied

    def _append(self: Any, r: int, j: int) -> tuple[int | None, list[Any], bool]:
        """Request r's block j: reused when cached meanwhile, else a fresh block from the manager.
        Returns (block, the evictions the manager did to make room as events, whether the block
        is a second copy); block None: the allocation failed (nothing written)."""
        q = self._need(r, R_RUNNING)
        if len(q["blocks"]) != j or j >= q["n"]:
            raise ActionRejected(f"request {r} is not at block {j}")
        hits = self._engine_hits(r, j + 1)
        if len(hits) > j:                            # cached meanwhile: reuse it
            got = self._alloc(r, j, hits[j])
            if got is None:
                raise ActionRejected("allocate refused a cached block")
            return (got, [], False) if got == hits[j] else (got, *self._fill(r, j, got))  # another: computed
        old: list[int] = []                          # another prompt's copies of block j: rewritten
        if self.state[j] == READY and self.lineage[j] != lineage(self.cfg, q["p"], j):
            if self._holders(j):                     # in use: wait
                raise ActionRejected(f"block {j}'s copy holds another prompt and is in use")
            old = self.copies(j)
        got = self._alloc(r, j, None)
        if got is None:
            return None, [], False
        tenant, toks = self._prompt(r)
        if self.want[j] == (tenant, toks[:(j + 1) * self.B]) and got in self.copies(j):
            return got, [], False                    # its allocation shared a cached copy of it
        events, copied = self._fill(r, j, got)
        for b in old if self.evicts else ():         # the spec keeps one prompt per position: with
            if b != got and self.evict(b):           # an evict callback the other's copies go; without
                self.shadow.release(b)               # one they stay cached, uncounted (see _engine_hits)
        return got, events, copied

    def _write(self: Any, r: int, j: int, chosen: str, extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The manager's write of request r's block j for the spec's `chosen` write action (with
        its `extra` parameters mapped to None): its evictions come before the write as events,
        and a write other than `chosen` (a copy, a share, an allocation that fitted) is answered
        as the one it did (`instead`). No room: rejected, or, for append_fail, the preemption."""
        got, events, copied = self._append(r, j)
        if got is None:
            if chosen != "append_fail":
                raise ActionRejected("no free block (capacity)")
            return None
        self.events = events                         # before the write: the room it made
        did = "append_copy" if copied and self.cfg.duplicates == "allow" else "append"   # forbid: uncounted
        return None if did == chosen else {"instead": {"action": did, **(extra or {})}}

    def _a_append(self: Any, r: int, j: int) -> dict[str, Any] | None:
        return self._write(r, j, "append")

    def _a_append_fail(self: Any, r: int, j: int, x: int) -> dict[str, Any] | None:
        out = self._write(r, j, "append_fail", {"x": None})
        if self.req[r]["pos"] > j:
            return out                               # it fitted after all
        busy = [y for y, q in enumerate(self.req) if q["st"] in (R_DECIDED, R_BOUND, R_RUNNING)]
        newest = max(busy, key=lambda y: self.req[y]["t"])
        self._a_preempt(newest)                      # the scheduler preempts the newest request
        return {"instead": {"x": newest}} if newest != x else None


    def _a_evict(self: Any, g: int, kind: str, j: int) -> dict[str, Any] | None:
        if self.state[j] != READY:
            raise ActionRejected(f"block {j} is not cached")
        copies = self.copies(j)
        done = [b for b in copies if self.evict(b)]  # type: ignore[attr-defined]
        if not done:
            raise ActionRejected(f"the manager refused to evict block {copies}")
        for b in done:
            self.shadow.release(b)
        if len(done) < len(copies) and self.cfg.duplicates == "allow":
            return dropped_copy(self, j, done)       # a held copy stays: a second copy went
        self.stale.update(set(copies) - set(done))   # a copy it keeps unpublished: no longer counted
        self._gone(j)
        return None
