"""Adapters for tests/cli/test_adapter_check.py: the toy allocator declared wrongly."""
from examples.toy_allocator import ToyAllocator


class DeclaresTooMuch(ToyAllocator):
    """Declares use_stale (enabled only after a version bump, which it does not declare)."""

    name = "declares-too-much"
    actions = ToyAllocator.actions | {"use_stale"}


class UnknownAction(ToyAllocator):
    name = "unknown-action"
    actions = ToyAllocator.actions | {"frobnicate"}


class BrokenConstructor(ToyAllocator):
    def __init__(self, fault=None):
        raise RuntimeError("cannot open the device\nsecond line")


class BadObservation(ToyAllocator):
    name = "bad-observation"

    def observe(self):
        return [0, 1, 2]


class EvictsPinned(ToyAllocator):
    """Evicts a page whatever its reference count (a negative probe shows it)."""

    name = "evicts-pinned"

    def apply(self, action, p):
        if action == "evict" and p["j"] in self.pages:
            del self.pages[p["j"]]
            self.evicted.add(p["j"])
            return {}
        return super().apply(action, p)
