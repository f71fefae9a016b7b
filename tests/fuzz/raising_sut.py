"""SUTs for tests/fuzz/test_sut_raises.py: the toy allocator, broken in the ways a user's
adapter breaks (it raises where it should refuse, it reports a wrong page state)."""
from examples.toy_allocator import ToyAllocator
from kvcheck.spec.objects import EVICTED, READY


class RaisesInProbe(ToyAllocator):
    """Raises (instead of refusing with ActionRejected) when asked to evict a pinned page: only
    a negative probe asks that."""

    name = "raises-in-probe"

    def apply(self, action, p):
        if action == "evict" and self.pages.get(p["j"], {"ref": 0})["ref"] > 0:
            raise RuntimeError(f"page {p['j']} is pinned")
        return super().apply(action, p)


class RaisesInReset(ToyAllocator):
    name = "raises-in-reset"

    def reset(self, cfg):
        raise OSError("no device")


class WrongPageState(ToyAllocator):
    """Reports a cached page 1 as evicted."""

    name = "wrong-page-state"

    def observe(self):
        out = super().observe()
        slot = self.lay.o(0, "swa_window", 1, "st")
        if out[slot] == READY:
            out[slot] = EVICTED
        return out
