"""An external prefix store behind vLLM's KV connector interface, on the scheduler drive.

What an offloading or P/D connector does to the blocks vLLM's scheduler hands it, kept as the
timeline's bytes (timeline.py): when a request is admitted the connector offers the longest
stored prefix past its local hit (``get_num_new_matched_tokens``); the load is synchronous
(written before the step's forward reads) or asynchronous (the request waits in
``WAITING_FOR_REMOTE_KVS`` until the worker reports it in ``finished_recving``, some steps later)
and an asynchronous load may fail for one block (``invalid_block_ids``: that block's bytes never
arrive, vLLM recomputes from it). A finished request's full blocks are stored, at once or
asynchronously (``request_finished`` holds its blocks until the worker reports
``finished_sending``): the store copies whatever bytes the blocks hold when the copy completes,
so a block vLLM reallocated and overwrote meanwhile corrupts the stored prefix, and a later load
of it shows as a read of bytes that do not hold the prefix (``read_before_write``).

Every decision is a stable function of the request id and its attempt (no random state), so a
replay of the same steps makes the same transfers. The connector class itself subclasses the
installed release's ``KVConnectorBase_V1`` (its defaults for everything kvcheck does not model)
and is registered with the release's ``KVConnectorFactory``; the worker side is kvcheck's fake
model runner (engine_sched.py), which fills ``ModelRunnerOutput.kv_connector_output``.

Scope: layouts with one KV cache group. A connector without ``SupportsHMA`` makes vLLM turn the
hybrid manager off (0.14-0.2x) or refuse (later releases), so a hybrid layout is not what it says
with this connector; a stub with ``SupportsHMA`` (``request_finished_all_groups``, per-group
loads) is the extension. Synchronous loads fail too with the knob ``sync_fail`` (opt-in:
SYNC_FAILURES_ENV; one in four, one block): the
forward runs on the garbage, vLLM discards that request's output and recomputes from the failed
block, and what the forward wrote for it is torn until then (timeline.discarded).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

NAME = "KvcheckPrefixStore"
# Failed synchronous loads are opt-in: with them, every one-group campaign meets vLLM's known defect
# connector_recompute_stale_block within seconds (docs/findings-vllm.md), so default verdicts would
# all be that one defect until teams acknowledge it.
SYNC_FAILURES_ENV = "KVCHECK_VLLM_SYNC_LOAD_FAILURES"
_CLASS: dict[str, Any] = {}


def sync_failures_on() -> bool:
    """Do this process's episodes draw failed synchronous connector loads (SYNC_FAILURES_ENV=1)?"""
    import os
    return os.environ.get(SYNC_FAILURES_ENV, "") not in ("", "0")


def stable(*parts: Any) -> int:
    """A stable pseudo-random number of `parts` (the connector's decisions, replayable)."""
    return zlib.crc32("|".join(map(str, parts)).encode())


def supported(groups: list) -> str | None:
    """Why the connector cannot run on a layout with `groups` (None: it can)."""
    if len(groups) != 1:
        return (f"the stub connector serves one KV cache group; this layout has {len(groups)} (a connector "
                "without SupportsHMA turns vLLM's hybrid manager off or is refused)")
    return None


def register() -> None:
    """Register the connector class with the release's factory (once per process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    reg = getattr(KVConnectorFactory, "_registry", {})
    if NAME not in reg:
        KVConnectorFactory.register_connector(NAME, __name__, "StoreConnector")


def transfer_config() -> Any:
    """The release's KVTransferConfig naming the connector (both roles; recompute on failure)."""
    import inspect
    from vllm.config import KVTransferConfig
    register()
    extra = {"kv_load_failure_policy": "recompute"} \
        if "kv_load_failure_policy" in inspect.signature(KVTransferConfig).parameters else {}
    return KVTransferConfig(kv_connector=NAME, kv_role="kv_both", **extra)


def __getattr__(name: str) -> Any:
    """``StoreConnector``: built on first use, on the installed release's base class."""
    if name != "StoreConnector":
        raise AttributeError(name)
    if "cls" not in _CLASS:
        _CLASS["cls"] = _make_class()
    return _CLASS["cls"]


def _make_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    class StoreConnector(KVConnectorBase_V1):      # type: ignore[misc, valid-type]
        """The scheduler side delegates to kvcheck's Store (set on it after the build)."""

        store: "Store | None" = None

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return self.store.matched(request, num_computed_tokens) if self.store else (0, False)

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            if self.store:
                self.store.allocated(request, blocks, num_external_tokens)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return KVConnectorMetadata()

        def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
            return (self.store.finished(request, block_ids) if self.store else False), None

        # the worker side: kvcheck's fake model runner does the transfers (never called here)
        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
        def wait_for_layer_load(self, layer_name: str) -> None: ...
        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...
        def wait_for_save(self) -> None: ...

    return StoreConnector


@dataclass
class Load:
    rid: str
    lo: int                    # the local hit: the load covers tokens [lo, hi)
    hi: int
    sync: bool
    due: int                   # async: the step whose output reports it finished
    failed: int | None = None  # the table index of the block whose load fails


@dataclass
class Send:
    rid: str
    ends: list[int]            # block ends stored
    bids: list[int]
    due: int
    keys: list[tuple] = field(default_factory=list)


class Store:
    """kvcheck's side of the connector: what the store holds (prefix key -> bytes sound) and the
    transfers in flight, on the adapter's timeline."""

    def __init__(self, ad: Any) -> None:
        self.ad, self.bs = ad, ad.groups[0][1]
        self.held: dict[tuple, bool] = {}
        self.offer: dict[str, tuple[int, bool]] = {}   # rid -> (its local hit, load async) offered
        self.loads: dict[str, Load] = {}
        self.sends: dict[str, Send] = {}
        self.failed: set[int] = set()          # blocks a failed load left unwritten (until written)
        self.sync_failed: set[int] = set()     # this step's failed sync-load blocks (to report)
        self.step = 0

    def _key(self, req: Any, end: int) -> tuple:
        salt, p = self.ad._content(req, end)           # (a content.Prefix: compared by its key)
        return salt, p.key

    # ---- the scheduler side ------------------------------------------------------------------
    def matched(self, request: Any, local: int) -> tuple[int, bool]:
        rid = request.request_id
        req, bs = self.ad.reqs.get(rid), self.bs
        if req is None or local % bs:
            return 0, False
        n = local
        while n + bs <= request.num_tokens - 1 and self.held.get(self._key(req, n + bs)) is not None:
            n += bs
        if n == local:
            return 0, False
        self.offer[rid] = (local, stable(rid, request.num_preemptions, "async") % 2 == 0)
        return n - local, self.offer[rid][1]

    def allocated(self, request: Any, blocks: Any, ext: int) -> None:
        rid = request.request_id
        offer = self.offer.pop(rid, None)
        if ext <= 0 or offer is None:
            return
        lo, sync = offer[0], not offer[1]
        h = stable(rid, request.num_preemptions, "load")
        load = Load(rid, lo, lo + ext, sync, self.step + 1 + h % 3)
        if not sync and h % 4 == 0:
            self._fail_one(load, h)
        self.loads[rid] = load

    def _fail_one(self, load: Load, h: int) -> None:
        """The load fails one of its blocks (which one: a stable function `h` of the request)."""
        first, last = load.lo // self.bs, load.hi // self.bs
        load.failed = first + (h >> 4) % max(1, last - first)

    def finished(self, request: Any, block_ids: list[int]) -> bool:
        """Store the request's full blocks; True: hold them until the worker reports the copy done
        (also while a load into them is still in flight)."""
        rid = request.request_id
        req, bs = self.ad.reqs.get(rid), self.bs
        self.ad._accept(rid)       # (drafts the step's sampler accepted: written by its forward, already)
        loading = rid in self.loads and not self.loads[rid].sync
        if req is None:
            return loading
        n = min(request.num_computed_tokens, request.num_tokens) // bs
        ends = [(i + 1) * bs for i in range(min(n, len(block_ids)))
                if self.held.get(self._key(req, (i + 1) * bs)) is None]
        if not ends and not loading:
            return False
        delayed = loading or stable(rid, "send") % 2 == 0
        send = Send(rid, ends, [block_ids[e // bs - 1] for e in ends], self.step + 1 + stable(rid, "due") % 2,
                    [self._key(req, e) for e in ends])
        if not delayed:
            self._copy(send, req)
            return False
        self.sends[rid] = send
        return True

    def _copy(self, send: Send, req: Any) -> None:
        tl = self.ad.timeline
        for end, bid, key in zip(send.ends, send.bids, send.keys):
            sound = req is not None and tl.holds(bid, self.ad._content(req, end))
            self.held.setdefault(key, sound)

    # ---- the worker side ---------------------------------------------------------------------
    def before_forward(self, so: Any) -> None:
        """Synchronous loads of the requests this step runs: written before the forward reads. One
        in four fails one block: reported in this step's ``invalid_block_ids``; the forward runs
        anyway on the garbage (vLLM then discards the request's output and recomputes from the
        failed block), so what the request writes in it is torn."""
        for rid in so.num_scheduled_tokens:
            load = self.loads.get(rid)
            if load is not None and load.sync:
                del self.loads[rid]
                h = stable(rid, load.lo, load.hi, "sync-fail")
                if self.ad.knobs.sync_fail and h % 4 == 0:
                    self._fail_one(load, h)
                bad = self._write(load)
                if bad is not None:
                    self.sync_failed.add(bad)
        # vLLM discards the output of every running request holding a failed block (the loader, and
        # any that hit it in the step: _update_requests_with_invalid_blocks); their forward ran on it
        for rid in so.num_scheduled_tokens if self.sync_failed else ():
            if any(b.block_id in self.sync_failed for b in self.ad._table(0, rid)):
                self.ad.timeline.discarded.add(rid)

    def output(self) -> dict[str, Any]:
        """The worker's ``kv_connector_output`` for this step: finished async loads (their bytes
        written now, a failed block's never) and finished stores."""
        self.step += 1
        recving, sending, invalid = set(), set(), set(self.sync_failed)
        self.sync_failed = set()
        for rid, load in list(self.loads.items()):
            if load.sync or load.due > self.step:
                continue
            del self.loads[rid]
            if rid in self.sends:                # aborted while loading: the blocks were held for it
                continue
            bad = self._write(load)
            if bad is not None:
                invalid.add(bad)
            recving.add(rid)
        for rid, send in list(self.sends.items()):
            if send.due > self.step or rid in self.loads:
                continue
            del self.sends[rid]
            self._copy(send, self.ad.reqs.get(rid))
            sending.add(rid)
        return {"finished_recving": recving or None, "finished_sending": sending or None, "invalid_block_ids": invalid}

    def _write(self, load: Load) -> int | None:
        """The load's blocks receive what the store holds; returns the failed block's id."""
        ad, bs, bad = self.ad, self.bs, None
        req = ad.reqs.get(load.rid)
        if req is None:
            return None
        table = ad._table(0, load.rid)
        for i in range(load.lo // bs, min(len(table), load.hi // bs)):
            b = table[i]
            if b.is_null:
                continue
            if i == load.failed:
                bad = b.block_id
                self.failed.add(bad)
                continue
            self.failed.discard(b.block_id)
            sound = self.held.get(self._key(req, (i + 1) * bs))
            ad.timeline.ready[b.block_id] = ad._content(req, (i + 1) * bs) if sound else _torn()
            ad.timeline.cancelled.pop(b.block_id, None)
            ad.timeline.garbled.pop(b.block_id, None)
        return bad

    def loading(self) -> set[int]:
        """Blocks an asynchronous load in flight is still to fill."""
        out: set[int] = set()
        for load in self.loads.values():
            if not load.sync:
                table = self.ad._table(0, load.rid)
                out.update(b.block_id for b in table[load.lo // self.bs: load.hi // self.bs] if not b.is_null)
        return out

    def busy(self) -> bool:
        """A transfer holds blocks outside the running requests (an async load, loaded blocks of a
        request not scheduled yet, a delayed store)."""
        return bool(self.sends) or any(not x.sync for x in self.loads.values()) or any(
            r.state != "running" and self.ad._table(0, rid) for rid, r in self.ad.reqs.items())



def _torn() -> tuple:
    from .timeline import TORN
    return TORN
