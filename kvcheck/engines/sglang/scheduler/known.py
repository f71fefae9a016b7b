"""Known SGLang defects the scheduler drive reaches, recognised by their upstream fix.

As for vLLM (engines/vllm/known.py), recognition is counterfactual where the fix can be applied
as a wrapper: a finding on a release in a defect's range is that defect when the same steps, run
again on a fresh scheduler with the defect's fix applied (a wrapper doing what the fixed release
does), raise nothing. Where the fix is a new method inside SGLang's insert loop (#29352), the
rerun instead watches for the defect's mechanism: the finding is that defect when the same steps
run again reproduce the same check and the mechanism happened on the way. Weaker than a fix (a
second bug on the same steps after the mechanism would be counted under the first), so such a
defect says so in its record (`witness`). Anything
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


@contextlib.contextmanager
def _locked_full_freed_by_recovery() -> Iterator[list]:
    """sgl-project/sglang#29352's mechanism, watched: `SWARadixCache`'s insert recovers a
    tombstoned node (the window evicted its SWA KV) by freeing the node's full KV and adopting
    the request's, even while running requests lock that full KV (0.5.15 keeps a locked node's
    full KV: `_recover_tombstone_keeping_locked_full`). Yields the list of such frees."""
    from ..install import load
    load()
    import sglang.srt.mem_cache.swa_radix_cache as m
    cls, seen = m.SWARadixCache, []
    real = cls._insert_helper

    def helper(self: Any, *a: Any, **k: Any) -> Any:
        locked: set[int] = set()
        stack = [self.root_node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.swa_tombstone and n.full_lock_ref > 0 and n.value is not None:
                locked.update(int(x) for x in n.value.tolist())
        alloc = self.token_to_kv_pool_allocator
        if not locked or "free" in vars(alloc):
            return real(self, *a, **k)
        real_free = alloc.free

        def free(idx: Any) -> Any:
            if locked & {int(x) for x in idx.tolist()}:
                seen.append(sorted(locked & {int(x) for x in idx.tolist()}))
            return real_free(idx)
        alloc.free = free
        try:
            return real(self, *a, **k)
        finally:
            del alloc.free
    cls._insert_helper = helper
    try:
        yield seen
    finally:
        cls._insert_helper = real


@contextlib.contextmanager
def _one_cut_per_batch() -> Iterator[None]:
    """The rule SGLang keeps without an SWA pool (a cut spends the chunk budget, so nothing is
    admitted after it) applied to every batch: once a request of the batch being built is cut
    (`new_chunked_req`), `PrefillAdder.add_one_req` admits no other request. Conservative (a
    request that would fit whole waits a round too); what it changes is admission only."""
    from ..install import load
    load()
    import sglang.srt.managers.schedule_policy as sp
    cls = sp.PrefillAdder
    real = cls.add_one_req

    def add_one_req(self: Any, *a: Any, **k: Any) -> Any:
        if getattr(self, "new_chunked_req", None) is not None:
            return sp.AddReqResult.OTHER
        return real(self, *a, **k)
    cls.add_one_req = add_one_req
    try:
        yield
    finally:
        cls.add_one_req = real


@contextlib.contextmanager
def _stash_at_computed_prefix() -> Iterator[None]:
    """sgl-project/sglang#24318's rule (the fix of #24252): a chunked request whose next chunk the
    SWA budget did not admit is stashed at its computed prefix, not at the `fill_ids` its next round
    already expanded; applied where the stash reaches the tree (`cache_unfinished_req`: fill_ids
    cut back to what was computed, `kv_committed_len`)."""
    from ..install import load
    load()
    import sglang.srt.mem_cache.swa_radix_cache as m
    cls = m.SWARadixCache
    real = cls.cache_unfinished_req

    def cache_unfinished_req(self: Any, req: Any, *a: Any, **k: Any) -> Any:
        done = getattr(req, "kv_committed_len", None)
        if done is not None and len(req.fill_ids) > done:
            req.fill_ids = req.fill_ids[:done]
        return real(self, req, *a, **k)
    cls.cache_unfinished_req = cache_unfinished_req
    try:
        yield
    finally:
        cls.cache_unfinished_req = real


@dataclass(frozen=True)
class SchedKnown:
    defect: KnownDefect
    checks: tuple[str, ...]             # the checks it makes fire
    components: tuple[str, ...]         # the layouts it can reach
    fixed: Callable[[], contextlib.AbstractContextManager]
    witness: bool = False               # `fixed` watches the mechanism (yields what it saw), fixes nothing


KNOWN = (
    SchedKnown(KnownDefect(
        "swa_free_group_stale_mapping", "kv_read_sound", "safety", "0.5.18", "0.5.18",
        "sgl-project/sglang#36081 (fixed in 0.5.19 by #36381/#36646: free_swa resolves the SWA peer when queued)",
        "kvcheck replay docs/repro/traces/sglang_sched_swa_free_group_stale_mapping.trace.json --sut sglang"),
        # a live SWA slot freed: read as the padding slot, reused and overwritten, or unaccounted
        ("kv_read_sound", "hit_sound_swa_window", "tree_content_matches", "no_write_into_cached", "size_accounting",
         "sglang_internal_error"), ("full", "swa"),
        _resolve_swa_at_enqueue),
    SchedKnown(KnownDefect(
        "swa_recover_frees_locked_full", "size_accounting", "safety", "0.4.10", "0.5.14",
        "sgl-project/sglang#29352 (fixed in 0.5.15: a tombstoned node whose full KV is locked keeps it)",
        "kvcheck replay docs/repro/traces/sglang_sched_swa_recover_frees_locked_full.trace.json --sut sglang"),
        # a running request's full KV freed: unaccounted, reused, read, or SGLang's own leak check
        ("size_accounting", "kv_read_sound", "hit_sound_full", "tree_content_matches", "no_write_into_cached",
         "no_evict_locked", "lock_ref_equals_holders", "sglang_internal_error"), ("full", "swa"),
        _locked_full_freed_by_recovery, witness=True),
    SchedKnown(KnownDefect(
        "swa_cut_request_replaced", "context_complete", "safety", "0.5.17", "0.5.23",
        "not reported upstream yet: kvcheck's finding (docs/findings-sglang.md); an SWA-capped cut leaves "
        "the chunk budget unspent, a second request is cut too and replaces the first as new_chunked_req",
        "kvcheck replay docs/repro/traces/sglang_sched_swa_pool_below_chunk.trace.json --sut sglang"),
        # the first cut request decodes over its truncated prompt; 0.5.23 later asserts in free_group_end
        ("context_complete", "kv_read_sound", "sglang_internal_error"), ("full", "swa"),
        _one_cut_per_batch),     # (watched on SWARadixCache, what 0.5.7-0.5.14 build)
    SchedKnown(KnownDefect(
        "swa_unadmitted_chunk_cached", "tree_content_matches", "safety", "0.5.11", "0.5.11",
        "sgl-project/sglang#24252 (fixed by #24318: a chunk the SWA budget defers is stashed at the computed "
        "prefix, not at fill_ids expanded past it)",
        "kvcheck replay docs/repro/traces/sglang_sched_swa_unadmitted_chunk_cached.trace.json --sut sglang"),
        # the tree caches positions never computed (row entries 0): read back, reused, or SGLang's own checks
        ("tree_content_matches", "kv_read_sound", "hit_sound_full", "size_accounting", "sglang_internal_error"),
        ("full", "swa"), _stash_at_computed_prefix),
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
            with k.fixed() as seen:
                out = rerun()
            if (out is not None and out.checks[0] == check and seen) if k.witness else out is None:
                return k.defect.name
    return None

