"""The fault library: named, planted bugs that each check must catch.

Owns the registry behind `kvcheck faults`. Spec faults are deviations of the spec itself
(actions.py and funnel.py branch on the fault's name when the spec is built); later parts
(the reference engine) register their own faults here. A fault counts as caught only when a
run fails with its `expected` invariant or check among the violations at the first failing step.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


class UnknownFault(KeyError):
    def __str__(self) -> str:
        return f"unknown fault {self.args[0]!r}; `kvcheck faults` lists the known ones"


@dataclass(frozen=True)
class Fault:
    name: str
    layer: str          # spec | engine | ...
    bug_class: str
    mirrors: str        # the public bug class / design it reproduces, where there is one
    expected: str       # the invariant or check that must catch it
    doc: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


FAULTS: dict[str, Fault] = {}


def register(f: Fault) -> Fault:
    if f.name in FAULTS:
        raise ValueError(f"fault {f.name!r} registered twice")
    FAULTS[f.name] = f
    return f


def get(name: str) -> Fault:
    try:
        return FAULTS[name]
    except KeyError:
        raise UnknownFault(name) from None


def spec_faults() -> list[Fault]:
    return [f for f in FAULTS.values() if f.layer == "spec"]


for _f in (
    Fault("decision_ignores_indexer_version", "spec", "indexer stale after restore",
          "DeepSeek-V3.2 sparse indexer state restored with another version (SGLang/vLLM "
          "indexer cache discussions)", "hit_sound_indexer",
          "Funnel layer 2 does not compare the indexer keys' version with the current indexer."),
    Fault("window_off_by_one", "spec", "window not covering needed positions",
          "vLLM sliding-window hit that skips the first page of the window (null-block "
          "accounting at the window edge)", "hit_sound_swa_window",
          "The funnel checks SWA pages [lo+1, k) instead of [lo, k): the window's first page is unchecked."),
    Fault("tail_junction_not_checked", "spec", "tail dropped / wrong tail",
          "DeepSeek-V4 compressed layers resuming inside a compression block", "hit_sound_tail",
          "The funnel accepts the oldest tail snapshot of the current compression block instead "
          "of the one taken exactly at the hit point."),
    Fault("prefetch_counted_as_hit", "spec", "offload marked ready before the copy completes",
          "LMCache / SGLang HiCache: 'registered' treated as 'ready' before the load acknowledgement",
          "hit_sound_on_disk",
          "Layer 3 treats objects whose on-disk copy is still loading or unverified as present."),
    Fault("eviction_ignores_pins", "spec", "hit evicted between lookup and pin",
          "vLLM/SGLang prefix hit evicted before the request pinned it", "toctou_bound_stable",
          "Eviction does not check reference counts or graph pins."),
    Fault("compressed_version_ignored", "spec", "layout or version change not invalidating a cache",
          "persisted compressed KV reused after a weight/quantization update", "hit_sound_compressed_kv",
          "Layer 2 does not compare compressed entries' version with the current compressor."),
    Fault("abi_ignored", "spec", "layout or version change not invalidating a cache",
          "kernel ABI / page layout change not invalidating stored pages", "hit_sound_layout",
          "Layer 2 does not compare the objects' ABI/layout fingerprint."),
    Fault("no_revalidation_at_use", "spec", "TOCTOU: lease not re-validated at use",
          "state_data_ptrs / version re-check skipped before reading", "toctou_bound_stable",
          "`use` runs a bound request without re-validating its lease versions."),
    Fault("refcount_double_decrement", "spec", "refcount imbalance",
          "vLLM block pool ref_cnt going negative on double free", "refcount_equals_holders",
          "`finish` releases the tail snapshot's pin twice."),
    Fault("admission_ignored", "spec", "admission cap ignored",
          "cache growth crowding out new requests (OOM)", "admission_cap",
          "`append` allocates without checking the pool's capacity."),
    Fault("shared_free_list", "spec", "groups aliasing memory",
          "hybrid groups drawing pages from one free list", "five_state_routing",
          "`append` draws SWA pages from the tail pool."),
    Fault("graph_pages_migrated", "spec", "CUDA-graph replay of stale tables",
          "compaction moving pages referenced by a captured CUDA graph", "graph_topology",
          "Compaction moves pages that a captured graph references."),
):
    register(_f)
