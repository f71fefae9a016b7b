"""Known SGLang defects the scheduler drive reaches, recognised by their upstream fix.

As for vLLM (engines/vllm/known.py), recognition is counterfactual: a finding on a release in a
defect's range is that defect when the same steps, run again on a fresh scheduler with the
defect's fix applied (a wrapper doing what the fixed release does), raise nothing. Anything
else — another cause of the same check, a planted fault, a release outside the range — is
reported under its own check. A recognised finding is counted under `known:NAME` (the campaign
goes on with the next episode); what it means for the verdict is the core's rule
(kvcheck/fuzz/known.py): a finding unless the team acknowledged it. Replays show the finding
itself (`STRICT`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from kvcheck.fuzz.known import KnownDefect

STRICT = False        # recognition off: every finding under its own check (replays, tests)


@contextlib.contextmanager
def _resolve_swa_at_enqueue() -> Iterator[None]:
    """0.5.19's rule (sgl-project/sglang#36381, #36646): a grouped `free_swa` reads the full->SWA
    mapping when the free is queued, not when the group is flushed."""
    import torch
    from ..install import load
    load()
    import sglang.srt.mem_cache.allocator.swa as sw
    cls = sw.SWATokenToKVPoolAllocator
    real_swa, real_end = cls.free_swa, cls.free_group_end

    def free_swa(self: Any, free_index: Any) -> None:
        if free_index.numel() == 0:
            return
        mi = free_index if self.page_size == 1 else self._expand_to_full_pages(free_index)
        peers = self.full_to_swa_index_mapping[mi]
        peers = peers[peers > 0]
        self.full_to_swa_index_mapping[mi] = 0
        if not self.is_not_in_free_group:
            self.__dict__.setdefault("_kvcheck_resolved", []).append(peers.clone())
            return
        self.swa_attn_allocator.free(peers)

    def free_group_end(self: Any) -> None:
        real_end(self)
        pending = self.__dict__.pop("_kvcheck_resolved", [])
        if pending:
            self.swa_attn_allocator.free(torch.cat(pending))
    cls.free_swa, cls.free_group_end = free_swa, free_group_end
    try:
        yield
    finally:
        cls.free_swa, cls.free_group_end = real_swa, real_end


@dataclass(frozen=True)
class SchedKnown:
    defect: KnownDefect
    checks: tuple[str, ...]             # the checks it makes fire
    components: tuple[str, ...]         # the layouts it can reach
    fixed: Callable[[], contextlib.AbstractContextManager]


KNOWN = (
    SchedKnown(KnownDefect(
        "swa_free_group_stale_mapping", "kv_read_sound", "safety", "0.5.18", "0.5.18",
        "sgl-project/sglang#36081 (fixed in 0.5.19 by #36381/#36646: free_swa resolves the SWA peer when queued)",
        "kvcheck replay docs/repro/traces/sglang_sched_swa_free_group_stale_mapping.trace.json --sut sglang"),
        # a live SWA slot freed: read as the padding slot, reused and overwritten, or unaccounted
        ("kv_read_sound", "hit_sound_swa_window", "tree_content_matches", "no_write_into_cached", "size_accounting",
         "sglang_internal_error"), ("full", "swa"),
        _resolve_swa_at_enqueue),
)
DEFECTS = {k.defect.name: k.defect for k in KNOWN}


def recognise(lay: Any, fault: str | None, version: str | None, check: str,
              rerun: Callable[[], Any]) -> str | None:
    """The known defect behind a finding of `check` (None: not one). `rerun()` runs the finding's
    steps again on a fresh scheduler and returns its finding (None: clean)."""
    if STRICT or fault is not None:
        return None
    for k in KNOWN:
        if k.defect.in_release(version) and check in k.checks and lay.components == k.components:
            with k.fixed():
                if rerun() is None:
                    return k.defect.name
    return None
