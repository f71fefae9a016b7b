"""The fault library: named, planted bugs that each check must catch, declared as patches.

Owns the `Fault` record, the spec's own faults, the `Planted` probe through which a patch site
asks "is my fault planted?", and the `Registry` that collects faults from explicit providers
(spec, reference engine, vLLM, transformers, SGLang; fuzz/faults.py lists them). A fault names the site
it patches (an action of the spec's table, a funnel layer, an engine method) and the check that
must catch it; it counts as caught only when a run fails with that `expected` check. Sites ask
with the fault's constant, never its name as a string, so a typo is a NameError; a spec built
with a fault that no site asked for plants nothing and is refused (FaultError).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable


class UnknownFault(KeyError):
    def __init__(self, name: str, hint: str = "") -> None:
        super().__init__(name)
        self.hint = hint

    def __str__(self) -> str:
        return self.hint or f"unknown fault {self.args[0]!r}; `kvcheck faults` lists the known ones"


class FaultError(ValueError):
    """A fault that cannot be planted where it was asked for (exit code 2)."""


@dataclass(frozen=True)
class Fault:
    name: str
    provider: str       # who declares it: spec | reference | vllm | transformers | sglang
    site: str           # what it patches: action:NAME, funnel:layerN, or the engine's own method
    bug_class: str
    mirrors: str        # the public bug class / design it reproduces, where there is one
    expected: str       # the invariant or check that must catch it
    doc: str
    suts: tuple[str, ...] = field(default=())     # --sut values that can plant it
    # config keys of the configurable semantic the fault lives in (it plants nothing without)
    needs: tuple[tuple[str, Any], ...] = field(default=())

    @property
    def layer(self) -> str:
        """spec | engine: where the fault lives (the spec itself, or a system under test)."""
        return "spec" if self.provider == "spec" else "engine"

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["layer"] = self.layer
        d["suts"] = list(self.suts)
        d["needs"] = {k: _jsonable(v) for k, v in self.needs}
        return d

    def config_for(self, cfg: Any) -> Any:
        """cfg with the semantic this fault needs switched on (cfg itself when it needs none)."""
        if not self.needs:
            return cfg
        from dataclasses import replace
        return replace(cfg, **dict(self.needs))


def _jsonable(v: Any) -> Any:
    """A config value as JSON (a layer as its config-file object)."""
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if hasattr(v, "__dataclass_fields__"):
        return {k: x for k, x in asdict(v).items() if x is not None}
    return v


class Planted:
    """The fault a spec or engine runs with. A patch site calls `planted(F)` with its own
    fault's constant; the asks are recorded so that a fault no site asked for is detected."""

    __slots__ = ("fault", "asked")

    def __init__(self, fault: Fault | None = None) -> None:
        self.fault = fault
        self.asked: set[str] = set()

    def __call__(self, f: Fault) -> bool:
        self.asked.add(f.name)
        return self.fault is not None and self.fault.name == f.name

    @property
    def name(self) -> str | None:
        return None if self.fault is None else self.fault.name


def _spec(name: str, site: str, bug_class: str, mirrors: str, expected: str, doc: str,
          needs: tuple[tuple[str, Any], ...] = ()) -> Fault:
    return Fault(name, "spec", site, bug_class, mirrors, expected, doc, ("spec",), needs)


# The content faults need two prompts (the device tier keeps the state small); their symptom needs a block
# recomputed under another prompt and then hit, which a random walk reaches quickly over one
# full-attention group (the hash-chain block manager of a plain transformer) and 2 blocks.
def _small(*keys: tuple[str, Any]) -> tuple[tuple[str, Any], ...]:
    from .config import LayerSpec
    return (*keys, ("tiers", ("device",)), ("layers", (LayerSpec("full"),)), ("blocks", 2))


_PROMPTS = _small(("prompts", 2))



def _full(*keys: tuple[str, Any]) -> tuple[tuple[str, Any], ...]:
    """One full-attention group and `keys` (later keys win: `Fault.config_for`)."""
    from .config import LayerSpec
    return (("layers", (LayerSpec("full"),)), *keys)


def _one_window(*keys: tuple[str, Any]) -> tuple[tuple[str, Any], ...]:
    """One sliding-window group (W=2 over blocks of 2 tokens: block 0 leaves the window at
    position 2, and another prompt may rewrite its slot while the request runs) and `keys`."""
    from .config import LayerSpec
    return (("layers", (LayerSpec("swa", window=2),)), ("block_size", 2), ("blocks", 2),
            ("tiers", ("device",)), ("capacity", {"swa_window": 3}), *keys)


def _two_windows(*keys: tuple[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Two sliding-window groups of different windows (W=2 and W=4 over blocks of 2 tokens:
    the narrow window moves first, at position 2, the wide one at 3) and `keys`."""
    from .config import LayerSpec
    return (("layers", (LayerSpec("swa", window=2), LayerSpec("swa", window=4))), ("block_size", 2),
            ("blocks", 3), ("tiers", ("device",)), ("capacity", {"swa_window": 6}), *keys)


DECISION_IGNORES_INDEXER_VERSION = _spec(
    "decision_ignores_indexer_version", "funnel:layer2", "indexer stale after restore",
    "DeepSeek-V3.2 sparse indexer state restored with another version (SGLang/vLLM "
    "indexer cache discussions)", "hit_sound_indexer",
    "Funnel layer 2 does not compare the indexer keys' version with the current indexer.")
WINDOW_OFF_BY_ONE = _spec(
    "window_off_by_one", "funnel:layer3", "window not covering needed positions",
    "vLLM sliding-window hit that skips the first page of the window (null-block "
    "accounting at the window edge)", "hit_sound_swa_window",
    "The funnel checks SWA pages [lo+1, k) instead of [lo, k): the window's first page is unchecked.")
TAIL_JUNCTION_NOT_CHECKED = _spec(
    "tail_junction_not_checked", "funnel:layer3", "tail dropped / wrong tail",
    "DeepSeek-V4 compressed layers resuming inside a compression block", "hit_sound_tail",
    "The funnel accepts the oldest tail snapshot of the current compression block instead "
    "of the one taken exactly at the hit point.")
PREFETCH_COUNTED_AS_HIT = _spec(
    "prefetch_counted_as_hit", "funnel:layer3", "offload marked ready before the copy completes",
    "LMCache / SGLang HiCache: 'registered' treated as 'ready' before the load acknowledgement",
    "hit_sound_on_disk",
    "Layer 3 treats objects whose on-disk copy is still loading or unverified as present.")
EVICTION_IGNORES_PINS = _spec(
    "eviction_ignores_pins", "action:evict", "hit evicted between lookup and pin",
    "vLLM/SGLang prefix hit evicted before the request pinned it", "toctou_bound_stable",
    "Eviction does not check reference counts or graph pins.")
COMPRESSED_VERSION_IGNORED = _spec(
    "compressed_version_ignored", "funnel:layer2", "layout or version change not invalidating a cache",
    "persisted compressed KV reused after a weight/quantization update", "hit_sound_compressed_kv",
    "Layer 2 does not compare compressed entries' version with the current compressor.")
ABI_IGNORED = _spec(
    "abi_ignored", "funnel:layer2", "layout or version change not invalidating a cache",
    "kernel ABI / page layout change not invalidating stored pages", "hit_sound_layout",
    "Layer 2 does not compare the objects' ABI/layout fingerprint.")
NO_REVALIDATION_AT_USE = _spec(
    "no_revalidation_at_use", "action:use", "TOCTOU: lease not re-validated at use",
    "state_data_ptrs / version re-check skipped before reading", "toctou_bound_stable",
    "`use` runs a bound request without re-validating its lease versions.")
REFCOUNT_DOUBLE_DECREMENT = _spec(
    "refcount_double_decrement", "action:finish", "refcount imbalance",
    "vLLM block pool ref_cnt going negative on double free", "refcount_equals_holders",
    "`finish` releases the tail snapshot's pin twice.")
ADMISSION_IGNORED = _spec(
    "admission_ignored", "action:append", "admission cap ignored",
    "cache growth crowding out new requests (OOM)", "admission_cap",
    "`append` allocates without checking the pool's capacity.")
SHARED_FREE_LIST = _spec(
    "shared_free_list", "action:append", "groups aliasing memory",
    "hybrid groups drawing pages from one free list", "five_state_routing",
    "`append` draws SWA pages from the tail pool.")
GRAPH_PAGES_MIGRATED = _spec(
    "graph_pages_migrated", "action:migrate", "CUDA-graph replay of stale tables",
    "compaction moving pages referenced by a captured CUDA graph", "graph_topology",
    "Compaction moves pages that a captured graph references.")
# Faults only a configurable semantic can express (each plants nothing in the default config;
# explore.FAULT_OVERRIDES gives each a config where it does).
STALE_HASH_AFTER_EVICT = _spec(
    "stale_hash_after_evict", "action:evict", "stale hash after free",
    "a hash-table entry left behind when its block is evicted (eviction = drop_hash)",
    "published_hash_resident",
    "With eviction = drop_hash, eviction frees the block but leaves its hash published.",
    (("eviction", "drop_hash"),))
HASH_IGNORES_PARENT = _spec(
    "hash_ignores_parent", "funnel:hash", "hash collision / chain hash without its parent",
    "a block hash computed as if it were a first block (prefix-cache chain hashing)",
    "hit_content_sound",
    "With prompts > 1, the lookup compares a block's own tokens, not its chained hash: a block "
    "computed under another prefix is reused.", _PROMPTS)
STALE_HASH_AFTER_REUSE = _spec(
    "stale_hash_after_reuse", "action:append", "stale hash after free",
    "a freed block reused for other content while its old hash entry is still served",
    "hit_content_sound",
    "With prompts > 1, a block slot rewritten with other content keeps its old hash published.",
    _PROMPTS)
HASH_MISSING_SALT = _spec(
    "hash_missing_salt", "funnel:hash", "extra-key confusion / cross-tenant hit",
    "a block hash that leaves out the request's extra keys (vLLM's cache_salt, LoRA id, "
    "multimodal hashes): another tenant's blocks with the same tokens are reused",
    "hit_content_sound",
    "With salted_prompts > 0, the lookup compares the token chain without the extra key: a block "
    "computed under another salt (tenant, adapter, model fingerprint) is reused.",
    _small(("prompts", 2), ("salted_prompts", 1)))
DECODE_PUBLISHES_PARTIAL = _spec(
    "decode_publishes_partial", "action:decode", "hash published before the block is full",
    "a decode-time block hashed and cached after its first token, not when it fills",
    "hit_full_blocks",
    "With decode = true, the block a request decodes into is written and published at its first "
    "token: another request reuses a block that holds only part of its tokens.",
    _small(("decode", True), ("block_size", 2)))
ALLOC_EVICTS_REFERENCED = _spec(
    "alloc_evicts_referenced", "action:append_evict", "hit evicted between lookup and pin",
    "a block manager whose allocation evicts the LRU block without checking its reference count",
    "toctou_bound_stable",
    "With alloc = evict, the allocation of a block into a full pool evicts a block that a "
    "request still holds (its reference count is not checked).",
    _small(("alloc", "evict"), ("capacity", {"swa_window": 1})))
RESTORE_UNDER_STALE_KEY = _spec(
    "restore_under_stale_key", "action:verify_ok", "offloaded copy restored under the wrong key",
    "a host/disk copy loaded back into a slot and served under the hash the slot had, not the one "
    "it was saved with", "hit_content_sound",
    "With prompts > 1 and a disk tier, a verified copy is restored but the slot keeps its published "
    "hash: a request of the slot's old content reuses the copy's.",
    _full(("prompts", 2), ("blocks", 1), ("tiers", ("device", "disk")), ("reserve", 0)))
COPY_IGNORES_CAPACITY = _spec(
    "copy_ignores_capacity", "action:append_copy", "duplicate copies not counted",
    "a block manager that allocates a second copy of a cached block (two requests recomputing one "
    "prefix) without counting it against the pool",
    "admission_cap",
    "With duplicates = allow, a request's own second copy of a cached block is allocated without "
    "checking that the pool has room for it.",
    _small(("duplicates", "allow"), ("capacity", {"swa_window": 1})))
LATE_PUBLISH_REUSED_SLOT = _spec(
    "late_publish_reused_slot", "action:finish", "late publish of a block whose memory was reused",
    "a late publisher (a radix cache inserting a request's prefix when it finishes) that inserts "
    "every position of the request, including a block that slid out of its window and was "
    "rewritten by another prompt meanwhile", "hit_content_sound",
    "With publish = release, a releasing request publishes each of its positions under its own key "
    "whether or not the slot still holds its content: a later request of its prompt hits the other "
    "prompt's block.",
    _one_window(("prompts", 2), ("duplicates", "allow"), ("publish", "release"), ("requests", 2),
                ("max_active", 2), ("max_version", 0)))

SLIDE_ONE_WINDOW = _spec(
    "slide_one_window", "action:slide", "groups with different windows sharing one window bound",
    "a hybrid manager that frees every sliding-window group's out-of-window pages with one "
    "window (one retained-window field per request) although the groups' windows differ "
    "(Gemma-3-like layouts with several local windows)", "refcount_equals_holders",
    "With groups of different finite windows, `slide` releases every group's SWA pages below the "
    "narrowest window's start: a wider group's pages still inside its own window lose their pin.",
    _two_windows())

SPEC_FAULTS: tuple[Fault, ...] = (
    DECISION_IGNORES_INDEXER_VERSION, WINDOW_OFF_BY_ONE, TAIL_JUNCTION_NOT_CHECKED,
    PREFETCH_COUNTED_AS_HIT, EVICTION_IGNORES_PINS, COMPRESSED_VERSION_IGNORED, ABI_IGNORED,
    NO_REVALIDATION_AT_USE, REFCOUNT_DOUBLE_DECREMENT, ADMISSION_IGNORED, SHARED_FREE_LIST,
    GRAPH_PAGES_MIGRATED, STALE_HASH_AFTER_EVICT, HASH_IGNORES_PARENT, STALE_HASH_AFTER_REUSE,
    HASH_MISSING_SALT, DECODE_PUBLISHES_PARTIAL, ALLOC_EVICTS_REFERENCED, COPY_IGNORES_CAPACITY,
    RESTORE_UNDER_STALE_KEY, SLIDE_ONE_WINDOW, LATE_PUBLISH_REUSED_SLOT,
)
FAULTS: dict[str, Fault] = {f.name: f for f in SPEC_FAULTS}      # the spec's own


class Registry:
    """Faults from explicit providers, loaded on first use (a provider's module may need an
    optional package; its fault list must import without it). Names are unique across
    providers."""

    def __init__(self, providers: dict[str, Callable[[], Iterable[Fault]]] | None = None) -> None:
        self.providers: dict[str, Callable[[], Iterable[Fault]]] = {"spec": lambda: SPEC_FAULTS}
        self.providers.update(providers or {})
        self._faults: dict[str, Fault] | None = None

    def all(self) -> dict[str, Fault]:
        if self._faults is None:
            out: dict[str, Fault] = {}
            for prov, load in self.providers.items():
                for f in load():
                    if f.provider != prov:
                        raise ValueError(f"fault {f.name!r} is declared by {f.provider!r}, listed under {prov!r}")
                    if f.name in out:
                        raise ValueError(f"fault {f.name!r} declared twice")
                    out[f.name] = f
            self._faults = out
        return self._faults

    def get(self, name: str) -> Fault:
        f = self.all().get(name)
        if f is None:
            raise UnknownFault(name)
        return f


def get(name: str) -> Fault:
    """A spec fault by name (engine faults live with their engines: see fuzz/faults.py)."""
    try:
        return FAULTS[name]
    except KeyError:
        raise UnknownFault(name) from None


def spec_faults() -> list[Fault]:
    return list(SPEC_FAULTS)


def planted_spec_fault(fault: "str | Planted | None") -> Planted:
    """The Planted probe for a spec built with `fault` (a spec fault's name)."""
    if isinstance(fault, Planted):
        return fault
    return Planted(None if fault is None else get(fault))
