"""The configuration vocabulary shared by every part of kvcheck.

Owns: the layer mix, the cache-group structure derived from it, pool capacities, tiers,
admission caps and the small-model bounds. Frozen dataclasses; `Config.from_dict` is the one
place that turns untrusted JSON into a config and says clearly what is wrong with it.
"""
from __future__ import annotations

import json
import stat
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .object_kinds import DEVICE_KINDS

LAYER_KINDS = ("full", "swa", "hca", "csa", "mamba")
SPEC_LAYER_KINDS = ("full", "swa", "hca", "csa")   # the kinds the spec's state machine models
EVICTION_MODES = ("tombstone", "drop_hash")
ALLOC_MODES = ("refuse", "evict")
DUPLICATE_MODES = ("forbid", "allow")
PUBLISH_MODES = ("append", "release")
# Semantic keys and their defaults: omitted from to_dict at the default, so that a default
# config (its traces, reports, cache keys) reads exactly as before they existed.
SEMANTIC_DEFAULTS = {"eviction": "tombstone", "prompts": 1, "salted_prompts": 0, "salt": True, "decode": False,
                     "alloc": "refuse", "duplicates": "forbid", "publish": "append"}

# Which device object kinds a group of each layer kind keeps (the kinds themselves are declared
# once, in object_kinds.py). Full-attention KV pages are swa_window pages with an infinite window:
# "raw KV for positions [max(0, L-W+1), L)" with W = inf is all of [0, L).
GROUP_OBJECTS: dict[str, tuple[str, ...]] = {
    "full": ("swa_window",),
    "swa": ("swa_window",),
    "hca": ("compressed_kv", "tail", "swa_window"),   # swa_window = the raw SWA branch
    "csa": ("compressed_kv", "tail", "swa_window", "indexer"),
    # recurrent (Mamba / linear-attention) layers: one state snapshot per boundary, no KV.
    # Judged by adapters through needed_objects; the spec's state machine refuses it (below).
    "mamba": ("recurrent_state",),
}


class ConfigError(ValueError):
    """Bad or impossible configuration: reported as one line, exit code 2."""


# Upper bounds of sizes: far above any real engine's, low enough that nothing downstream (the
# reference model's buffers, the spec's state domains) tries to allocate the impossible.
MAX_BLOCK_SIZE = 4096       # tokens per logical block (vLLM's largest is 256)
MAX_TOKENS = 1 << 20        # page_tokens, window, m, topk (tokens)
MAX_COUNT = 1 << 16         # pool capacities, caps, version bumps


def _int(name: str, v: Any, lo: int, hi: int) -> int:
    """An integer field within [lo, hi], or a ConfigError naming the field."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"config: {name} must be an integer, got {type(v).__name__} {v!r:.40}")
    if v < lo:
        raise ConfigError(f"config: {name} must be >= {lo}{' (non-negative)' if lo == 0 else ''}, got {v}")
    if v > hi:
        raise ConfigError(f"config: {name} must be <= {hi}, got {v}")
    return v


MAX_INPUT_BYTES = 64 << 20       # no config, trace, project or layout file is near this


def read_text(path: str | Path, what: str, error: type[Exception]) -> str:
    """A UTF-8 text file, every way reading it can fail turned into one line of `error`: only a
    regular file (a FIFO would block, /dev/zero never ends), at most MAX_INPUT_BYTES."""
    p = Path(path)
    try:
        regular = stat.S_ISREG(p.stat().st_mode)
        raw = b""
        if regular:
            with p.open("rb") as fh:
                raw = fh.read(MAX_INPUT_BYTES + 1)
    except OSError as e:
        raise error(f"cannot read {what} {p}: {e.strerror or e}") from None
    except ValueError as e:          # a NUL byte in the path
        raise error(f"cannot read {what} {str(p)[:200]!r}: {e}") from None
    if not regular:
        raise error(f"cannot read {what} {p}: not a regular file")
    if len(raw) > MAX_INPUT_BYTES:
        raise error(f"{what} {p} is larger than {MAX_INPUT_BYTES >> 20} MiB: not a {what}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {p} is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})") from None


def read_json(path: str | Path, what: str, error: type[Exception]) -> Any:
    """Parse a JSON file, turning every way it can fail into one line of `error`."""
    p = Path(path)
    text = read_text(p, what, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{what} {p} is not valid JSON: {e.msg} at line {e.lineno}") from None
    except RecursionError:
        raise error(f"{what} {p} is nested too deeply to parse (over Python's recursion limit)") from None
    except ValueError as e:       # e.g. an integer literal beyond Python's digit limit
        raise error(f"{what} {p} is not valid JSON: {e}") from None


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer. `window` for swa and the SWA branch of hca/csa; `m` the
    compression block (tokens per compressed entry); `topk` the indexer's selection size."""

    kind: str
    window: int | None = None
    m: int | None = None
    topk: int | None = None

    def key(self) -> tuple:
        return (self.kind, self.window, self.m, self.topk)


@dataclass(frozen=True)
class Group:
    """A cache group: the layers that share one spec (vLLM's KVCacheGroupSpec). Layers with the
    same kind and parameters share pages, so the spec tracks objects per group, not per layer."""

    index: int
    kind: str
    window: int | None          # None = infinite (full attention)
    m: int | None
    topk: int | None
    layers: tuple[int, ...]
    page_tokens: int

    @property
    def objects(self) -> tuple[str, ...]:
        return GROUP_OBJECTS[self.kind]

    @property
    def name(self) -> str:
        return f"g{self.index}:{self.kind}"


DEFAULT_LAYERS = (
    LayerSpec("swa", window=6),
    LayerSpec("csa", window=6, m=8, topk=2),
    LayerSpec("hca", window=6, m=16),
    LayerSpec("csa", window=6, m=8, topk=2),
    LayerSpec("full"),
)


@dataclass(frozen=True)
class Config:
    """Everything the spec, the reference engine and the checkers agree on.

    Sizes are in tokens unless named `*_blocks`. `blocks` and `requests` bound the abstract
    model (the shared prefix has `blocks` logical blocks; `requests` request slots)."""

    layers: tuple[LayerSpec, ...] = DEFAULT_LAYERS
    block_size: int = 4
    # Tokens per physical page, per layer kind. The hit is aligned to the LCM of these
    # (funnel layer 1); the hash block is `block_size`, which must divide every page size.
    page_tokens: dict[str, int] = field(default_factory=dict)
    # Pool capacities in objects (pages/entries) per device object kind.
    capacity: dict[str, int] = field(default_factory=lambda: {
        "compressed_kv": 4, "tail": 4, "swa_window": 13, "indexer": 3})
    reserve: int = 1            # pages per pool kept back from restores for new requests
    tiers: tuple[str, ...] = ("device", "host", "disk")
    max_inflight: int = 2       # admission cap on transfers in flight (offload + prefetch)
    max_active: int = 2         # admission cap on requests holding leases
    blocks: int = 4             # bound: logical blocks of the shared prefix
    requests: int = 2           # bound: request slots
    max_version: int = 1        # bound: how many times each version may be bumped
    seed: int = 0
    # Semantics where engines legitimately differ (each off by default: today's spec). See
    # docs/spec.md "Configurable semantics".
    eviction: str = "tombstone"  # tombstone: an evicted block's hash stays; drop_hash: unpublished
    prompts: int = 1            # distinct prompt contents (1: every request shares one prefix)
    # the last S prompts are prompt 0's tokens under another extra key of the block hash (a
    # cache salt / tenant, an adapter id, a model fingerprint): content.py
    salted_prompts: int = 0
    salt: bool = True           # false: the engine has no cache salt (no salted prompts, no other tenant asks)
    decode: bool = False        # decode(r, j) appends one token; the block is published when full
    # refuse: an append into a full pool is not enabled (something else must evict first);
    # evict: the allocation evicts an unreferenced cached block itself, or fails and preempts
    # a request (alloc.py)
    alloc: str = "refuse"
    # forbid: one physical copy per logical block (a request appending a cached block shares
    # it); allow: two requests recomputing one prefix may keep two copies (duplicates.py)
    duplicates: str = "forbid"
    # append: a block's hash is published when it is written; release: when the request holding
    # it finishes or is preempted (a late publisher: context.publish_released)
    publish: str = "append"

    # ---- derived structure -------------------------------------------------------------
    def __post_init__(self) -> None:
        self.validate()

    @property
    def groups(self) -> tuple[Group, ...]:
        seen: dict[tuple, list[int]] = {}
        for i, layer in enumerate(self.layers):
            seen.setdefault(layer.key(), []).append(i)
        out = []
        for gi, (key, idxs) in enumerate(seen.items()):
            kind, window, m, topk = key
            out.append(Group(gi, kind, None if kind == "full" else window, m, topk,
                             tuple(idxs), self.page_tokens.get(kind, self.block_size)))
        return tuple(out)

    @property
    def align_blocks(self) -> int:
        """Funnel layer 1: a hit must be a whole number of LCM pages across all groups."""
        lcm = 1
        for g in self.groups:
            lcm = lcm * g.page_tokens // math.gcd(lcm, g.page_tokens)
        return lcm // self.block_size

    @property
    def offload_enabled(self) -> bool:
        return "host" in self.tiers or "disk" in self.tiers

    def window_lo_block(self, window: int | None, k: int) -> int:
        """First logical block whose raw KV a query at position L = k*B may read."""
        if window is None:
            return 0
        lo_tok = max(0, k * self.block_size - window + 1)
        return lo_tok // self.block_size

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct finite sliding windows (swa layers and the SWA branch of hca/csa)."""
        return tuple(sorted({g.window for g in self.groups if g.window is not None}))

    def window_steps(self) -> tuple[tuple[int, ...], ...]:
        """The retained windows of a request, as steps: the distinct tuples of every group's
        first retained block (`window_lo_block`; 0 for full attention) over the positions
        k = 0..blocks, in order. Each group's first block never decreases with k, so a step
        never recurs and step i < i' means no group's window starts later. With one finite
        window the steps are exactly that window's first blocks 0, 1, 2, ... (it moves by at
        most one block per position): step i is block i. A request keeps one step (state.py
        `rwin`) and every group its own window start from it."""
        out: list[tuple[int, ...]] = []
        groups = self.groups
        for k in range(self.blocks + 1):
            t = tuple(self.window_lo_block(g.window, k) for g in groups)
            if not out or out[-1] != t:
                out.append(t)
        return tuple(out)

    def window_step(self, k: int) -> int:
        """The step of `window_steps` a request resumed at k retains."""
        t = tuple(self.window_lo_block(g.window, k) for g in self.groups)
        return self.window_steps().index(t)

    def has_compressed(self, g: Group, j: int) -> bool:
        """Does block j complete at least one compressed entry of group g?"""
        b = self.block_size
        return ((j + 1) * b) // g.m > (j * b) // g.m

    def needs_tail(self, g: Group, j: int) -> bool:
        """Does the boundary after block j fall inside a compression block (so a tail
        snapshot of tokens [m*(L//m), L) is needed to resume there)?"""
        return ((j + 1) * self.block_size) % g.m != 0

    def tail_start_block(self, g: Group, k: int) -> int:
        """Block whose start is the tail's start at boundary k (the junction with the last entry)."""
        return (g.m * ((k * self.block_size) // g.m)) // self.block_size

    # ---- validation --------------------------------------------------------------------
    def validate(self) -> None:
        """Types first (a string where an integer goes is named, not compared), then ranges."""
        if not isinstance(self.layers, tuple) or not self.layers:
            raise ConfigError("config: 'layers' must list at least one layer")
        _int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerSpec):
                raise ConfigError(f"config: layers[{i}] must be a layer object")
            if not isinstance(layer.kind, str) or layer.kind not in LAYER_KINDS:
                raise ConfigError(f"config: layers[{i}].kind: unknown layer kind {layer.kind!r}; "
                                  f"expected one of {', '.join(LAYER_KINDS)}")
            where = f"config: layers[{i}] ({layer.kind})"
            for name, hi in (("window", MAX_TOKENS), ("m", MAX_TOKENS), ("topk", MAX_TOKENS)):
                v = getattr(layer, name)
                if v is not None:
                    _int(f"layers[{i}].{name}", v, 1, hi)
            if layer.kind in ("swa", "hca", "csa"):
                if layer.window is None:
                    raise ConfigError(f"{where}: window must be >= 1, got {layer.window}")
            if layer.kind == "mamba" and (layer.window, layer.m, layer.topk) != (None, None, None):
                raise ConfigError(f"{where}: a recurrent layer takes no window, m or topk")
            if layer.kind in ("hca", "csa"):
                if layer.m is None:
                    raise ConfigError(f"{where}: compression block m must be >= 1, got {layer.m}")
                if layer.m % self.block_size and self.block_size % layer.m:
                    raise ConfigError(
                        f"{where}: compression block m={layer.m} and block_size={self.block_size} "
                        "must nest (one divides the other) so entries map onto logical blocks")
            if layer.kind == "csa" and layer.topk is None:
                raise ConfigError(f"{where}: indexer topk must be >= 1, got {layer.topk}")
        if not isinstance(self.page_tokens, dict):
            raise ConfigError("config: 'page_tokens' must be an object")
        for kind, pt in self.page_tokens.items():
            if kind not in LAYER_KINDS:
                raise ConfigError(f"config: page_tokens: unknown layer kind {kind!r}")
            _int(f"page_tokens[{kind}]", pt, 1, MAX_TOKENS)
            if pt % self.block_size:
                raise ConfigError(f"config: page_tokens[{kind}]={pt} must be a positive multiple "
                                  f"of block_size={self.block_size}")
        if not isinstance(self.capacity, dict):
            raise ConfigError("config: 'capacity' must be an object")
        for kind, cap in self.capacity.items():
            if kind not in DEVICE_KINDS:
                raise ConfigError(f"config: capacity: unknown object kind {kind!r}; "
                                  f"expected one of {', '.join(DEVICE_KINDS)}")
            _int(f"capacity[{kind}]", cap, 0, MAX_COUNT)
        for name in ("reserve", "max_inflight", "max_active", "max_version"):
            _int(name, getattr(self, name), 0, MAX_COUNT)
        for name in ("blocks", "requests"):
            _int(name, getattr(self, name), 1, 64)
        _int("seed", self.seed, 0, 2**63 - 1)
        if not isinstance(self.eviction, str) or self.eviction not in EVICTION_MODES:
            raise ConfigError(f"config: eviction must be one of {', '.join(EVICTION_MODES)}, "
                              f"got {self.eviction!r:.40}")
        if not isinstance(self.alloc, str) or self.alloc not in ALLOC_MODES:
            raise ConfigError(f"config: alloc must be one of {', '.join(ALLOC_MODES)}, "
                              f"got {self.alloc!r:.40}")
        if not isinstance(self.duplicates, str) or self.duplicates not in DUPLICATE_MODES:
            raise ConfigError(f"config: duplicates must be one of {', '.join(DUPLICATE_MODES)}, "
                              f"got {self.duplicates!r:.40}")
        if not isinstance(self.publish, str) or self.publish not in PUBLISH_MODES:
            raise ConfigError(f"config: publish must be one of {', '.join(PUBLISH_MODES)}, "
                              f"got {self.publish!r:.40}")
        if self.publish == "release" and (self.duplicates != "allow" or self.decode is True):
            raise ConfigError("config: publish = \"release\" needs duplicates = \"allow\" (a request "
                              "copies what another has not published yet) and decode = false (not modelled)")
        _int("prompts", self.prompts, 1, 8)
        _int("salted_prompts", self.salted_prompts, 0, 7)
        if self.salted_prompts > self.prompts - 1:
            raise ConfigError(f"config: salted_prompts = {self.salted_prompts} needs prompts >= "
                              f"{self.salted_prompts + 1} (prompt 0 is the unsalted original), got "
                              f"prompts = {self.prompts}")
        if not isinstance(self.salt, bool):
            raise ConfigError(f"config: salt must be true or false, got {self.salt!r:.40}")
        if not self.salt and self.salted_prompts:
            raise ConfigError(f"config: salt = false (the engine has no cache salt) cannot serve "
                              f"salted_prompts = {self.salted_prompts}: drop one of them")
        if not isinstance(self.decode, bool):
            raise ConfigError(f"config: decode must be true or false, got {self.decode!r:.40}")
        if not isinstance(self.tiers, tuple) or not all(isinstance(t, str) for t in self.tiers):
            raise ConfigError(f"config: tiers must be a list of tier names (device, host, disk), "
                              f"got {self.tiers!r}")
        for t in self.tiers:
            if t not in ("device", "host", "disk"):
                raise ConfigError(f"config: unknown tier {t!r}; expected device, host, disk")
        if len(set(self.tiers)) != len(self.tiers):
            raise ConfigError(f"config: tiers lists a tier twice: {list(self.tiers)}")
        if "device" not in self.tiers:
            raise ConfigError("config: tiers must include 'device'")

    def check_modelled(self) -> None:
        """The spec's state machine models attention objects only; a recurrent (mamba) layer's
        recovery rule is declared (objects.RECURRENT_STATE) for adapters, not explored."""
        bad = sorted({l.kind for l in self.layers if l.kind not in SPEC_LAYER_KINDS})
        if bad:
            raise ConfigError(f"config: layer kind {bad[0]!r} (recurrent state) is judged by engine "
                              "adapters through needed_objects; the spec's state machine does not "
                              "model it yet: drop the layer to explore or prove")

    def semantics(self) -> dict[str, Any]:
        """The configurable semantics this config switches on (keys away from their default)."""
        return {k: getattr(self, k) for k, d in SEMANTIC_DEFAULTS.items() if getattr(self, k) != d}

    def refuse_semantics(self, who: str, implements: tuple[str, ...] = ()) -> None:
        """One line (ConfigError, exit 2) when this config uses a semantic `who` does not
        implement, instead of a flood of divergences from an engine that cannot follow it."""
        bad = {k: v for k, v in self.semantics().items() if k not in implements}
        if bad:
            k, v = next(iter(bad.items()))
            raise ConfigError(f"config: {k} = {json.dumps(v)}: {who} does not implement this "
                              "semantic (docs/spec.md, Configurable semantics); run it with --sut "
                              "spec, or an adapter that maps it, or drop the key")

    def kind_name(self, kind: str) -> str:
        """An object kind in this config's vocabulary (messages): a config whose layers are all
        full attention calls its pages `full`, as its capacity key does (from_dict)."""
        return "full" if kind == "swa_window" and {l.kind for l in self.layers} == {"full"} else kind

    def cap(self, kind: str) -> int:
        """Capacity of a device pool; unlisted kinds are unbounded (every object fits)."""
        return self.capacity.get(kind, 1 << 30)

    # ---- (de)serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = [{k: v for k, v in asdict(l).items() if v is not None} for l in self.layers]
        d["tiers"] = list(self.tiers)
        for k, default in SEMANTIC_DEFAULTS.items():
            if d[k] == default and type(d[k]) is type(default):
                del d[k]
        return d

    @classmethod
    def from_dict(cls, data: Any) -> "Config":
        if not isinstance(data, dict):
            raise ConfigError("config: expected a JSON object at the top level")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"config: unknown key(s) {', '.join(map(repr, unknown))}; "
                              f"known keys: {', '.join(sorted(known))}")
        kw = dict(data)
        if "layers" in kw:
            layers = []
            if not isinstance(kw["layers"], list):
                raise ConfigError("config: 'layers' must be a list")
            for i, l in enumerate(kw["layers"]):
                if isinstance(l, str):
                    l = {"kind": l}
                if not isinstance(l, dict):
                    raise ConfigError(f"config: layers[{i}] must be an object or a kind name")
                bad = sorted(set(l) - {"kind", "window", "m", "topk"})
                if bad:
                    raise ConfigError(f"config: layers[{i}]: unknown key(s) {', '.join(map(repr, bad))}")
                if "kind" not in l:
                    raise ConfigError(f"config: layers[{i}]: missing 'kind'")
                layers.append(LayerSpec(**l))
            kw["layers"] = tuple(layers)
        cap = kw.get("capacity")
        if isinstance(cap, dict) and "full" in cap:     # the pages of full-attention layers, by their name
            if {getattr(l, "kind", None) for l in kw.get("layers", ())} != {"full"} or "swa_window" in cap:
                raise ConfigError("config: capacity: 'full' (the pages of full-attention layers) needs "
                                  "every layer full and no 'swa_window' key beside it")
            kw["capacity"] = {("swa_window" if k == "full" else k): v for k, v in cap.items()}
        if "tiers" in kw:
            if not isinstance(kw["tiers"], list):
                raise ConfigError(f"config: tiers must be a list of tier names (device, host, disk), "
                                  f"got {kw['tiers']!r:.40}")
            kw["tiers"] = tuple(kw["tiers"])
        for name in ("page_tokens", "capacity"):
            if name in kw and not isinstance(kw[name], dict):
                raise ConfigError(f"config: {name!r} must be an object")
        return cls(**kw)

    @classmethod
    def load(cls, path: str | Path | None) -> "Config":
        """Read a JSON config file; None gives the embedded default."""
        if path is None:
            return cls()
        return cls.from_dict(read_json(path, "config", ConfigError))
