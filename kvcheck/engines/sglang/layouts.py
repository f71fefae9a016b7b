"""SGLang layouts (a cache class with its components, page size and window), the planted
faults and their expected checks, and the spec Config a layout's traces carry.

A layout names what the adapter builds; `--layout-file` takes a user's own in the same shape
(JSON: name, class, components, page_size, window, capacity). A layout whose class the
installed release lacks is refused with one line (exit 2), never a traceback.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcheck.spec.config import Config
from kvcheck.spec.faults import Fault

from .install import CLASSES, LayoutError, SglangUnavailable, load  # noqa: F401 (LayoutError: the engine's)

# The adapter's vocabulary (the trace's action names). `chunk(r, n)`: the scheduler path
# (sched.py) — n more prompt tokens prefilled, then SGLang's own cache_unfinished_req /
# checkpoint; a request admitted by it is finished and aborted by SGLang's own release.
ACTIONS = ("submit", "match", "chunk", "decode", "finish", "abort", "evict")
VOCAB = 6              # a small vocabulary: prompts share prefixes often
MAX_TOKENS = 40


DRIVEN = ("RadixCache", "PureSWARadixCache", "SWARadixCache", "MambaRadixCache", "HiRadixCache",
          "UnifiedRadixCache", "ChunkCache")
# classes whose components are fixed (the others take [full] or [swa]; UnifiedRadixCache: below)
CLASS_COMPONENTS = {"SWARadixCache": ("full", "swa"), "MambaRadixCache": ("full", "mamba"),
                    "ChunkCache": ("full",)}
UNIFIED_COMPONENTS = (("full",), ("full", "swa"), ("full", "mamba"))
TREE_CORES = ("python", "rust", "lockstep")   # UnifiedRadixCache: which tree core(s); lockstep = both


@dataclass(frozen=True)
class Layout:
    name: str
    cls: str                       # the SGLang cache class
    components: tuple[str, ...]    # full | swa (what a hit must keep live)
    page_size: int = 1
    window: int | None = None      # the sliding window, for swa components
    capacity: int = 64             # token slots of the KV pool
    doc: str = ""
    tree_core: str | None = None   # UnifiedRadixCache only: python | rust | lockstep (python + rust)
    drive: str = "cache"           # cache: kvcheck calls the cache; sched: SGLang's own Scheduler (scheduler/)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["class"] = d.pop("cls")
        d["components"] = list(self.components)
        if d["tree_core"] is None:
            d.pop("tree_core")
        if d["drive"] == "cache":
            d.pop("drive")
        return d


LAYOUTS: dict[str, Layout] = {x.name: x for x in (
    Layout("radix", "RadixCache", ("full",), 1, None, 48,
           "RadixCache, full attention, page 1, TokenToKVPoolAllocator"),
    Layout("radix-page4", "RadixCache", ("full",), 4, None, 64,
           "RadixCache, full attention, page 4, PagedTokenToKVPoolAllocator"),
    Layout("pure_swa", "PureSWARadixCache", ("swa",), 1, 6, 48,
           "PureSWARadixCache, every layer SWA (W=6): decode frees what leaves the window, "
           "only the prefill part [0, evict floor) is cached"),
    Layout("swa", "SWARadixCache", ("full", "swa"), 1, 4, 48,
           "SWARadixCache, full + SWA (W=4) with tombstones, SWAKVPool + SWATokenToKVPoolAllocator"),
    Layout("hicache", "HiRadixCache", ("full",), 1, None, 32,
           "HiRadixCache, write-through to a host tier (2x), device eviction, load-back; CPU stand-ins "
           "for streams/events, the direct transfer kernel and host registration"),
    Layout("mamba", "MambaRadixCache", ("full", "mamba"), 1, None, 48,
           "MambaRadixCache, full attention + Mamba state at some nodes (max(12, capacity/6) state slots), "
           "HybridReqToTokenPool + HybridLinearKVPool"),
    # UnifiedRadixCache (sglang_unified*.py): components FULL or FULL+SWA, on the Python tree core,
    # or the Python and Rust cores in lockstep (a differential; TreeCore releases only)
    Layout("unified-full", "UnifiedRadixCache", ("full",), 1, None, 48,
           "UnifiedRadixCache, FULL, page 1, Python tree", "python"),
    Layout("unified-full-page4", "UnifiedRadixCache", ("full",), 4, None, 64,
           "UnifiedRadixCache, FULL, page 4, Python tree", "python"),
    Layout("unified-swa", "UnifiedRadixCache", ("full", "swa"), 1, 4, 96,
           "UnifiedRadixCache, FULL+SWA (W=4) with tombstones, Python tree", "python"),
    Layout("unified-full-lockstep", "UnifiedRadixCache", ("full",), 1, None, 48,
           "UnifiedRadixCache, FULL, the Python and Rust tree cores in lockstep", "lockstep"),
    Layout("unified-full-page4-lockstep", "UnifiedRadixCache", ("full",), 4, None, 64,
           "UnifiedRadixCache, FULL, page 4, Python and Rust tree cores in lockstep", "lockstep"),
    Layout("unified-swa-lockstep", "UnifiedRadixCache", ("full", "swa"), 1, 4, 96,
           "UnifiedRadixCache, FULL+SWA (W=4), Python and Rust tree cores in lockstep", "lockstep"),
    # FULL+MAMBA (unified_mamba.py): HybridReqToTokenPool + HybridLinearKVPool, cow_mamba matches
    Layout("unified-mamba", "UnifiedRadixCache", ("full", "mamba"), 1, None, 48,
           "UnifiedRadixCache, FULL+MAMBA (capacity/6 state slots), Python tree, HybridReqToTokenPool + "
           "HybridLinearKVPool", "python"),
    Layout("unified-mamba-lockstep", "UnifiedRadixCache", ("full", "mamba"), 1, None, 48,
           "UnifiedRadixCache, FULL+MAMBA, the Python and Rust tree cores in lockstep", "lockstep"),
    # ChunkCache (chunk.py): prefix caching off; chunked prefill through cache_unfinished_req
    Layout("chunk", "ChunkCache", ("full",), 1, None, 48,
           "ChunkCache (prefix caching disabled), chunked prefill (cache_unfinished_req), ReqToTokenPool + "
           "TokenToKVPoolAllocator"),
    # SGLang's own Scheduler on CPU (scheduler/): admission, chunking, retraction and the cache calls are its
    # own, over the tree its server builds for the model (UnifiedRadixCache on 0.5.16+, Python tree core)
    Layout("dense@sched", "UnifiedRadixCache", ("full",), 1, None, 256,
           "a full-attention model under SGLang's own Scheduler (page 1): requests, batches, chunked prefill, "
           "retraction", drive="sched"),
    Layout("dense-page16@sched", "UnifiedRadixCache", ("full",), 16, None, 1024,
           "a full-attention model under SGLang's own Scheduler, page 16 (paged attention backends)", drive="sched"),
    Layout("hybrid-swa@sched", "UnifiedRadixCache", ("full", "swa"), 1, 32, 256,
           "a hybrid full + sliding-window model (W = 32) under SGLang's own Scheduler: SWA pool, tombstones, "
           "window eviction as the server runs them", drive="sched"),
    Layout("gpt-oss@sched", "UnifiedRadixCache", ("full", "swa"), 1, 128, 4096,
           "gpt-oss's attention at its real window (128, alternating full and sliding layers) under SGLang's own "
           "Scheduler: chunks of 1/4 to 64 windows (SGLang's default 8192), pools of up to 4 chunks", drive="sched"),
    Layout("gemma3@sched", "UnifiedRadixCache", ("full", "swa"), 1, 1024, 16384,
           "Gemma 3's attention at its real window (1024; five sliding layers to one global) under SGLang's own "
           "Scheduler: chunks of 1/4 to 16 windows (SGLang's 8192-16384), pools of up to 4 chunks", drive="sched"),
    Layout("pure-swa@sched", "PureSWARadixCache", ("swa",), 1, 128, 4096,
           "an all-sliding-window model (every layer W = 128), served prefill-aware as SGLang serves its one such "
           "model (UnlimitedOCR), under SGLang's own Scheduler: PureSWARadixCache over one SWA pool, window "
           "eviction during decode (0.5.15+)", drive="sched"),
    Layout("nocache@sched", "ChunkCache", ("full",), 1, None, 256,
           "a full-attention model served with --disable-radix-cache under SGLang's own Scheduler (ChunkCache up "
           "to 0.5.21, a disabled UnifiedRadixCache from 0.5.22): chunked prefill and retraction with nothing cached",
           drive="sched"),
)}


def layout_from(d: dict[str, Any], where: str) -> Layout:
    try:
        comps = tuple(d.get("components") or ("full",))
        lay = Layout(str(d["name"]), str(d["class"]), comps, int(d.get("page_size", 1)),
                     None if d.get("window") is None else int(d["window"]), int(d.get("capacity", 64)),
                     str(d.get("doc", "")), None if d.get("tree_core") is None else str(d["tree_core"]),
                     str(d.get("drive", "cache")))
    except (KeyError, TypeError, ValueError) as e:
        raise LayoutError(f"{where}: a layout needs name, class (and optional components, "
                          f"page_size, window, capacity): {e}") from None
    if lay.drive not in ("cache", "sched"):
        raise LayoutError(f"{where}: drive must be cache or sched, got {lay.drive!r}")
    if lay.cls not in DRIVEN:
        raise LayoutError(f"{where}: class {lay.cls!r} is not driven by this adapter yet "
                          f"({', '.join(DRIVEN)})")
    if lay.cls == "UnifiedRadixCache":
        if comps not in UNIFIED_COMPONENTS:
            raise LayoutError(f"{where}: UnifiedRadixCache is driven with components [full], [full, swa] or "
                              f"[full, mamba], got {list(comps)}")
        if "mamba" in comps and lay.page_size != 1:
            raise LayoutError(f"{where}: UnifiedRadixCache FULL+MAMBA takes page_size 1 (no Mamba extra buffer)")
        if (lay.tree_core or "python") not in TREE_CORES:
            raise LayoutError(f"{where}: tree_core must be one of {', '.join(TREE_CORES)}, got {lay.tree_core!r}")
        lay = Layout(**{**asdict(lay), "tree_core": lay.tree_core or "python"})
    elif lay.tree_core is not None:
        raise LayoutError(f"{where}: tree_core is a UnifiedRadixCache field")
    else:
        fixed = CLASS_COMPONENTS.get(lay.cls)
        if fixed is not None and comps != fixed:
            raise LayoutError(f"{where}: {lay.cls} takes components {list(fixed)}")
        if fixed is None and comps not in (("full",), ("swa",)):
            raise LayoutError(f"{where}: {lay.cls} takes components [full] or [swa], got {list(comps)}")
    if "swa" in comps and not lay.window:
        raise LayoutError(f"{where}: an swa component needs a window")
    if lay.cls == "ChunkCache" and lay.page_size != 1:
        raise LayoutError(f"{where}: ChunkCache is driven with page_size 1")
    if lay.page_size < 1 or lay.capacity < 4 * lay.page_size:
        raise LayoutError(f"{where}: page_size >= 1 and capacity >= 4 pages")
    return lay


def load_layout_file(path: str) -> Layout:
    """A user's own layout from a JSON file."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise LayoutError(f"--layout-file {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise LayoutError(f"--layout-file {path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(d, dict):
        raise LayoutError(f"--layout-file {path}: must be a JSON object")
    return layout_from(d, f"--layout-file {path}")


def get_layout(name: str | Layout) -> Layout:
    if isinstance(name, Layout):
        return name
    if name not in LAYOUTS:
        raise LayoutError(f"unknown SGLang layout {name!r}; known: {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


def check_supported(lay: Layout) -> None:
    """One line when the installed release lacks the layout's class (SglangUnavailable)."""
    from .install import cache_class
    if lay.drive != "sched":        # a sched layout runs the tree the release's server builds (scheduler/build.py)
        cache_class(lay.cls)
    why = _api_gap(lay)
    if why:
        raise SglangUnavailable(why)


def _api_gap(lay: Layout) -> str | None:
    """Why the adapter cannot drive this class at the installed release, if it cannot."""
    if lay.drive == "sched":
        from .scheduler.build import gap
        from .scheduler.config import model_gap
        return gap(lay.page_size) or model_gap(lay)
    if lay.cls == "UnifiedRadixCache" and "mamba" in lay.components:
        from .compat import component_types
        if not hasattr(component_types(), "MAMBA"):
            return f"sglang {load()['version']}: UnifiedRadixCache has no MAMBA tree component"
    if lay.cls == "UnifiedRadixCache" and lay.tree_core in ("rust", "lockstep"):
        from .compat import rust_core_gap
        return rust_core_gap()
    return None


def list_layouts() -> list[dict[str, Any]]:
    """Every layout with whether the installed release has its class, plus the classes the
    release has that no layout drives yet (listed so a user sees what is not covered)."""
    try:
        found = load()["classes"]
    except SglangUnavailable as e:
        return [dict(x.to_dict(), supported=False, reason=str(e)) for x in LAYOUTS.values()]
    out = []
    for x in LAYOUTS.values():
        c = found.get(x.cls) if x.drive != "sched" else type   # sched: the tree its server builds
        gap = _api_gap(x) if isinstance(c, type) else None
        ok = isinstance(c, type) and gap is None
        out.append(dict(x.to_dict(), supported=ok,
                        reason=None if ok else (gap or (str(c) if c else f"this release has no {x.cls}"))))
    driven = {x.cls for x in LAYOUTS.values()}
    for cls in CLASSES:
        if cls in found and cls not in driven:
            out.append({"name": None, "class": cls, "supported": False,
                        "reason": "present in this release; not driven by the adapter yet"})
    return out


def layout_config(lay: Layout) -> Config:
    """The spec Config a layout's traces carry (block = the page)."""
    try:
        return Config(block_size=lay.page_size)
    except Exception:       # a page size the spec's config does not take
        return Config()


# ---- planted faults (a thin wrapper around SGLang's classes; nothing in SGLang is edited) ----
def _fault(name: str, site: str, bug_class: str, mirrors: str, expected: str, doc: str) -> Fault:
    return Fault(name, "sglang", site, bug_class, mirrors, expected, doc, ("sglang",))


SGLANG_FAULTS = (
    _fault("lock_ref_leak", "dec_lock_ref", "lock references out of balance",
           "SGLang radix lock_ref never returning to 0 (nodes unevictable forever)",
           "lock_ref_equals_holders",
           "After a release, the locked node keeps one reference nobody holds."),
    _fault("match_overreach", "match_prefix", "a match crossing positions that are not live",
           "SWA/tombstone match that serves more than the live window behind the hit",
           "hit_sound", "match_prefix reports one page more than the path it returns holds, "
           "with the request's first unmatched slots standing in for it."),
    _fault("match_ignores_tombstones", "match_prefix", "a match crossing a tombstone",
           "SWARadixCache match without enough live window behind the hit (match_len_since_tombstone, "
           "sgl-project/sglang#17061)", "hit_sound_swa_window",
           "match_prefix accepts a hit with one live SWA token behind the last tombstone (window 1)."),
    _fault("evict_locked", "evict", "eviction of a locked node",
           "SGLang radix evicting a node a running request holds", "no_evict_locked",
           "evict also frees the deepest locked leaf."),
    _fault("drop_insert", "insert", "state dropped on insert",
           "cache_finished_req not inserting (or freeing) a finished request's KV",
           "lost_reuse",
           "Every other insert of new tokens is declined: the new slots are freed, nothing cached."),
    _fault("insert_shifted_values", "insert", "a slot holding other tokens than its key",
           "values misaligned with keys after a split or page truncation", "tree_content_matches",
           "insert stores the values shifted by one position."),
    _fault("evict_no_free", "evict", "size accounting",
           "evicted nodes whose KV slots are never returned to the allocator",
           "size_accounting", "evict deletes nodes without freeing their slots."),
    _fault("unfinished_lock_not_moved", "cache_unfinished_req", "lock references out of balance",
           "cache_unfinished_req / checkpoint re-inserting a chunk but leaving the request's lock on its old "
           "node (the new last node unlocked, evictable under the running request)",
           "lock_ref_equals_holders",
           "After SGLang publishes a chunk, the lock goes back to the old node; the request names the new one."),
    _fault("core_drops_insert", "insert", "two tree cores disagreeing",
           "UnifiedRadixCache's Rust tree core diverging from the Python one on the same operations",
           "tree_core_differential",
           "On the Rust core of a lockstep layout, every third insert is declined (its new slots freed)."),
)
SGLANG_FAULTS += (
    _fault("mamba_hit_without_state", "match_prefix", "a resume without the recurrent state it needs",
           "MambaRadixCache match returning a node past the last one holding Mamba state (a tombstone)",
           "hit_sound_mamba_state", "match_prefix returns the deepest matched node, state or not."),
    _fault("mamba_state_freed_on_insert", "insert", "state dropped on insert",
           "the caller freeing the request's Mamba slot although the tree took it (mamba_exist misread)",
           "tree_slots_live", "After an insert that kept the request's state slot, the caller frees it."),
    _fault("load_back_before_copy", "init_load_back", "load-back served before the copy exists",
           "HiCache serving a host hit before the load stream's event (layer_done_counter) completed",
           "load_back_verified", "The hit is served without waiting for the load-back transfer."),
    _fault("write_through_ack_early", "write_backup", "write-back acknowledged before the copy exists",
           "HiCache releasing ongoing_write_through before the write stream's finish event",
           "write_through_acknowledged", "A write-through is acknowledged (unlocked) as soon as it is queued."),
)
SGLANG_FAULTS += (    # UnifiedRadixCache FULL+MAMBA (unified_mamba.py) and ChunkCache (chunk.py)
    _fault("mamba_state_dropped_on_insert", "insert", "state dropped on insert",
           "UnifiedRadixCache's Mamba component not attaching a finished request's state to a tombstoned node "
           "(reporting mamba_exist, so the caller frees it)", "lost_reuse",
           "An insert ending at a node whose Mamba state was evicted keeps the tombstone and reports the state "
           "as already there."),
    _fault("mamba_lock_leak", "dec_lock_ref", "lock references out of balance",
           "a released request's mamba lock left on its hit node (its state never evictable again)",
           "lock_ref_equals_holders", "After a release, the hit node keeps one mamba reference nobody holds."),
    _fault("mamba_evict_locked_state", "evict", "eviction of a locked node",
           "a Mamba state tombstoned while a running request holds its node's mamba lock",
           "no_evict_locked", "evict also frees the state of the deepest mamba-locked node (a tombstone under the lock)."),
    _fault("mamba_state_leaked_on_abort", "abort", "size accounting",
           "an aborted request's Mamba state slot never returned to the pool",
           "size_accounting", "Aborting a running request frees its KV but not its state slot."),
    _fault("chunk_reports_hit", "match_prefix", "a hit from a cache that keeps nothing",
           "ChunkCache (prefix caching off) answering a match with another request's KV slots",
           "disabled_cache_no_hit", "match_prefix returns the slots of the last request admitted as a hit."),
    _fault("chunk_frees_unfinished", "cache_unfinished_req", "KV freed under a running request",
           "cache_unfinished_req freeing a chunked request's KV as cache_finished_req does",
           "request_kv_intact", "cache_unfinished_req frees the chunk's KV slots it hands back as prefix_indices."),
    _fault("chunk_double_free", "cache_finished_req", "a slot freed twice",
           "a finished request's KV returned to the allocator twice (cache_finished_req and the scheduler's "
           "overallocation free both)", "kv_freed_once",
           "cache_finished_req frees the request's last committed slot a second time."),
    _fault("chunk_finish_leaks", "cache_finished_req", "size accounting",
           "a finished request's KV never returned to the allocator (committed length short by one)",
           "size_accounting", "cache_finished_req frees all but the request's last committed slot."),
)
FAULTS = {f.name: f for f in SGLANG_FAULTS}
# faults that only some classes can express (the rest apply to every driven class)
FAULT_CLASSES = {"match_ignores_tombstones": ("SWARadixCache", "UnifiedRadixCache"),
                 "core_drops_insert": ("UnifiedRadixCache",),
                 "mamba_hit_without_state": ("MambaRadixCache", "UnifiedRadixCache"),
                 "mamba_state_freed_on_insert": ("MambaRadixCache", "UnifiedRadixCache"),
                 "mamba_state_dropped_on_insert": ("UnifiedRadixCache",), "mamba_lock_leak": ("UnifiedRadixCache",),
                 "mamba_evict_locked_state": ("UnifiedRadixCache",),
                 "mamba_state_leaked_on_abort": ("UnifiedRadixCache",),
                 "chunk_reports_hit": ("ChunkCache",), "chunk_frees_unfinished": ("ChunkCache",),
                 "chunk_double_free": ("ChunkCache",), "chunk_finish_leaks": ("ChunkCache",),
                 "load_back_before_copy": ("HiRadixCache",), "write_through_ack_early": ("HiRadixCache",)}



# Real SGLang behaviour the campaigns found (docs/findings-sglang.md): (class, components) ->
# (the check that fires, the releases measured with it, the upstream fix). A clean-run test
# accepts exactly this finding on exactly these releases.
# (class, components) -> (check, (first, last) release range inclusive, upstream). SWARadixCache:
# reproduced on every release from 0.4.10 to 0.5.14 by the release matrix (docs/matrix-sglang.md);
# 0.5.15 ran clean there (3,000 steps), so the range ends at 0.5.14.
KNOWN_FINDINGS = {
    ("UnifiedRadixCache", ("full", "swa")): ("no_evict_locked", ("0.5.11", "0.5.14"), "sgl-project/sglang#29352"),
    ("SWARadixCache", ("full", "swa")): ("no_evict_locked", ("0.4.10", "0.5.14"), "sgl-project/sglang#29352"),
}


def known_finding(lay: Layout, version: str | None) -> str | None:
    """The check a known SGLang bug of this release makes fire on this layout, if any."""
    from kvcheck.fuzz.known import KnownDefect
    k = KNOWN_FINDINGS.get((lay.cls, lay.components))
    if not k:
        return None
    return k[0] if KnownDefect("", k[0], "", k[1][0], k[1][1], k[2]).in_release(version) else None


# the faults a ChunkCache layout takes besides its own (the rest need a tree)
CHUNK_GENERIC = ("lock_ref_leak", "evict_locked")


def fault_refusal(fault: str, lay: Layout) -> str:
    """One line: why `fault` cannot be planted on `lay`."""
    if fault in FAULT_CLASSES and lay.cls not in FAULT_CLASSES[fault]:
        return f"fault {fault!r} needs a layout of class {', '.join(FAULT_CLASSES[fault])}"
    return f"fault {fault!r} does not apply to layout {lay.name} ({lay.cls} {'+'.join(lay.components)}" \
           + (f", {lay.tree_core} tree core)" if lay.tree_core else ")")


def fault_applies(fault: str, lay: Layout) -> bool:
    if lay.drive == "sched":
        from .scheduler.faults import plantable
        return fault in plantable(lay)
    if lay.cls == "ChunkCache":
        return fault in CHUNK_GENERIC or lay.cls in FAULT_CLASSES.get(fault, ())
    if fault.startswith("mamba_") and lay.cls == "UnifiedRadixCache" and "mamba" not in lay.components:
        return False            # needs Mamba state
    if fault in ("mamba_hit_without_state", "mamba_state_dropped_on_insert", "mamba_lock_leak",
                 "mamba_evict_locked_state") and lay.tree_core == "rust":
        return False            # these read or wrap Python tree nodes / components
    if fault == "mamba_state_dropped_on_insert" and lay.tree_core == "lockstep":
        return False            # one core's insert result would differ first (tree_core_differential)
    if fault == "match_ignores_tombstones" and lay.components != ("full", "swa"):
        return False            # needs tombstones: full + SWA
    if fault == "match_ignores_tombstones" and lay.tree_core == "lockstep":
        return False            # the Rust core takes its window at construction: planted on the Python core
        #                         alone, the fault shows first as the cores' differential, not the window check
    if fault == "core_drops_insert" and lay.tree_core != "lockstep":
        return False            # needs a second tree core to differ from
    if fault in ("lock_ref_leak", "evict_locked") and lay.tree_core == "rust":
        return False            # these wrappers edit tree nodes, which the Rust core does not expose
    return lay.cls in FAULT_CLASSES.get(fault, (lay.cls,))
