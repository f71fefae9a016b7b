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

Scope: one-group layouts, and hybrid layouts of full and sliding-window attention groups where
the release serves them through a connector (``SupportsHMA``, ``request_finished_all_groups``,
implemented by a connector of its own: 0.18+, has_hma): a connector without it makes vLLM turn
the hybrid manager off, so the class declares it and serves every group. Per group, a load fills the non-null blocks vLLM allocates for the external tokens
(a sliding window's skipped blocks are null), and the store offers a prefix only when it holds
every block each group reads there (a window's blocks near the prefix end, all of a full group's).
A hybrid load cannot fail a block (vLLM raises on ``invalid_block_ids`` with several groups: block
ids are per group); it fails whole, reported in ``failed_recving`` (0.32+; before, a hybrid
connector has no way to report a failure, so none fails). Groups holding state or compressed
entries (Mamba, DeepSeek-V4's compressor) are not served: their transfers are not modelled.
Synchronous loads fail too with the knob ``sync_fail`` (opt-in: SYNC_FAILURES_ENV; one in four,
one block, one-group layouts): the forward runs on the garbage, vLLM discards that request's
output and recomputes from the failed block, and what the forward wrote for it is torn until
then (timeline.discarded). The store itself is connector_store.py.
"""
from __future__ import annotations

import zlib
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


HMA_KINDS = ("full", "mla", "swa", "swa_mla")     # the groups a hybrid load serves


def has_hma() -> bool:
    """Does the installed release serve hybrid layouts through a connector: ``SupportsHMA`` and a
    connector of its own implementing it? 0.14-0.17 have the interface but no connector using it,
    and their scheduler's remote-KV path unpacks one group (``_update_waiting_for_remote_kv``:
    ``(block_ids,) = ...get_block_ids``): an async hybrid load raises there. 0.18 ships NIXL's."""
    if "hma" not in _CLASS:
        import pathlib
        import re
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
        pat = re.compile(r"^class \w+\([^)]*\bSupportsHMA\b", re.M)
        _CLASS["hma"] = hasattr(base, "SupportsHMA") and any(
            pat.search(f.read_text(errors="replace")) for f in pathlib.Path(base.__file__).parent.rglob("*.py")
            if f.name != "base.py")
    return bool(_CLASS["hma"])


def supported(groups: list) -> str | None:
    """Why the connector cannot run on a layout with `groups` (None: it can)."""
    if len(groups) == 1:
        return None
    other = sorted({k for k, _, _ in groups if k not in HMA_KINDS})
    if other:
        return (f"the stub connector serves full and sliding-window attention groups; this layout has "
                f"{', '.join(other)} groups (their state or compressed-entry transfers are not modelled)")
    if not has_hma():
        return ("this vLLM serves no hybrid layout through a KV connector (no connector of its own implements "
                "SupportsHMA; without it vLLM turns the hybrid manager off)")
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
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    bases = (base.KVConnectorBase_V1,) + ((base.SupportsHMA,) if hasattr(base, "SupportsHMA") else ())

    class StoreConnector(*bases):      # type: ignore[misc, valid-type]
        """The scheduler side delegates to kvcheck's Store (set on it after the build)."""

        store: Any = None          # (connector_store.Store)

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return self.store.matched(request, num_computed_tokens) if self.store else (0, False)

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            if self.store:
                self.store.allocated(request, blocks, num_external_tokens)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return base.KVConnectorMetadata()

        def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
            return (self.store.finished(request, (block_ids,)) if self.store else False), None

        def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
            return (self.store.finished(request, tuple(block_ids)) if self.store else False), None

        # the worker side: kvcheck's fake model runner does the transfers (never called here)
        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
        def wait_for_layer_load(self, layer_name: str) -> None: ...
        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...
        def wait_for_save(self) -> None: ...

    return StoreConnector
