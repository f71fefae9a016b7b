"""The cache objects of a transformers model, named in kvcheck's vocabulary, and planted faults.

Owns the mapping from transformers' per-layer cache attributes onto kvcheck's five object kinds
(spec/objects.py ``OBJECT_KINDS``), the per-object comparison of two caches, and the faults a
restored snapshot can be corrupted with (the planted bugs of a reuse path).
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

from kvcheck.spec.faults import Fault
from kvcheck.spec.objects import OBJECT_KINDS
from .models import AdapterError


def _fault(name: str, bug_class: str, doc: str) -> Fault:
    return Fault(name, "transformers", "transformers:restored cache snapshot", bug_class,
                 "a reuse path that restores a corrupted or incomplete cache", "divergent", doc,
                 ("transformers",))


DROP_WINDOW_POSITION = _fault("drop_window_position", "window not covering needed positions",
                              "a restored sliding-window cache loses one position inside the window")
PERTURB_KEY = _fault("perturb_key", "placeholder or corrupt data served as a hit",
                     "one cached key of a restored snapshot is perturbed")
CROP_KEEPS_STALE = Fault("crop_keeps_stale", "transformers", "transformers:Cache.crop (draft roll-back)",
                         "window not covering needed positions",
                         "a roll-back of a sliding-window cache that keeps the rejected drafts", "divergent",
                         "rolling a sliding layer back keeps the tail of its un-cropped keys: the rejected drafts "
                         "stay in the window and the oldest positions it should restore are lost (a restore "
                         "without a crop is untouched, so only the assisted-decoding scenarios can see it)",
                         ("transformers",))
SHARED_COPY_ALIASES = Fault("shared_copy_aliases", "transformers", "transformers:copy of a shared prompt cache",
                            "state shared between requests", "a prompt-cache copy that shares state with the "
                            "original", "divergent",
                            "a copy of the prompt cache shares one layer's state with the original (a copy whose "
                            "tensors alias it): continuing the copy changes the prompt cache, so the next request "
                            "copies a grown cache; a single restore and continue is unaffected (paths.py)",
                            ("transformers",))
GENERATE_STALE_PREFIX = Fault("generate_stale_prefix", "transformers", "transformers:cache handed to generate()",
                              "placeholder or corrupt data served as a hit", "a prompt cache of another prompt "
                              "served to generate()", "divergent",
                              "the cache handed to generate() holds, in one layer, the entries of a prompt whose "
                              "last prefix token differs (a stale entry of the same length); only generate_continue "
                              "hands a cache to generate (paths.py)", ("transformers",))
PAD_ROWS_SWAPPED = Fault("pad_rows_swapped", "transformers", "transformers:batched cache (left padding)",
                         "state shared between requests", "rows of a batched cache misaligned", "divergent",
                         "after the prefill of a left-padded batch, one layer's cache rows 0 and 1 are swapped: "
                         "each row continues with another prompt's entries; only batched_left_pad runs a batch "
                         "(paths.py)", ("transformers",))
PATH_FAULTS = (SHARED_COPY_ALIASES.name, GENERATE_STALE_PREFIX.name, PAD_ROWS_SWAPPED.name)   # paths.py plants them
TRANSFORMERS_FAULTS: tuple[Fault, ...] = (DROP_WINDOW_POSITION, PERTURB_KEY, CROP_KEEPS_STALE, SHARED_COPY_ALIASES,
                                          GENERATE_STALE_PREFIX, PAD_ROWS_SWAPPED)
SLIDING_FAULTS = (DROP_WINDOW_POSITION.name, CROP_KEEPS_STALE.name)      # need a sliding-window layer
FAULTS = tuple(f.name for f in TRANSFORMERS_FAULTS)      # NAME or NAME@LAYER on the command line
# Recurrent / SSM state is a fixed-size summary of every token before L: none of the five kinds
# (it is usable at exactly L and nowhere else); it is named as what it is.
RECURRENT = "recurrent_state"
KINDS = OBJECT_KINDS + (RECURRENT, "counter", "other")
_COUNTERS = ("cumulative_length", "entry_count")


def kind_of(layer, attr: str, key: Any) -> str:
    """kvcheck's kind for one cache attribute. Full-attention KV is a window that never slides
    (spec/config.py); a conv state holds the raw inputs of the last kernel-1 positions: a window."""
    if attr in ("keys", "values", "conv_states"):
        return "swa_window"
    if attr == "compressed_kv":
        return "indexer" if key == "indexer" else "compressed_kv"
    if attr in ("buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate"):
        return "indexer" if key == "indexer" else "tail"
    if attr.startswith("indexer"):
        return "indexer"
    if attr in ("recurrent_states", "ssm_states"):
        return RECURRENT
    if attr in _COUNTERS:
        return "counter"
    return "other"
def objects(layer) -> dict[str, tuple[str, Any]]:
    """``name -> (kind, tensor|int)`` for every cached state object of one cache layer."""
    import torch

    out: dict[str, tuple[str, Any]] = {}
    for attr, val in vars(layer).items():
        if attr.startswith("_"):
            continue
        if torch.is_tensor(val) and val.dim() > 0:
            out[attr] = (kind_of(layer, attr, None), val)
        elif isinstance(val, (list, tuple)):
            for k, v in enumerate(val):
                if torch.is_tensor(v) and v.dim() > 0:
                    out[f"{attr}[{k}]"] = (kind_of(layer, attr, k), v)
        elif isinstance(val, dict):
            for k, v in val.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    out[f"{attr}[{k}]"] = (kind_of(layer, attr, k), v)
                elif attr in _COUNTERS and isinstance(v, int):
                    out[f"{attr}[{k}]"] = ("counter", v)
        elif attr in _COUNTERS and isinstance(val, int) and not isinstance(val, bool):
            out[attr] = ("counter", val)
    return out


def cache_layers(cache) -> list:
    return list(getattr(cache, "layers", []))


def _diff_tensors(a, b) -> tuple[float, float, bool]:
    """(max |a-b|, max |b|, shape_mismatch) aligning on the trailing part of one differing dim."""
    a = a.detach().double()
    b = b.detach().double()
    mismatch = tuple(a.shape) != tuple(b.shape)
    if mismatch:
        if a.dim() != b.dim():
            return math.inf, float(b.abs().max()) if b.numel() else 0.0, True
        for d in range(a.dim()):
            n = min(a.shape[d], b.shape[d])
            a = a.narrow(d, a.shape[d] - n, n)
            b = b.narrow(d, b.shape[d] - n, n)
    if a.numel() == 0:
        return (math.inf if mismatch else 0.0), 0.0, mismatch
    return float((a - b).abs().max()), float(b.abs().max()), mismatch


def compare_caches(got, ref) -> list[dict[str, Any]]:
    """Per layer and object: max abs diff of ``got`` against ``ref`` (both transformers caches)."""
    rows = []
    gl, rl = cache_layers(got), cache_layers(ref)
    for i in range(max(len(gl), len(rl))):
        go = objects(gl[i]) if i < len(gl) else {}
        ro = objects(rl[i]) if i < len(rl) else {}
        for name in sorted(set(go) | set(ro)):
            if name not in go or name not in ro:
                kind = (go.get(name) or ro.get(name))[0]
                rows.append(dict(layer=i, object=name, kind=kind, max_abs_diff=math.inf, scale=0.0,
                                 shape_mismatch=True, missing="reused" if name not in go else "recomputed"))
                continue
            kind, gv = go[name]
            _, rv = ro[name]
            if kind == "counter":
                d = float(abs(gv - rv))
                rows.append(dict(layer=i, object=name, kind=kind, max_abs_diff=d, scale=1.0, shape_mismatch=False))
                continue
            d, s, mm = _diff_tensors(gv, rv)
            rows.append(dict(layer=i, object=name, kind=kind, max_abs_diff=d, scale=s, shape_mismatch=mm))
    return rows



class CacheFault:
    """Corrupts a restored cache snapshot: the planted bug of a reuse path.

    ``drop_window_position``: one position inside a sliding-window layer's cached window is
    dropped; the older positions shift up by one and the oldest slot repeats, so the tensor keeps
    the shape the attention mask expects (what a lost/misplaced window page looks like).
    ``perturb_key``: one cached key (one position, all heads) of one layer is perturbed.
    ``crop_keeps_stale``: a restore is untouched; every crop that removes tokens leaves the
    sliding layer holding the tail of its un-cropped keys (`on_crop`, assist.py).
    """

    def __init__(self, name: str, layer: int, rng: random.Random):
        self.name, self.layer, self.rng = name, layer, rng

    @staticmethod
    def eligible(name: str, cache) -> list[int]:
        out = []
        for i, layer in enumerate(cache_layers(cache)):
            keys = getattr(layer, "keys", None)
            if keys is None or not hasattr(keys, "shape") or keys.dim() < 2:
                continue
            if name in SLIDING_FAULTS and not getattr(layer, "is_sliding", False):
                continue
            out.append(i)
        return out

    def apply(self, cache, source=None) -> dict[str, Any]:
        """Corrupt ``cache``, restored from the snapshot ``source``; the faults of a reuse path
        (paths.py) touch a restore only where that is their point: ``shared_copy_aliases`` makes
        the restore share the fault layer with ``source``."""
        import torch

        if self.name in PATH_FAULTS:
            if self.name == SHARED_COPY_ALIASES.name and source is not None:
                return dict(applied=share_layer(cache, source, self.layer), shares_with="snapshot")
            return dict(applied=False, reason=f"{self.name} corrupts a reuse path (paths.py), not a restored snapshot")
        layer = cache_layers(cache)[self.layer]
        keys, values = layer.keys, layer.values
        n = keys.shape[-2]
        shared = values is keys
        if self.name == DROP_WINDOW_POSITION.name:
            if n < 2:
                return dict(applied=False, reason=f"window holds {n} position(s)")
            j = self.rng.randrange(1, n)
            idx = torch.tensor([0] + list(range(j)) + list(range(j + 1, n)), device=keys.device)
            layer.keys = keys.index_select(-2, idx)
            layer.values = layer.keys if shared else values.index_select(-2, idx)
            first = getattr(layer, "cumulative_length", n) - n
            return dict(applied=True, position=int(first + j), slot=j)
        if self.name == PERTURB_KEY.name:
            if n < 1:
                return dict(applied=False, reason="no cached key")
            j = self.rng.randrange(n)
            new = keys.clone()
            scale = float(keys.detach().float().abs().max()) or 1.0
            g = torch.Generator().manual_seed(self.rng.randrange(2**31))
            noise = torch.randn(new[..., j, :].shape, generator=g).to(new.dtype)
            new[..., j, :] = new[..., j, :] + 2.0 * scale * noise
            layer.keys = new
            if shared:
                layer.values = new
            first = getattr(layer, "cumulative_length", n) - n
            return dict(applied=True, position=int(first + j), slot=j)
        if self.name == CROP_KEEPS_STALE.name:
            return dict(applied=False, reason="crop_keeps_stale corrupts a crop, not a restored snapshot")
        raise AdapterError(f"unknown fault {self.name!r}; known: {', '.join(FAULTS)}")

    def on_crop(self, cache, crop) -> bool:
        """Run ``crop()`` (the release's own crop of ``cache``); with ``crop_keeps_stale``, then put
        the fault layer's keys/values back as the tail of what it held before, of the length the
        crop left (the rejected drafts kept, the oldest restored positions lost). True if changed."""
        layers = cache_layers(cache)
        layer = layers[self.layer] if self.name == CROP_KEEPS_STALE.name and self.layer < len(layers) else None
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        crop()
        if keys is None or not hasattr(keys, "shape") or keys.dim() < 2 or layer.keys is None:
            return False
        n = layer.keys.shape[-2]
        if n == 0 or n >= keys.shape[-2] or layer.keys is keys:
            return False
        stale = keys[..., -n:, :]
        if bool((stale == layer.keys).all()):
            return False
        layer.keys, layer.values = stale, (stale if values is keys else values[..., -n:, :])
        return True


def share_layer(copy_, original, layer: int) -> bool:
    """``shared_copy_aliases``: layer ``layer`` of ``copy_`` becomes the very layer object of
    ``original`` (its tensors shared). True if it was a different object."""
    a, b = cache_layers(copy_), cache_layers(original)
    if layer >= min(len(a), len(b)) or a[layer] is b[layer]:
        return False
    copy_.layers[layer] = b[layer]
    return True


def select_row(cache, row: int):
    """A copy of ``cache`` restricted to batch row ``row`` (None if the API does not allow it)."""
    try:
        import torch

        c = copy.deepcopy(cache)
        idx = torch.tensor([row])
        for layer in cache_layers(c):
            for attr, val in list(vars(layer).items()):
                if torch.is_tensor(val) and val.dim() > 0 and val.shape[0] == 3:
                    setattr(layer, attr, val.index_select(0, idx))
                elif isinstance(val, dict):
                    for k, v in val.items():
                        if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == 3:
                            val[k] = v.index_select(0, idx)
        return c
    except Exception:  # noqa: BLE001 - calibration of cache objects is best effort
        return None


