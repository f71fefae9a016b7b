"""Layer patterns: which layer kind sits where, set through the config class's own fields.

The derived tiny config is one miniature; a released checkpoint orders its kinds differently, and
the order decides which cache code path runs (which layer's cache answers mask sizes, owns the
sequence length). Owns the three pattern sets (``default``, ``checkpoint``, ``orderings``), setting
a pattern through whatever field the class reads it from (found by reading the built config back,
never by model type), the check that the built model's cache layers follow it, and the kinds'
cache objects for ``--list-models``. docs/adapters-transformers.md, "Layer patterns".
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import re
from typing import Any

from . import rules
from .models import AdapterError, config_mapping, decoder_type, layer_kinds_in_source, modeling_source

SETS = ("default", "checkpoint", "orderings", "all")
ORDERING_LAYERS = 4       # orderings: patterns of up to this many layers (more only if there are more kinds)
MAX_ORDERINGS = 8         # ... at most this many, chosen deterministically (orderings())
CHECKPOINT_LAYERS = 8     # a checkpoint pattern keeps at most this many layers
PATTERN_FIELDS = ("layer_types", "layers_block_type", "block_types", "attention_layers")
NO_CACHE = ("moe", "mlp")  # kinds without attention: transformers gives them a dummy cache layer
INDEX_FIELD = re.compile(r"(_indices|_idxs|_ids|_layers)$")
INTERVAL_FIELD = re.compile(r"(_pattern|_interval|_every_n_layers)$")


class Unexpressible(AdapterError):
    """No field of the config class sets this pattern: the pattern is ``unsupported`` (one line)."""


def effective(cfg) -> list[str] | None:
    """The pattern a built config really has: its layer-types attribute (a field, an alias, or a
    property the class computes from period/offset/index fields), cyclic lists unrolled."""
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    n = getattr(text, "num_hidden_layers", None)
    for name in PATTERN_FIELDS:
        try:
            v = getattr(text, name, None)
        except Exception:  # noqa: BLE001 - a property that cannot compute is no pattern
            v = None
        if isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v):
            v = list(v)
            return (v * n)[:n] if isinstance(n, int) and n > 0 and len(v) != n else v
    return None


def abbreviations(kinds) -> dict[str, str]:
    """Short labels: the initials of a kind's words without 'attention' (S, F, L, HC), longer where two clash."""
    words = {k: [w for w in k.split("_") if w != "attention"] or [k] for k in kinds}
    ab = {k: "".join(w[0] for w in ws).upper() for k, ws in words.items()}
    for size in range(2, 8):
        clash = {k for k in ab if list(ab.values()).count(ab[k]) > 1}
        if not clash:
            break
        for k in clash:
            ab[k] = "".join(w[:size] for w in words[k]).upper()
    return ab


def label(pattern: list[str], kinds=None) -> str:
    ab = abbreviations(list(dict.fromkeys(list(kinds or []) + list(pattern))))
    return " ".join(ab[k] for k in pattern)


def make_config(mt: str, params: dict[str, Any]):
    from transformers import AutoConfig

    return AutoConfig.for_model(mt, **params)


@functools.lru_cache(maxsize=None)
def class_default(mt: str) -> tuple[tuple[str, ...] | None, str]:
    """(the pattern of the class's own default config, the name of its class)."""
    mapping, _ = config_mapping()
    try:
        cfg = mapping[mt]()
    except Exception:  # noqa: BLE001
        return None, mapping[mt].__name__
    pat = effective(cfg)
    return (tuple(pat) if pat else None), type(cfg.get_text_config(decoder=True)).__name__


def cache_mapping() -> dict[str, Any]:
    from transformers import cache_utils

    return dict(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING)


def registered_in_source(mt: str) -> list[str]:
    """Layer kinds the model's modeling file registers its own cache layer class for (``_layer_type = "x"``)."""
    return list(dict.fromkeys(re.findall(r"^\s+_layer_type\s*=\s*[\"'](\w+)[\"']", modeling_source(mt), re.M)))


def kinds_of(mt: str, default: list[str] | None) -> list[str]:
    """The distinct layer kinds ``mt`` can have, in order: of the derived default pattern, of the
    class's own default, then those its modeling code compares ``layer_types`` with that have a cache
    layer class (transformers' mapping, or registered by the modeling file)."""
    mt = decoder_type(mt)
    cached = set(cache_mapping()) | set(registered_in_source(mt)) | set(NO_CACHE)
    src = [k for k in layer_kinds_in_source(mt) + registered_in_source(mt) if k in cached]
    return list(dict.fromkeys(list(default or []) + list(class_default(mt)[0] or []) + src))


# --------------------------------------------------------------------------------------------
# the pattern sets


def checkpoint(mt: str, default: list[str] | None) -> tuple[list[str], str] | None:
    """The class's own default pattern (its layer list, or what its period/offset/interval/index fields
    give at their default values), cut to at most CHECKPOINT_LAYERS keeping which kind comes first
    and the proportions: one whole period when it repeats, else the prefix closest to its
    proportions. None when it has one kind or equals ``default``."""
    full, _ = class_default(decoder_type(mt))
    if not full or len(set(full)) < 2:
        return None
    full = list(full)
    n, per = len(full), rules.period(list(full))
    if per < n and per <= CHECKPOINT_LAYERS:
        pat, how = full[:per], f"one period ({per} layers) of the class's default {n}-layer pattern"
    else:
        share = {k: full.count(k) / n for k in set(full)}
        best = None
        for m in range(len(share), min(n, CHECKPOINT_LAYERS) + 1):
            pre = full[:m]
            if set(pre) != set(share):
                continue
            err = sum(abs(pre.count(k) / m - s) for k, s in share.items())
            if best is None or err < best[0] - 1e-9:
                best = (err, m)
        if best is None:
            return None
        pat, how = full[:best[1]], f"the first {best[1]} of the class's default {n} layers (closest to its proportions)"
    return (None if pat == list(default or []) else (pat, how))


def orderings(kinds: list[str], exclude=()) -> list[list[str]]:
    """Every distinct ordering of ``kinds`` in patterns of len(kinds)..ORDERING_LAYERS layers (each kind
    present; a repetition of a shorter pattern dropped; ``exclude`` dropped), at most MAX_ORDERINGS:
    taken in turn by first kind (each kind leads one), each kind's in order of length, then of the
    kinds' order."""
    if len(kinds) < 2:
        return []
    rank = {k: i for i, k in enumerate(kinds)}
    seen = {tuple(x) for x in exclude}
    groups: dict[str, list[list[str]]] = {k: [] for k in kinds}
    for m in range(len(kinds), max(len(kinds), ORDERING_LAYERS) + 1):
        for seq in sorted(itertools.product(kinds, repeat=m), key=lambda s: [rank[x] for x in s]):
            per = rules.period(list(seq))
            if set(seq) != set(kinds) or (per < m and m % per == 0) or seq in seen:
                continue
            groups[seq[0]].append(list(seq))
    out: list[list[str]] = []
    while len(out) < MAX_ORDERINGS and any(groups.values()):
        for k in kinds:
            if groups[k] and len(out) < MAX_ORDERINGS:
                out.append(groups[k].pop(0))
    return out


def plan(mt: str, which: str, default: list[str] | None) -> list[dict[str, Any]]:
    """The non-default patterns ``which`` asks for (``default`` asks none), deduplicated, each with
    its set and how it was derived; a set that gives none says why in a ``skipped`` row."""
    if which not in SETS:
        raise AdapterError(f"unknown --patterns {which!r}; use one of {', '.join(SETS)}")
    out: list[dict[str, Any]] = []
    kinds = kinds_of(mt, default)
    if which in ("checkpoint", "all"):
        cp = checkpoint(mt, default)
        if cp is None:
            out.append(dict(set="checkpoint", skipped="the class's own default pattern has one kind or is the "
                            "default pattern"))
        else:
            out.append(dict(set="checkpoint", pattern=cp[0], how=cp[1]))
    if which in ("orderings", "all"):
        done = [list(default or [])] + [r["pattern"] for r in out if "pattern" in r]
        orders = orderings(kinds, exclude=done)
        if not orders:
            out.append(dict(set="orderings", skipped=f"one layer kind ({', '.join(kinds) or 'none found'})"))
        out += [dict(set="orderings", pattern=p, how=f"ordering {i + 1} of {len(orders)} over {len(kinds)} kinds")
                for i, p in enumerate(orders)]
    for r in out:
        if "pattern" in r:
            r["label"] = label(r["pattern"], kinds)
    return out


# --------------------------------------------------------------------------------------------
# setting a pattern through the class's own fields


def _by_kind(base_pat: list[str], values: list) -> dict[str, Any] | None:
    """kind -> value when a per-layer list is a function of the layer's kind (seen on a kind twice), else None."""
    out: dict[str, Any] = {}
    for k, v in zip(base_pat, values):
        if json.dumps(out.setdefault(k, v), default=str) != json.dumps(v, default=str):
            return None
    return out if len(set(base_pat)) < len(base_pat) else None


def resize(base: dict[str, Any], base_pat: list[str], target: list[str]) -> dict[str, Any]:
    """``base`` for len(target) layers: per-layer lists follow the kind where they are a function of it,
    else are cut/extended with their last entry; index lists likewise; role counts re-partitioned."""
    n0, n = len(base_pat), len(target)
    out = {**base, "num_hidden_layers": n}
    for k, v in base.items():
        if k in PATTERN_FIELDS or k == "time_step_limit" or not isinstance(v, list) or not v:
            continue
        index = (INDEX_FIELD.search(k) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
                 and all(a < b for a, b in zip(v, v[1:])) and v[0] >= 0 and max(v) < n0)
        if len(v) == n0 and not index:
            kind = _by_kind(base_pat, v)
            out[k] = [kind[t] if kind and t in kind else v[min(i, n0 - 1)] for i, t in enumerate(target)]
        elif index:
            kinds = {base_pat[i] for i in v}
            if set(v) == {i for i, t in enumerate(base_pat) if t in kinds}:
                out[k] = [i for i, t in enumerate(target) if t in kinds]
            else:
                out[k] = [i for i in v if i < n] or [n - 1]
    out.update(rules.scale_layer_counts(base, n0, n, fixed=("num_hidden_layers",)))
    return out


def _candidates(d: dict[str, Any], base: dict[str, Any], base_pat: list[str], target: list[str]):
    """Field settings that may give ``target``: a layer-type list (in the field's own vocabulary,
    learned from the base config), an index list per kind, a period/offset pair, an interval."""
    n = len(target)
    yield {}                       # the base, resized, may already have it
    own = {f: v for f, v in d.items() if not isinstance(v, bool) and (
        (INDEX_FIELD.search(f) and (v is None or isinstance(v, list))) or INTERVAL_FIELD.search(f)
        or f.endswith(("_period", "_offset"))) and (v is None or isinstance(v, (int, list)))}
    if own:                        # the class's own values of its pattern fields (a checkpoint's)
        yield {**{f: None for f in PATTERN_FIELDS if f in d}, **own}
    lists = [f for f in PATTERN_FIELDS if f in d] + [f for f, v in d.items() if f not in PATTERN_FIELDS
                                                     and isinstance(v, list) and v and all(isinstance(x, str) for x in v)
                                                     and f.endswith(("_types", "_type"))]
    for f in lists:
        own = base.get(f, d.get(f))
        if isinstance(own, list) and own and all(isinstance(x, str) for x in own) and not set(own) <= set(base_pat):
            inv: dict[str, str] = {}
            for i, kind in enumerate(base_pat):
                if inv.setdefault(kind, own[i % len(own)]) != own[i % len(own)]:
                    inv = {}
                    break
            if inv and len(set(inv.values())) == len(inv) and set(target) <= set(inv):
                yield {f: [inv[t] for t in target]}
            continue
        yield {f: list(target)}
    clear = {f: None for f in PATTERN_FIELDS if f in d}
    for f, v in d.items():
        if INDEX_FIELD.search(f) and (v is None or (isinstance(v, list) and all(isinstance(x, int) for x in v))):
            for kind in dict.fromkeys(target):
                yield {**clear, f: [i for i, t in enumerate(target) if t == kind]}
    for f, v in d.items():
        if not isinstance(v, int) or isinstance(v, bool):
            continue
        off = f[:-len("period")] + "offset" if f.endswith("_period") else None
        if off in d:
            for p in range(1, n + 1):
                for o in range(p):
                    yield {**clear, f: p, off: o}
        elif INTERVAL_FIELD.search(f):
            for p in range(1, n + 2):
                yield {**clear, f: p}


def express(mt: str, base: dict[str, Any], target: list[str]) -> dict[str, Any]:
    """``base`` with its layer pattern set to ``target`` through the class's own fields: the first
    candidate setting whose constructed config reads back exactly ``target``; :class:`Unexpressible`
    (one line) when none does."""
    try:
        base_pat = effective(make_config(mt, base)) or list(target)
    except Exception:  # noqa: BLE001 - the variant itself does not construct; the caller tries the next
        base_pat = list(target)
    mapping, _ = config_mapping()
    cls = mapping[mt]
    try:
        d = cls().get_text_config(decoder=True).to_dict()
    except Exception:  # noqa: BLE001
        d = dict(base)
    sized = resize(base, base_pat, target)
    fields: list[str] = []
    for cand in _candidates(d, base, base_pat, target):
        fields += [f for f, v in cand.items() if v is not None and f not in fields]
        params = {**sized, **cand}
        try:
            got = effective(make_config(mt, params))
        except Exception:  # noqa: BLE001 - a setting the class rejects is not this pattern
            continue
        if got == list(target):
            return params
    raise Unexpressible(f"{cls.__name__} cannot express the pattern {label(target)}: no setting of "
                        f"{', '.join(fields) or 'a layer-pattern field'} reads back as it")


def check_built(target: list[str], cache) -> str | None:
    """Why the built model's cache layers do not follow ``target`` (None when they do): one cache layer
    per layer, of the class transformers maps its kind to, the same class for the same kind."""
    layers = list(getattr(cache, "layers", []))
    if len(layers) != len(target):
        return f"the built cache has {len(layers)} layers for a {len(target)}-layer pattern"
    mapping, seen = cache_mapping(), {}
    for i, (kind, layer) in enumerate(zip(target, layers)):
        want = mapping.get("dummy" if kind in NO_CACHE else kind)
        got = type(layer)
        if seen.setdefault(kind, got) is not got or (want is not None and not issubclass(got, want)):
            return (f"layer {i} ({kind}) has cache layer {got.__name__}, not "
                    f"{(want or seen[kind]).__name__}: the model does not follow the pattern")
    return None


# --------------------------------------------------------------------------------------------
# --list-models: every layer kind and the cache objects it needs


@functools.lru_cache(maxsize=None)
def _class_attrs(cls) -> list[str]:
    """Attributes a cache layer class (and its bases) assigns, read from its source."""
    found: list[str] = []
    for klass in cls.__mro__:
        if klass is object or not klass.__module__.startswith("transformers"):
            continue
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        found += re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", src)
    return list(dict.fromkeys(found))


def layer_caches(mt: str) -> dict[str, dict[str, Any]]:
    """kind -> the cache layer class transformers uses for it and the objects it holds, in kvcheck's kinds."""
    from .cache import kind_of

    mt = decoder_type(mt)
    if registered_in_source(mt):  # the modeling file registers its own classes when imported
        import importlib

        from transformers.models.auto.configuration_auto import model_type_to_module_name

        mod = model_type_to_module_name(mt)
        try:
            importlib.import_module(f"transformers.models.{mod}.modeling_{mod.split('.')[-1]}")
        except Exception:  # noqa: BLE001 - listed without them
            pass
    mapping = cache_mapping()
    out: dict[str, dict[str, Any]] = {}
    for kind in kinds_of(mt, None):
        cls = mapping.get("dummy" if kind in NO_CACHE else kind)
        if cls is None:
            out[kind] = dict(cache_class=None, objects={})
            continue
        objs = {a: kind_of(None, a, None) for a in _class_attrs(cls)}
        out[kind] = dict(cache_class=cls.__name__,
                         objects={a: k for a, k in objs.items() if k not in ("other", "counter")}
                         if cls.__name__ != "DummyLayer" else {})
    return out
