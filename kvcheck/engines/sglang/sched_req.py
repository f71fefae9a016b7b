"""The scheduler's side of a request on SGLang's scheduler path (sched.py): the fields of
SGLang's `Req` that 0.4.10-0.5.15's caches read (`FlatReq`, where SGLang's own `Req` keeps no `kv`
record or does not import on CPU), where a release keeps each of a request's KV fields on its own
`Req` (`req_get` / `req_set`: the request, or its `kv` record) and what the adapter keeps of such
a request (`Sched`)."""
from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass, field
from typing import Any

from kvcheck.fuzz.boundary import assign

from .compat import dec_params, load, method_reads

PENDING = 0     # the token sampled last: in output_ids, its KV not computed yet (0.4.10 drops it)
ROWS = 8        # request rows (the generator keeps at most four requests)


@dataclass
class FlatReq:
    """The fields of SGLang's `Req` that 0.4.10-0.5.22's caches read in cache_unfinished_req /
    cache_finished_req (RadixCache, SWARadixCache, MambaRadixCache, UnifiedRadixCache, ChunkCache).
    A stand-in because SGLang's own Req before 0.5.23 does not import on CPU everywhere; checked
    against the installed release before every campaign (interface.py: what the caches read)."""
    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    prefix_indices: Any = None
    req_pool_idx: int | None = None
    last_node: Any = None
    cache_protected_len: int = 0
    last_matched_prefix_len: int = 0     # 0.5.3-0.5.4 (EAGLE's unmatched token): the hit at admission
    extra_key: Any = None
    priority: int = 0
    is_chunked: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    kv_committed_freed: bool = False
    kv_overallocated_freed: bool = False
    swa_uuid_for_lock: Any = None
    swa_prefix_lock_released: bool = False
    swa_evicted_seqlen: int = 0
    swa_evict_floor: int = 0             # 0.5.15: tokens below it kept from SWA eviction (Req: 0)
    mamba_pool_idx: Any = None
    mamba_last_track_seqlen: Any = None
    mamba_ping_pong_track_buffer: Any = None
    mamba_next_track_idx: Any = None
    mamba_branching_seqlen: Any = None
    finished_reason: Any = None
    finished_len: Any = None
    session: Any = None
    to_finish: Any = None

    def pop_committed_kv_cache(self) -> int:
        assert not self.kv_committed_freed, "committed KV cache already freed"
        self.kv_committed_freed = True
        return self.kv_committed_len

    def pop_overallocated_kv_cache(self) -> tuple[int, int]:
        assert not self.kv_overallocated_freed, "overallocated KV cache already freed"
        self.kv_overallocated_freed = True
        return self.kv_committed_len, self.kv_allocated_len

    def finished(self) -> bool:
        return self.finished_reason is not None

    # releases after 0.5.12 (0.5.14 ...) read the computed tokens through these (Req keeps full_untruncated_fill_ids
    # and admits by moving fill_len); here they are the tokens the scheduler has computed
    @property
    def fill_len(self) -> int:
        return len(self.fill_ids)

    def get_fill_ids(self) -> list[int]:
        return self.fill_ids

    @property
    def extend_range(self) -> Any:      # 0.5.15: what this round computes, [prefix, filled)
        from collections import namedtuple
        start = 0 if self.prefix_indices is None else len(self.prefix_indices)
        return namedtuple("Range", "start end")(start, len(self.fill_ids))

    def is_dllm(self) -> bool:      # 0.5.9's ReqToTokenPool.alloc asks (a diffusion LM's request)
        return False


@dataclass
class Sched:
    """A request on the scheduler path: SGLang's request object, its row, the prompt length,
    and how many of its tokens are computed (< prompt length: mid-prefill)."""
    req: Any
    row: int
    prompt: int
    computed: int
    inserted: bool = False


def frees_committed(cache: Any) -> bool:
    """Whether the release's `cache_finished_req` frees what the request committed (0.5.7+:
    `pop_committed_kv_cache`), so that SGLang's scheduler may release a request aborted in the
    middle of its chunked prefill. Before (0.4.10-0.5.4) it frees the whole prompt's row, and
    the scheduler never releases a request mid-prefill that way: it aborts it by shrinking its
    prompt to one token and finishing it (`set_finish_with_abort`; `is_insert=False` is for
    retracting decoding requests), so kvcheck does not drive such an abort there."""
    return method_reads(cache, "cache_finished_req", "pop_committed_kv_cache", "kv_committed_len")


def fill_own(q: Any, seq: Any, n: int) -> None:
    """SGLang's own Req computed up to n of `seq` (its whole token sequence), in the fields this
    release has: `fill_len` (0.5.14), `extend_range` (0.5.15+), else `fill_ids`; and the KV lengths
    where it keeps them (0.5.2's ChunkCache frees prompt + output instead)."""
    if hasattr(q, "fill_len"):
        assign(q, full_untruncated_fill_ids=seq, fill_len=n)
    elif hasattr(q, "extend_range"):
        from sglang.srt.utils.common import Range
        assign(q, full_untruncated_fill_ids=seq, extend_range=Range(0, n))
    else:
        assign(q, fill_ids=seq[:n])
    for k in ("kv_committed_len", "kv_allocated_len"):
        if req_has(q, k):
            req_set(q, **{k: n})


# ---- a request's KV fields, wherever the release keeps them ----------------------------------
def _record_cls(q: Any) -> Any:
    """The release's KV record type (`ReqKvInfo`, beside its Req), None without one."""
    cls = getattr(sys.modules.get(type(q).__module__), "ReqKvInfo", None)
    return cls if isinstance(cls, type) and dataclasses.is_dataclass(cls) else None


def _record_fields(q: Any) -> dict[str, dataclasses.Field] | None:
    cls = _record_cls(q)
    return None if cls is None else _fields_of(cls)


@functools.lru_cache(maxsize=None)
def _fields_of(cls: type) -> dict[str, dataclasses.Field]:
    """A record type's fields by name, read once per type (every request field set asks)."""
    return {f.name: f for f in dataclasses.fields(cls)}


def holder(q: Any, name: str) -> Any:
    """The object that keeps request field `name` in this release: the request's `kv` record where
    the record declares it (0.5.16-0.5.18 move a few fields there, 0.5.19+ all of them), else the
    request. A record the release makes at allocation (0.5.16-0.5.18: `kv` None until then; kvcheck
    allocates the row itself) is made here as that allocation makes it: its required fields 0."""
    fs = _record_fields(q)
    if fs is None or name not in fs:
        return q
    rec = getattr(q, "kv", None)
    if rec is None:
        rec = _record_cls(q)(**{n: 0 for n, f in fs.items() if f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING})
        q.kv = rec
    return rec


def req_has(q: Any, name: str) -> bool:
    """Whether this release keeps field `name` of a request (on it, or in its record)."""
    fs = _record_fields(q)
    return (fs is not None and name in fs) or hasattr(q, name)


def req_get(q: Any, name: str) -> Any:
    return getattr(holder(q, name), name)


def req_set(q: Any, **values: Any) -> None:
    """Set request fields where the release keeps them; one it has nowhere is kvcheck's drift
    (`assign`: "cannot drive"), never silently ignored."""
    for k, v in values.items():
        assign(holder(q, k), **{k: v})


# ---- the admission's lock receipt, as the release's scheduler keeps it in the request --------
def keep_lock(q: Any, rec: Any) -> None:
    """Keep `rec` (what inc_lock_ref returned: an IncLockRefResult, or 0.5.7's SWA uuid) in the
    request's field for it: `lock_receipt` (0.5.20-0.5.21: its DecLockRefParams), else
    `swa_uuid_for_lock` (0.5.19 and FlatReq: the SWA uuid alone). 0.5.22+ keep a TreeLock (sched.py)."""
    if req_has(q, "lock_receipt"):
        params = load()["bpc"].DecLockRefParams
        req_set(q, lock_receipt=params() if rec is None else dec_params(rec) if hasattr(rec, "swa_uuid_for_lock")
                or hasattr(rec, "to_dec_params") else params(swa_uuid_for_lock=rec))
    elif req_has(q, "swa_uuid_for_lock"):
        req_set(q, swa_uuid_for_lock=getattr(rec, "swa_uuid_for_lock", rec))


def kept_lock(q: Any) -> Any:
    """The lock receipt the request keeps after SGLang moved its lock (the field `keep_lock` wrote)."""
    for name in ("lock", "lock_receipt", "swa_uuid_for_lock"):
        if req_has(q, name):
            return req_get(q, name)
    return None


def swa_uuid(receipt: Any) -> Any:
    """The SWA uuid of a kept receipt (a DecLockRefParams / IncLockRefResult, or the uuid itself)."""
    return getattr(receipt, "swa_uuid_for_lock", receipt)
