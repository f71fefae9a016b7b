"""Drive the spec by hand in tests: named actions on a concrete state."""
from __future__ import annotations

from kvcheck.spec.system import Spec


class Driver:
    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.s = spec.init()
        self.log: list[str] = []

    def can(self, action: str, **params) -> bool:
        return self.spec.instance(action, params).guard(self.s)

    def do(self, action: str, **params) -> "Driver":
        inst = self.spec.instance(action, params)
        assert inst.guard(self.s), f"{inst.label()} not enabled after {self.log}"
        self.s = inst.effect(self.s)
        self.log.append(inst.label())
        return self

    def violations(self) -> list[tuple[str, str]]:
        return self.spec.check(self.s)

    def field(self, *key) -> int:
        return self.s[self.spec.lay.index[key]]

    def fill(self, r: int, n: int) -> "Driver":
        """Request r computes blocks 0..n-1 from scratch and finishes; entries compressed and
        the indexer synced."""
        self.do("submit", r=r, n=n).do("lookup", r=r).do("bind", r=r).do("use", r=r)
        for j in range(self.field("r", r, "rpos"), n):
            if "slide" in self.spec.actions and self.can("slide", r=r):   # absent: no window moves
                self.do("slide", r=r)
            self.do("append", r=r, j=j)
        self.settle()
        return self.do("finish", r=r)

    def settle(self) -> "Driver":
        for inst in self.spec.instances:
            if inst.action in ("compress", "indexer_sync") and inst.guard(self.s):
                self.s = inst.effect(self.s)
                self.log.append(inst.label())
        return self
