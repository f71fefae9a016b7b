"""Consistency rules for a derived tiny config: the relations the default config holds between
its fields (layer counts that partition the layers, head dims that are a size over a head count,
per-layer tables, one layer of every kind) still hold after every field was shrunk.

Generic by field name and by the default config's own values; nothing here is keyed on a model type.
"""

from __future__ import annotations

import re
from typing import Any

ATTN_KINDS = re.compile(r"attention|^attn$|^global$|^local$|^hybrid")
LAYER_COUNT = re.compile(r"^(n|num)_\w+_layers$")
EXPERT_GROUPS = re.compile(r"^(n|num)_(expert_)?groups?$")
HEAD_DIM = re.compile(r"(head_dim|headdim|kv_channels)$")
HEAD_COUNTS = ("num_attention_heads", "n_heads", "num_heads")
ATTN_INDEX_LIST = re.compile(r"^(attn|attention)\w*_layer_(indices|ids|idxs)$")


def period(rows: list) -> int:
    """The smallest p such that the pattern repeats every p layers, at least twice (else its length)."""
    n = len(rows)
    for p in range(1, n // 2 + 1):
        if all(rows[i] == rows[i % p] for i in range(n)):
            return p
    return n


def scale_layer_counts(d: dict[str, Any], n_old: int, n_new: int, fixed=()) -> dict[str, Any]:
    """Counts of layers of one role (``n_input_layers``, ``num_dense_layers``, ...) scaled to the kept
    layers (fewer, or more for a longer layer pattern); counts that partition the layers keep
    partitioning them (largest remainder)."""
    fields = {k: v for k, v in d.items() if LAYER_COUNT.match(k) and isinstance(v, int) and not isinstance(v, bool)
              and 0 < v < n_old and k != "num_hidden_layers" and k not in fixed}
    if not fields or n_new == n_old:
        return {}
    if sum(fields.values()) == n_old:  # a partition: keep every role, sum = n_new
        share = {k: v * n_new / n_old for k, v in fields.items()}
        out = {k: max(1, int(s)) for k, s in share.items()}
        for k in sorted(share, key=lambda k: share[k] - int(share[k]), reverse=True):
            if sum(out.values()) >= n_new:
                break
            out[k] += 1
        while sum(out.values()) > n_new and max(out.values()) > 1:
            big = max(out, key=out.get)
            out[big] -= 1
        return out
    return {k: min(n_new, max(1, round(v * n_new / n_old))) for k, v in fields.items()}


def relations(d: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    """Fields the default derives from others, re-derived from the shrunk ones: expert groups that
    must divide the expert count, head dims that are a size over a head count (never 0), sizes that
    are a multiple of the hidden size, head/group counts that equal the attention heads."""
    out: dict[str, Any] = {}
    new = {**d, **p}
    for k, v in d.items():
        if isinstance(v, bool) or not isinstance(v, int):
            continue
        if EXPERT_GROUPS.match(k) and v > 1 and k not in ("n_groups", "mamba_n_groups"):
            out[k] = 1
    hid, new_hid = d.get("hidden_size"), new.get("hidden_size")
    if isinstance(hid, int) and isinstance(new_hid, int) and hid > 0:
        for k, v in d.items():
            if (k != "hidden_size" and "hidden_size" in k and "per_layer" not in k and isinstance(v, int)
                    and not isinstance(v, bool) and v > new_hid and v % hid == 0 and v // hid <= 4):
                out[k] = new_hid * (v // hid)
    new = {**new, **out}
    heads = next((h for h in HEAD_COUNTS if isinstance(d.get(h), int) and d[h] > 0), None)
    if heads is not None:
        for k, v in d.items():
            if (isinstance(v, int) and not isinstance(v, bool) and k != heads and v == d[heads]
                    and re.search(r"(query_groups|_heads)$", k) and k not in p):
                out[k] = new[heads]
        for k, v in d.items():
            if (not (HEAD_DIM.search(k) and isinstance(v, int) and not isinstance(v, bool))
                    or k.startswith(("qk_", "v_"))):
                continue
            for size in ("attention_hidden_size", "hidden_size"):
                if isinstance(d.get(size), int) and d[size] == v * d[heads] and isinstance(new.get(size), int):
                    out[k] = max(1, new[size] // new[heads])
                    break
    new = {**new, **out}
    dims = {k: v for k, v in d.items() if HEAD_DIM.search(k) and isinstance(v, int) and not isinstance(v, bool)
            and v > 0}
    for k, v in dims.items():  # a head dim that is the sum of two others (nope + rope) stays their sum
        if k.startswith("v_"):
            continue
        pair = next(((a, b) for a in dims for b in dims if "nope" in a and "rope" in b and k not in (a, b)
                     and dims[a] + dims[b] == v), None)
        if pair and all(isinstance(new.get(x), int) for x in pair):
            out[k] = new[pair[0]] + new[pair[1]]
    return out


def attention_kept(d: dict[str, Any], p: dict[str, Any], n_new: int) -> dict[str, Any]:
    """A model whose class can attend but whose default layers are all recurrent/linear gets its last
    layer as full attention: its cache needs one attention layer to know the sequence length."""
    if not isinstance(d.get("num_attention_heads"), int) or n_new < 2:
        return {}
    out: dict[str, Any] = {}
    for key in ("layer_types", "layers_block_type"):
        lt = p.get(key, d.get(key))
        if isinstance(lt, list) and len(lt) == n_new and all(isinstance(x, str) for x in lt):
            if not any(ATTN_KINDS.search(x) and x != "linear_attention" for x in lt):
                out[key] = lt[:-1] + ["full_attention"]
            return out
    for k, v in d.items():
        if ATTN_INDEX_LIST.match(k) and not v:
            out[k] = [n_new - 1]
    return out


def per_layer_tables(d: dict[str, Any], keep: list[int], shrink, p: dict[str, Any]) -> dict[str, Any]:
    """Dicts keyed by layer index (``per_layer_config``, entries that override the top-level fields):
    re-keyed to the kept layers, each entry shrunk, its head dims re-derived with the top level's."""
    out: dict[str, Any] = {}
    pos = {old: new for new, old in enumerate(keep)}
    for k, v in d.items():
        if not (isinstance(v, dict) and v and all(str(x).isdigit() for x in v)
                and all(isinstance(e, dict) for e in v.values())):
            continue
        width = len(str(next(iter(v))))
        table = {}
        for idx, entry in v.items():
            if int(idx) in pos:
                small = {**entry, **{f: x for f, x in shrink(entry).items() if f in entry}}
                top = {**d, **p, **small}
                small.update({f: x for f, x in relations({**d, **entry}, top).items()
                              if HEAD_DIM.search(f) and x != top.get(f)})
                table[str(pos[int(idx)]).zfill(width)] = small
        out[k] = table
    return out


def rope_per_kind(d: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    """An empty RoPE table gets default parameters per kept layer kind (a model that reads
    ``rope_parameters[layer_type]`` cannot be built without them); tried as a fill."""
    rope, lt = d.get("rope_parameters"), p.get("layer_types", d.get("layer_types"))
    if rope != {} or not isinstance(lt, list):
        return {}
    kinds = [x for x in dict.fromkeys(lt) if isinstance(x, str)]
    return {"rope_parameters": {k: {"rope_type": "default", "rope_theta": 10000.0} for k in kinds}}


NONE_FILLS = {"indexer_kv_heads": 1}


def none_fills(d: dict[str, Any], sizes: dict, granularity: dict, patterns) -> dict[str, Any]:
    """Size and granularity fields the default leaves None (set by released checkpoints): a small
    value, tried when the config as derived does not build."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if v is not None:
            continue
        if k in NONE_FILLS:
            out[k] = NONE_FILLS[k]
        elif k in sizes and sizes[k] is not None and not k.endswith("lora_rank"):
            out[k] = sizes[k]
        elif k in granularity:
            out[k] = granularity[k]
        elif "lora" not in k and any(rx.search(k) for rx, _ in patterns):
            out[k] = next(s for rx, s in patterns if rx.search(k))
        elif k == "head_dim":
            out[k] = 16
    return out


FAST_KERNELS = re.compile(r"^use_(\w+_)?kernels?$")


def cpu_paths(d: dict[str, Any]) -> dict[str, Any]:
    """Switch off flags that ask for fused CUDA kernels (`use_mamba_kernels`): their config docs say
    to set them False where the kernels or a CUDA device are missing, as on kvcheck's CPU (Jamba
    5.0-5.1 refuses to build otherwise); the reference PyTorch path is what runs."""
    return {k: False for k, v in d.items() if v is True and FAST_KERNELS.match(k)}
