"""The cache objects' vocabulary, declared once: lifecycle states, decisions, degradation
reasons, and one `ObjectKind` per kind with its per-kind rules (the rules take the config as an
argument; they need not import it).

A module of its own, below config.py: config validates pool capacities against DEVICE_KINDS, and
objects.py (the recovery predicates over a config) imports config. objects.py re-exports every
name here, so `from kvcheck.spec.objects import ...` keeps working.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# ---- device object lifecycle (compressed_kv, tail, swa_window, indexer) -----------------
FREE, WRITING, READY, EVICTED = 0, 1, 2, 3
DEVICE_STATES = ("free", "writing", "ready", "evicted")
# WRITING means: allocated, content not final. For compressed_kv: the entry is still being
# compressed from its tail; for indexer: the indexer lags the KV (not yet synced); tail and
# swa_window pages are written in one step and never sit in WRITING.

# ---- on-disk copy lifecycle (one per logical block; the offloaded copy of all its objects) --
D_NONE, D_OFFLOADING, D_DURABLE, D_LOADING, D_UNVERIFIED, D_QUARANTINED = 0, 1, 2, 3, 4, 5
DISK_STATES = ("none", "offloading", "durable", "loading", "loaded_unverified", "quarantined")

# ---- requests ------------------------------------------------------------------------
R_IDLE, R_WAITING, R_DECIDED, R_BOUND, R_RUNNING, R_PREEMPTED = 0, 1, 2, 3, 4, 5
REQUEST_STATES = ("idle", "waiting", "decided", "bound", "running", "preempted")
# decided: looked up (check done), not yet bound; bound: pinned + leased, not yet used;
# running: lease re-validated at use, computing from rpos on.

# ---- decisions -----------------------------------------------------------------------
D_NO, RECOMPUTE, PARTIAL, PREFETCH, REUSE = 0, 1, 2, 3, 4
DECISIONS = ("none", "RECOMPUTE", "PARTIAL", "PREFETCH", "REUSE")
DECISION_KINDS = tuple(DECISIONS[c] for c in (REUSE, PARTIAL, PREFETCH, RECOMPUTE))  # a lookup's answers

# ---- degradation reasons (bits), named by the funnel layer that raises them ------------
REASONS = (
    ("lcm_alignment", 1),          # layer 1: hit not a whole number of LCM pages
    ("abi_mismatch", 2),           # layer 2: kernel ABI / layout fingerprint differs
    ("model_version", 4),          # layer 2: written by another model/compressor version
    ("indexer_version", 8),        # layer 2: indexer keys from another indexer version
    ("compressed_missing", 16),    # layer 3: a compressed entry is evicted or unfinished
    ("tail_missing", 32),          # layer 3: the tail snapshot at the hit point is gone
    ("window_incomplete", 64),     # layer 3: a page inside the SWA window is gone
    ("indexer_lagging", 128),      # layer 3: indexer not synced with the KV
    ("on_disk_not_ready", 256),    # layer 3: data registered on disk/host but not loaded
    ("misaligned", 512),           # layer 4: physical address not hardware-aligned
)
REASON_BIT = dict(REASONS)


def reason_names(bits: int) -> list[str]:
    return [name for name, bit in REASONS if bits & bit]


@dataclass(frozen=True)
class ObjectKind:
    """One cache object kind, declared once: its documentation (what `kvcheck spec` prints)
    and every per-kind rule the spec, the funnel, the explorers' coverage and the engines
    derive from it. Blocks are logical blocks; a resume at k means at token L = k * B."""

    name: str
    layers: str
    states: tuple[str, ...]
    recovery_condition: str
    hit_validation: str
    eviction: str
    cost_of_loss: str
    device: bool = True                  # held in a device pool (on_disk is a copy of a block)
    fresh: int = READY                   # the state a write leaves it in (WRITING: finished later)
    finished_by: str | None = None       # the action that takes it from WRITING to READY
    version: str = "cur_ver"             # the global version it is stamped with ...
    header: str = "dver"                 # ... and where a disk copy's header records it
    version_reason: str = "model_version"    # funnel layer 2's reason when its stamp is stale
    missing_reason: str = ""             # funnel layer 3's reason when it is not ready
    windowed: bool = False               # a holder keeps only a window of it (released as it slides)
    # geometry: does block j of group g carry one (cfg, g, j) -> bool; which blocks a resume
    # at k reads (cfg, g, k) -> [j]; does a holder resumed at pos with SWA pins from win keep
    # block j (L, j, win, pos, finite_window) -> bool | term
    carried: Callable[[Any, Any, int], bool] = lambda cfg, g, j: True
    needed: Callable[[Any, Any, int], list[int]] = lambda cfg, g, k: []
    held: Callable[[Any, int, Any, Any, bool], Any] = lambda L, j, win, pos, finite: j < pos

    def reachable_states(self) -> tuple[str, ...]:
        """The lifecycle states a run can reach after the initial one (coverage targets)."""
        if not self.device:
            return self.states[1:]
        return tuple(s for s in self.states[1:] if s != "writing" or self.fresh == WRITING)


def _entry_blocks(cfg: Any, g: Any, k: int) -> list[int]:
    return [j for j in range(k) if cfg.has_compressed(g, j)]


def _swa_held(L: Any, j: int, win: Any, pos: Any, finite: bool) -> Any:
    return L.And(win <= j, j < pos) if finite else j < pos


OBJECTS: tuple[ObjectKind, ...] = (
    ObjectKind(
        "compressed_kv", "compressed layers (csa, hca)", DEVICE_STATES,
        "one entry per complete compression block w < L//m, ready (not evicted, not still "
        "compressing), written by the current model/compressor version",
        "entries of every block before k present, version == current, ABI == current",
        "conservative: evicted last; only when unpinned and not graph-captured",
        "the layer cannot continue; recomputing costs the whole prefix",
        fresh=WRITING, finished_by="compress", version="cur_cmp", header="dcmp",
        missing_reason="compressed_missing",
        carried=lambda cfg, g, j: cfg.has_compressed(g, j), needed=_entry_blocks),
    ObjectKind(
        "tail", "compressed layers (csa, hca)", DEVICE_STATES,
        "raw KV and gate of tokens [m*(L//m), L), contiguous, junction with the last entry "
        "exact: the snapshot taken at exactly L",
        "the tail snapshot of the block ending at L present and current (not an older one)",
        "fast: any tail not at a request's current position may go",
        "a single missing page makes it unusable; no approximate splice",
        missing_reason="tail_missing",
        carried=lambda cfg, g, j: cfg.needs_tail(g, j),
        needed=lambda cfg, g, k: [k - 1] if k >= 1 and cfg.needs_tail(g, k - 1) else [],
        held=lambda L, j, win, pos, finite: pos == j + 1),
    ObjectKind(
        "swa_window", "swa layers, the SWA branch of csa/hca, full layers (W = infinity)",
        DEVICE_STATES,
        "raw KV for positions [max(0, L-W+1), L): every page of the window present",
        "every page from block (L-W+1)//B to k-1 present, current, aligned",
        "pages outside every retained window first",
        "attention reads the wrong history range",
        missing_reason="window_incomplete", windowed=True,
        needed=lambda cfg, g, k: list(range(cfg.window_lo_block(g.window, k), k)),
        held=_swa_held),
    ObjectKind(
        "indexer", "sparse (csa) layers", DEVICE_STATES,
        "indexer keys for the same entries as the compressed KV, same indexer version, "
        "synced (not lagging the KV)",
        "indexer keys of every block before k ready (synced) and of the current indexer version",
        "with its compressed entries",
        "sparse layers select the wrong entries; quality drops silently",
        fresh=WRITING, finished_by="indexer_sync", version="cur_ix", header="dix",
        version_reason="indexer_version", missing_reason="indexer_lagging",
        carried=lambda cfg, g, j: cfg.has_compressed(g, j), needed=_entry_blocks),
    ObjectKind(
        "on_disk", "any layer (offloaded copy of a whole block)", DISK_STATES,
        "the offloaded copy is durable (write-back acknowledged), loaded back, checksum and "
        "header verified, readiness acknowledged: 'registered' is not 'ready'",
        "a block whose device objects are missing is never a hit while its copy is in flight; "
        "it is PREFETCH",
        "quarantined on checksum/header failure; overwritten by a new offload",
        "a registered-but-not-ready copy served as a hit reads placeholder data",
        device=False, version="", header="", version_reason="", missing_reason="on_disk_not_ready"),
)
# Objects the spec's state machine does not model (yet) but whose recovery rule it declares, so
# adapters of engines that keep them judge a hit by the same `needed_objects` as every other
# kind. A recurrent layer (Mamba / Mamba2 SSM, gated DeltaNet and other linear attention) keeps
# one fixed-size state per request instead of per-token KV: a resume at k reads the state after
# exactly k blocks, and no older state helps (there is nothing to replay it from).
RECURRENT_STATE = ObjectKind(
    "recurrent_state", "recurrent layers (Mamba SSM, gated DeltaNet / linear attention)", DEVICE_STATES,
    "the recurrent state after exactly L tokens: the one snapshot at the resume boundary, "
    "nothing older (a state is not a window: earlier snapshots cannot be extended to L)",
    "the state snapshot of the block ending at k (block k-1) present and current",
    "any snapshot not at a retained boundary or a request's current position may go",
    "the layer cannot resume; recomputing costs the whole prefix",
    needed=lambda cfg, g, k: [k - 1] if k >= 1 else [],
    held=lambda L, j, win, pos, finite: pos == j + 1)
ENGINE_OBJECTS: tuple[ObjectKind, ...] = (RECURRENT_STATE,)
KIND: dict[str, ObjectKind] = {o.name: o for o in OBJECTS + ENGINE_OBJECTS}
OBJECT_KINDS = tuple(o.name for o in OBJECTS)     # the kinds the spec models
DEVICE_KINDS = tuple(o.name for o in OBJECTS if o.device)
assert all(o.missing_reason in REASON_BIT for o in OBJECTS)
assert all(o.version_reason in REASON_BIT for o in OBJECTS if o.device)

# ---- physical pools: one per device object kind (five-state routing by structure) ------
POOL = {kind: i for i, kind in enumerate(DEVICE_KINDS)}


def state_name(kind: str, value: int) -> str:
    """The lifecycle state `value` of an object of `kind`, by name (the number if out of range)."""
    names = KIND[kind].states
    return names[value] if 0 <= value < len(names) else str(value)
