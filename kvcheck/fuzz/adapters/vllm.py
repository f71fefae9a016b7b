"""Check vLLM's real (v1, hybrid) KV cache manager against the kvcheck spec.

vLLM's ``KVCacheManager`` (hybrid coordinator + per-type managers + block pool) is pure Python
and runs on CPU. This adapter drives it through seeded random operation sequences (submit,
lookup = ``get_computed_blocks`` + admission ``allocate_slots``, chunked prefill and decode =
``allocate_slots``, finish/preempt = ``free``, ``reset_prefix_cache``, connector
``evict_blocks``; eviction happens by itself under a small ``num_blocks``) and checks after
every step:

* **safety** of every hit: aligned, ``<= tokens - 1``, equal length across groups, and every
  block the resume reads (ground truth: ``kvcheck.spec.objects.needed_objects`` on a
  ``Config`` derived from the layout) is non-null and *holds the right content*. Content is
  tracked by a shadow model independent of vLLM's hashes: every block a request writes is
  stamped with the exact token prefix (and cache salt) it was computed from.
* **bookkeeping**: ref count = holders, free queue iff unreferenced, free count = queue length,
  null block inert, no block shared unless complete and identical, every published hash maps
  to a block with that content, running requests' windows never overwritten.
* **lost reuse**: the longest hit the spec allows from the cached-block map vs vLLM's hit.

``vllm`` is imported lazily; without it :class:`VllmUnavailable` is raised.
Entry points: :data:`LAYOUTS`, :data:`FAULTS`, :func:`run_campaign`, :func:`replay`.
"""
from __future__ import annotations

import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcheck.spec.config import Config, LayerSpec
from kvcheck.spec.objects import needed_objects
from kvcheck.spec.trace import Step, Trace

__all__ = ["LAYOUTS", "FAULTS", "ACTIONS", "VllmUnavailable", "VllmAdapter", "run_campaign",
           "replay", "INSTALL_HINT"]

INSTALL_HINT = ("vLLM is not importable: install it with `bash scripts/install-vllm.sh` "
                "(pip install --no-deps vllm==0.33.0 + requirements-vllm.txt)")
B = 4                 # hash block size (tokens) of every layout
MAX_MODEL_LEN = 64
MAX_TOKENS = 48       # requests never grow past this (max_model_len = 64)
VOCAB = 40

# name -> (description, groups); a group is (kind, block_size, param) with kind in
# full | swa | chunked_local | mla | swa_mla; param = window / chunk size.
_LAYOUTS: dict[str, tuple[str, list[tuple[str, int, int | None]], int]] = {
    "full": ("one full-attention group (Llama-like), block 4",
             [("full", 4, None)], 4),
    "full+swa": ("full + sliding window W=6 (Gemma-like), block 4",
                 [("full", 4, None), ("swa", 4, 6)], 4),
    "full+chunked_local": ("full + chunked local attention C=8 (Llama-4-like), block 4",
                           [("full", 4, None), ("chunked_local", 4, 8)], 4),
    "mla+swa_mla": ("MLA + sliding-window MLA W=6 (DeepSeek-V4 SWA branch), block 4",
                    [("mla", 4, None), ("swa_mla", 4, 6)], 4),
    "mixed_block": ("full block 8 + SWA W=6 block 4: scheduler block 8 (LCM), hash block 4 (GCD)",
                    [("full", 8, None), ("swa", 4, 6)], 8),
    "full+swa+swa": ("full + two sliding windows W=6 and W=11 (3 groups, fixed-point lookup)",
                     [("full", 4, None), ("swa", 4, 6), ("swa", 4, 11)], 4),
    "dsv4": ("DeepSeek-V4-like: SWA-MLA W=8 + CSA compressed MLA (m=4) + its sparse indexer (m=4) "
             "+ HCA compressed MLA (m=16, block 16) + compressor tail ring (not cacheable)",
             [("swa_mla", 4, 8), ("compressed", 4, 4), ("indexer", 4, 4), ("compressed", 16, 16),
              ("tail_ring", 8, None)], 16),
}
# Sparse prefix-cache retention (KVCacheConfig.prefix_cache_retention_interval = 0): sliding-window
# groups only keep the blocks a reachable boundary (replay point, shared-prefix junction) needs.
_RETENTION: dict[str, int] = {}
for _base in ("full+swa", "mixed_block"):
    _d, _g, _s = _LAYOUTS[_base]
    _LAYOUTS[f"{_base}-sparse"] = (f"{_d}; sparse SWA retention (prefix_cache_retention_interval=0)", _g, _s)
    _RETENTION[f"{_base}-sparse"] = 0
LAYOUTS: dict[str, str] = {k: v[0] for k, v in _LAYOUTS.items()}

# fault -> (expected check, description)
FAULTS: dict[str, tuple[str, str]] = {
    "drop_ref_on_free": ("refcount_equals_holders",
                         "free() drops one extra reference of a block still shared by another request"),
    "swa_hit_unchecked": ("hit_sound_swa_window",
                          "sliding-window lookup accepts a hit after checking only its last block "
                          "(window coverage unchecked)"),
    "evict_keeps_hash": ("hash_map_sound",
                         "reusing a free cached block does not remove its hash from the prefix-cache map"),
    "swa_overstrict": ("lost_reuse",
                       "sliding-window lookup demands one more contiguous block than the window needs"),
}
_SWA_FAULTS = {"swa_hit_unchecked", "swa_overstrict"}

# The mapped actions (every one must be exercised by a campaign).
ACTIONS = ("submit", "lookup", "prefill", "decode", "finish", "preempt", "reset_prefix_cache",
           "evict_blocks")
SAFETY_CHECKS = ("hit_aligned", "hit_leaves_last_token", "hit_length_equal",
                 "hit_sound_swa_window", "hit_sound_chunked_local", "hit_sound_compressed_kv",
                 "hit_sound_indexer", "hit_sound_tail")
BOOKKEEPING_CHECKS = ("refcount_equals_holders", "free_queue_iff_unreferenced", "free_count",
                      "null_block_inert", "no_alias", "hash_map_sound", "toctou_bound_stable")


class VllmUnavailable(Exception):
    """vLLM cannot be imported (one-line install hint)."""


class ActionRejected(Exception):
    """The action is not enabled in the current state (replay of a foreign trace)."""


@dataclass
class Violation(Exception):
    kind: str       # safety | bookkeeping | divergence | lost_reuse
    check: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind}/{self.check}: {self.message}"


_V: dict[str, Any] = {}


def _vllm() -> dict[str, Any]:
    """Import the vLLM pieces lazily (about 8 s the first time)."""
    if _V:
        return _V
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import logging
    logging.getLogger("vllm").setLevel(logging.ERROR)
    try:
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils as ku
        from vllm.v1.core import single_type_kv_cache_manager as stm
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, CircularBufferSpec,
                                                FullAttentionSpec, SparseCacheRole,
                                                KVCacheConfig, KVCacheGroupSpec,
                                                MLAAttentionSpec, SlidingWindowMLASpec,
                                                SlidingWindowSpec)
        from vllm.v1.request import Request, RequestStatus
    except Exception as e:  # ImportError, or a broken install
        raise VllmUnavailable(f"{INSTALL_HINT} ({type(e).__name__}: {e})".splitlines()[0]) from None
    ku.init_none_hash(sha256)
    _V.update(torch=torch, version=vllm.__version__, SamplingParams=SamplingParams, sha256=sha256,
              ku=ku, stm=stm, KVCacheManager=KVCacheManager, Request=Request,
              RequestStatus=RequestStatus, FullAttentionSpec=FullAttentionSpec,
              SlidingWindowSpec=SlidingWindowSpec, ChunkedLocalAttentionSpec=ChunkedLocalAttentionSpec,
              MLAAttentionSpec=MLAAttentionSpec, SlidingWindowMLASpec=SlidingWindowMLASpec,
              KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec,
              CircularBufferSpec=CircularBufferSpec, SparseCacheRole=SparseCacheRole)
    return _V


def vllm_version() -> str:
    return _vllm()["version"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layout_configs(layout: str) -> dict[int | None, Config]:
    """The spec Configs whose groups give the ground truth, keyed by sliding window (None when
    the layout has none). The spec allows one window per config, so a layout with several
    windows gets one config per window (full + that swa). Chunked local has no spec kind: it is
    checked by the adapter's own rule and left out."""
    if layout == "dsv4":   # the spec's view: swa + csa (m=4, indexer) + hca (m=16)
        layers = (LayerSpec("swa", window=8), LayerSpec("csa", window=8, m=4, topk=1),
                  LayerSpec("hca", window=8, m=16))
        return {8: Config(layers=layers, block_size=B, page_tokens={"hca": 16})}
    full, swas = [], {}
    for kind, bs, p in _LAYOUTS[layout][1]:
        if kind in ("full", "mla"):
            full.append(bs)
        elif kind in ("swa", "swa_mla"):
            swas.setdefault(p, bs)
    out: dict[int | None, Config] = {}
    for w in (list(swas) or [None]):
        layers = [LayerSpec("full")] if full else []
        page = {"full": full[0]} if full else {}
        if w is not None:
            layers.append(LayerSpec("swa", window=w))
            page["swa"] = swas[w]
        page = {k: v for k, v in page.items() if v != B}
        out[w] = Config(layers=tuple(layers), block_size=B, page_tokens=page)
    return out


def layout_config(layout: str) -> Config:
    """The spec Config written into traces (the first of `layout_configs`)."""
    return next(iter(layout_configs(layout).values()))


def _make_specs(layout: str) -> list:
    V = _vllm()
    torch = V["torch"]
    common = dict(num_kv_heads=1, head_size=8, dtype=torch.float32)
    out = []
    for kind, bs, p in _LAYOUTS[layout][1]:
        if kind == "full":
            out.append(V["FullAttentionSpec"](block_size=bs, **common))
        elif kind == "swa":
            out.append(V["SlidingWindowSpec"](block_size=bs, sliding_window=p, **common))
        elif kind == "chunked_local":
            out.append(V["ChunkedLocalAttentionSpec"](block_size=bs, attention_chunk_size=p, **common))
        elif kind == "mla":
            out.append(V["MLAAttentionSpec"](block_size=bs, num_kv_heads=1, head_size=16,
                                             dtype=torch.float32))
        elif kind == "swa_mla":
            out.append(V["SlidingWindowMLASpec"](block_size=bs, sliding_window=p, num_kv_heads=1,
                                                 head_size=16, dtype=torch.float32,
                                                 **({"model_version": "deepseek_v4"} if layout == "dsv4" else {})))
        elif kind in ("compressed", "indexer"):
            extra = {"cache_role": V["SparseCacheRole"].INDEXER} if kind == "indexer" else {}
            out.append(V["MLAAttentionSpec"](block_size=bs, num_kv_heads=1, head_size=16,
                                             dtype=torch.float32, tokens_per_state=p,
                                             model_version="deepseek_v4", **extra))
        elif kind == "tail_ring":
            out.append(V["CircularBufferSpec"](block_size=bs, num_kv_heads=1, head_size=16,
                                               head_size_v=0, dtype=torch.float32))
    return out


@dataclass
class _Req:
    rid: str
    obj: Any                  # vllm Request
    salt: str | None
    state: str = "waiting"    # waiting | running | preempted
    owned: list[set[int]] = field(default_factory=list)   # per group: blocks this request wrote


class VllmAdapter:
    """vLLM's KVCacheManager behind kvcheck's adapter shape: reset / apply / observe."""

    name = "vllm"

    def __init__(self, layout: str, num_blocks: int = 24, fault: str | None = None) -> None:
        if layout not in _LAYOUTS:
            raise ValueError(f"unknown vLLM layout {layout!r}; known: {', '.join(LAYOUTS)}")
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown vLLM fault {fault!r}; known: {', '.join(FAULTS)}")
        groups = _LAYOUTS[layout][1]
        if fault in _SWA_FAULTS and not any(k in ("swa", "swa_mla") for k, _, _ in groups):
            raise ValueError(f"fault {fault!r} needs a layout with a sliding-window group")
        self.layout, self.num_blocks, self.fault = layout, num_blocks, fault
        self.groups = groups
        self.sched_bs = _LAYOUTS[layout][2]
        self.cfgs = layout_configs(layout)
        self.cfg = next(iter(self.cfgs.values()))
        self.reset()

    # ---- construction ------------------------------------------------------------------
    def reset(self, cfg: Config | None = None) -> None:
        V = _vllm()
        specs = _make_specs(self.layout)
        kcfg = V["KVCacheConfig"](num_blocks=self.num_blocks, kv_cache_tensors=[],
                                  kv_cache_groups=[V["KVCacheGroupSpec"]([f"layer{i}"], s)
                                                   for i, s in enumerate(specs)],
                                  prefix_cache_retention_interval=_RETENTION.get(self.layout))
        self.mgr = V["KVCacheManager"](kcfg, max_model_len=MAX_MODEL_LEN,
                                       scheduler_block_size=self.sched_bs, hash_block_size=B)
        self.pool = self.mgr.block_pool
        self.coord = self.mgr.coordinator
        self.align = int(getattr(self.coord, "_cache_hit_alignment_tokens", self.sched_bs))
        self.hasher = V["ku"].get_request_block_hasher(B, V["sha256"])
        self.reqs: dict[str, _Req] = {}
        self.written: dict[int, tuple] = {}        # block id -> (salt, token prefix) written there
        self.hash_content: dict[bytes, tuple] = {}  # hash -> (salt, token prefix) it fingerprints
        self.next_id = 0
        self.coverage: Counter = Counter()
        self.lost: list[Violation] = []
        self._plant()

    def _plant(self) -> None:
        f = self.fault
        if f in _SWA_FAULTS:
            SWM = _vllm()["stm"].SlidingWindowManager
            extra = 1 if f == "swa_overstrict" else None

            class FaultySWA(SWM):  # type: ignore[misc, valid-type]
                @classmethod
                def _contiguous_blocks_for_hit(cls, window_size, block_size, use_eagle):
                    if extra is None:
                        return 1
                    return super()._contiguous_blocks_for_hit(window_size, block_size, use_eagle) + extra

            groups = getattr(self.coord, "attention_groups", None)
            if groups is None:
                raise ValueError(f"fault {f!r} needs a hybrid layout")
            self.coord.attention_groups = [
                g._replace(manager_cls=FaultySWA) if issubclass(g.manager_cls, SWM) else g
                for g in groups]
        elif f == "evict_keeps_hash":
            pool = self.pool

            def keep_map_entry(block) -> bool:   # forget the block's hash, keep the map entry
                pool.cached_block_hashes_by_block.pop(block.block_id, None)
                block.reset_hash()
                return False

            pool._maybe_evict_cached_block = keep_map_entry

    # ---- the protocol ------------------------------------------------------------------
    def observe(self) -> None:
        """vLLM's state has no mapping onto the spec's state tuple (only its hits and
        bookkeeping are checked), so the abstraction function is partial: None."""
        return None

    def enabled(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {a: [] for a in ACTIONS}
        for rid, r in self.reqs.items():
            if r.state in ("waiting", "preempted"):
                out["lookup"].append(rid)
            else:
                rem = r.obj.num_tokens - r.obj.num_computed_tokens
                if rem > 1:
                    out["prefill"].append(rid)
                elif r.obj.num_tokens < MAX_TOKENS:
                    out["decode"].append(rid)
                out["finish"].append(rid)
                out["preempt"].append(rid)
        return out

    def apply(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        fn = getattr(self, f"_a_{action}", None)
        if fn is None or action not in ACTIONS:
            raise ActionRejected(f"unknown vLLM adapter action {action!r}")
        try:
            obs = fn(**params) or {}
        except TypeError as e:
            if "argument" in str(e) and "_a_" in str(e):
                raise ActionRejected(f"bad parameters for {action}: {e}") from None
            raise Violation("bookkeeping", "vllm_internal_error", f"vLLM raised TypeError: {e}") from None
        except (AssertionError, ValueError, KeyError, IndexError) as e:
            raise Violation("bookkeeping", "vllm_internal_error",
                            f"vLLM raised {type(e).__name__}: {e}") from None
        self.coverage[action] += 1
        self._after_step()
        return obs

    # ---- actions -----------------------------------------------------------------------
    def _get(self, r: str, states: tuple[str, ...]) -> _Req:
        req = self.reqs.get(r)
        if req is None or req.state not in states:
            raise ActionRejected(f"request {r} is not {'/'.join(states)}")
        return req

    def _a_submit(self, tokens: list[int], salt: str | None = None, r: str | None = None) -> dict:
        V = _vllm()
        rid = r or f"r{self.next_id}"
        if rid in self.reqs:
            raise ActionRejected(f"request {rid} already exists")
        if not 1 <= len(tokens) < MAX_TOKENS:
            raise ActionRejected(f"a request needs 1..{MAX_TOKENS - 1} tokens")
        self.next_id += 1
        obj = V["Request"](rid, list(tokens), V["SamplingParams"](max_tokens=MAX_TOKENS), None,
                           cache_salt=salt, block_hasher=self.hasher)
        self.reqs[rid] = _Req(rid, obj, salt, owned=[set() for _ in self.groups])
        return {"r": rid}

    def _a_lookup(self, r: str, chunk: int) -> dict:
        req = self._get(r, ("waiting", "preempted"))
        o = req.obj
        usable = self.spec_usable(req)
        blocks, hit, junction = self.mgr.get_computed_blocks(o)
        o.shared_prefix_boundary = junction      # as the scheduler does
        self._check_hit(req, blocks, hit)
        obs: dict[str, Any] = {"hit": hit, "usable": usable}
        if hit < usable:
            v = Violation("lost_reuse", "lost_reuse",
                          f"{self.layout}: request {r} ({o.num_tokens} tokens): the spec allows a "
                          f"hit of {usable} tokens from the cached blocks, vLLM returned {hit}")
            self.lost.append(v)
            obs["lost_reuse"] = str(v)
        elif hit > usable:
            raise Violation("divergence", "hit_exceeds_spec",
                            f"vLLM hit {hit} > spec-usable {usable} for {r} although every needed "
                            "block holds the right content (alignment rule differs?)")
        chunk = max(1, min(chunk, o.num_tokens - hit))
        new = self.mgr.allocate_slots(o, chunk, hit, blocks)
        if new is None:
            self.coverage["state:admission_refused"] += 1
            obs["admitted"] = False
            return obs
        self._own(req, new)
        # the admitted table starts with exactly the hit blocks
        for g, lst in enumerate(blocks.blocks):
            table = self._table(g, r)
            # (allocate_slots may already have nulled blocks that fell out of a window)
            if len(table) < len(lst) or any(t.block_id != b.block_id and not t.is_null
                                            for t, b in zip(table, lst)):
                raise Violation("bookkeeping", "hit_blocks_bound",
                                f"group {g}: request {r}'s table does not start with its hit blocks")
        o.status = _vllm()["RequestStatus"].RUNNING
        o.num_computed_tokens = hit + chunk
        req.state = "running"
        self.coverage["state:hit" if hit else "state:miss"] += 1
        self._maybe_sample(req)
        obs["admitted"] = True
        return obs

    def _step(self, req: _Req, n: int, tok: int | None) -> dict:
        new = self.mgr.allocate_slots(req.obj, n)
        if new is None:
            self.coverage["state:alloc_refused"] += 1
            return {"allocated": False}
        self._own(req, new)
        req.obj.num_computed_tokens += n
        self._maybe_sample(req, tok)
        return {"allocated": True}

    def _a_prefill(self, r: str, chunk: int) -> dict:
        req = self._get(r, ("running",))
        rem = req.obj.num_tokens - req.obj.num_computed_tokens
        if rem <= 1:
            raise ActionRejected(f"request {r} has no prompt left to prefill")
        return self._step(req, max(1, min(chunk, rem)), None)

    def _a_decode(self, r: str, tok: int) -> dict:
        req = self._get(r, ("running",))
        if req.obj.num_tokens - req.obj.num_computed_tokens != 1 or req.obj.num_tokens >= MAX_TOKENS:
            raise ActionRejected(f"request {r} cannot decode now")
        return self._step(req, 1, tok)

    def _maybe_sample(self, req: _Req, tok: int | None = None) -> None:
        o = req.obj
        if o.num_computed_tokens == o.num_tokens and o.num_tokens < MAX_TOKENS:
            # the forward produced a token (requests stop growing at MAX_TOKENS < max_model_len)
            o.append_output_token_ids(tok if tok is not None else (o.num_tokens * 7) % VOCAB)

    def _a_finish(self, r: str) -> dict:
        req = self._get(r, ("running",))
        self._free(req)
        del self.reqs[r]
        return {}

    def _a_preempt(self, r: str) -> dict:
        req = self._get(r, ("running",))
        self._free(req)
        o = req.obj
        o.status = _vllm()["RequestStatus"].PREEMPTED
        o.num_computed_tokens = 0
        o.num_preemptions += 1
        req.state = "preempted"
        req.owned = [set() for _ in self.groups]
        return {}

    def _free(self, req: _Req) -> None:
        held = [b for g in range(len(self.groups)) for b in self._table(g, req.rid) if not b.is_null]
        self.mgr.free(req.obj)
        if self.fault == "drop_ref_on_free":
            shared = [b for b in held if b.ref_cnt >= 1]
            if shared:
                shared[0].ref_cnt -= 1

    def _a_reset_prefix_cache(self) -> dict:
        ok = self.mgr.reset_prefix_cache()
        self.coverage["state:reset_ok" if ok else "state:reset_refused"] += 1
        return {"reset": ok}

    def _a_evict_blocks(self, block_ids: list[int]) -> dict:
        ids = {i for i in block_ids if 0 < i < self.num_blocks}
        self.mgr.evict_blocks(ids)
        return {}

    # ---- shadow content model ------------------------------------------------------------
    def _table(self, g: int, rid: str) -> list:
        m = self.coord.single_type_managers[g].req_to_blocks
        return m[rid] if rid in m else []

    def _own(self, req: _Req, new: Any) -> None:
        for g, lst in enumerate(new.blocks):
            req.owned[g].update(b.block_id for b in lst if not b.is_null)

    @staticmethod
    def _content(req: _Req, end: int) -> tuple:
        return (req.salt, tuple(req.obj.all_token_ids[:end]))

    def _after_step(self) -> None:
        for req in self.reqs.values():
            o = req.obj
            for j, h in enumerate(o.block_hashes):
                self.hash_content.setdefault(bytes(h), self._content(req, (j + 1) * B))
            if req.state != "running":
                continue
            for g, (_, bs, _) in enumerate(self.groups):
                for i, b in enumerate(self._table(g, req.rid)):
                    if b.block_id in req.owned[g] and not b.is_null:
                        end = min((i + 1) * bs, o.num_computed_tokens)
                        if end > i * bs:
                            self.written[b.block_id] = self._content(req, end)
        self.check_bookkeeping()

    # ---- ground truth --------------------------------------------------------------------
    def needed_hit(self, g: int, L: int) -> list[int]:
        """Physical blocks of group g that a resume at L (a multiple of B) reads."""
        kind, bs, p = self.groups[g]
        if kind == "chunked_local":   # not a spec layer kind: [C*floor(L/C), L)
            lo = (L // p) * p
            return list(range(lo // bs, _cdiv(L, bs)))
        if kind == "tail_ring":       # not prefix-cacheable: never part of a hit
            return []
        if kind in ("compressed", "indexer"):
            sk = "csa" if p == 4 else "hca"
            sg = next(x for x in self.cfg.groups if x.kind == sk)
            obj = "indexer" if kind == "indexer" else "compressed_kv"
            js = needed_objects(self.cfg, sg, L // B)[obj]
            return sorted({j * B // bs for j in js})
        skind = "full" if kind in ("full", "mla") else "swa"
        cfg = self.cfgs[p] if skind == "swa" else self.cfg
        sg = next(x for x in cfg.groups if x.kind == skind)
        js = needed_objects(cfg, sg, L // B)["swa_window"]
        return sorted({j * B // bs for j in js})

    def needed_running(self, g: int, L: int) -> list[int]:
        """Blocks the next token of a request at L computed tokens reads (token-level rule)."""
        kind, bs, p = self.groups[g]
        if kind == "tail_ring":
            return []
        if kind in ("compressed", "indexer"):   # entries of complete compression blocks
            return list(range(0, (L // p) * p // bs))
        if kind in ("full", "mla"):
            lo = 0
        elif kind == "chunked_local":
            lo = (L // p) * p
        else:
            lo = max(0, L - p + 1)
        return list(range(lo // bs, _cdiv(L, bs)))

    def _check_kind(self, g: int) -> str:
        return {"chunked_local": "hit_sound_chunked_local", "compressed": "hit_sound_compressed_kv",
                "indexer": "hit_sound_indexer"}.get(self.groups[g][0], "hit_sound_swa_window")

    def tail_needed(self, L: int) -> bool:
        """Does a resume at L need a tail snapshot (a compression block open at L)? vLLM keeps
        the open group's raw keys in a per-request ring that is never prefix-cached."""
        return any(needed_objects(self.cfg, sg, L // B).get("tail")
                   for sg in self.cfg.groups if "tail" in sg.objects)

    def _group_hash(self, req: _Req, g: int, i: int) -> bytes | None:
        bs = self.groups[g][1]
        j = (i + 1) * bs // B - 1
        hs = req.obj.block_hashes
        return hs[j] if j < len(hs) else None

    def spec_usable(self, req: _Req) -> int:
        """Longest hit the spec allows: aligned, <= tokens-1, and every needed block of every
        group present in the prefix-cache map with the right content."""
        ku = _vllm()["ku"]
        cache = self.pool.cached_block_hash_to_block
        cap = ((req.obj.num_tokens - 1) // self.align) * self.align
        for L in range(cap, 0, -self.align):
            ok = not self.tail_needed(L)
            for g in range(len(self.groups)):
                for i in self.needed_hit(g, L):
                    h = self._group_hash(req, g, i)
                    blk = cache.get_one_block(ku.make_block_hash_with_group_id(h, g)) if h else None
                    if blk is None or self.written.get(blk.block_id) != self._content(req, (i + 1) * self.groups[g][1]):
                        ok = False
                        break
                if not ok:
                    break
            if ok:
                return L
        return 0

    # ---- checks ----------------------------------------------------------------------------
    def _check_hit(self, req: _Req, blocks: Any, hit: int) -> None:
        r, n = req.rid, req.obj.num_tokens
        if hit % self.align:
            raise Violation("safety", "hit_aligned", f"hit {hit} of {r} not aligned to {self.align}")
        if hit > max(0, n - 1):
            raise Violation("safety", "hit_leaves_last_token", f"hit {hit} of {r} >= its {n} tokens")
        if hit and self.tail_needed(hit):
            raise Violation("safety", "hit_sound_tail",
                            f"hit of {hit} tokens for {r} ends inside a compression block, and vLLM "
                            "caches no tail (the compressor ring is not prefix-cacheable)")
        for g, lst in enumerate(blocks.blocks):
            bs = self.groups[g][1]
            if self.groups[g][0] == "tail_ring":
                if lst:
                    raise Violation("safety", "hit_sound_tail",
                                    f"the non-cacheable compressor ring returned {len(lst)} hit blocks")
                continue
            if len(lst) != hit // bs:
                raise Violation("safety", "hit_length_equal",
                                f"group {g} ({self.groups[g][0]}) returned {len(lst)} blocks of {bs} "
                                f"for a {hit}-token hit")
            need = set(self.needed_hit(g, hit)) if hit else set()
            for i, b in enumerate(lst):
                want = self._content(req, (i + 1) * bs)
                if i in need and b.is_null:
                    raise Violation("safety", self._check_kind(g),
                                    f"{self.layout} group {g} ({self.groups[g][0]}): hit of {hit} tokens "
                                    f"for {r}, but block {i} (tokens {i*bs}..{(i+1)*bs-1}) that the resume "
                                    "reads is the null block")
                if not b.is_null and self.written.get(b.block_id) != want:
                    raise Violation("safety", self._check_kind(g),
                                    f"{self.layout} group {g}: hit of {hit} tokens for {r} returns block "
                                    f"#{b.block_id} at index {i} whose content is not the request's prefix")

    def check_bookkeeping(self) -> None:
        pool = self.pool
        null = pool.null_block
        holders: Counter = Counter()
        where: dict[int, list[tuple[str, int, int]]] = {}
        for g, mgr in enumerate(self.coord.single_type_managers):
            for rid, lst in mgr.req_to_blocks.items():
                for i, b in enumerate(lst):
                    if b.is_null:
                        continue
                    holders[b.block_id] += 1
                    where.setdefault(b.block_id, []).append((rid, g, i))
        free = pool.free_block_queue.get_all_free_blocks()
        free_ids = [b.block_id for b in free]
        if len(free_ids) != pool.get_num_free_blocks():
            raise Violation("bookkeeping", "free_count",
                            f"free queue holds {len(free_ids)} blocks, num_free_blocks says "
                            f"{pool.get_num_free_blocks()}")
        fset = set(free_ids)
        if len(fset) != len(free_ids):
            raise Violation("bookkeeping", "free_queue_iff_unreferenced", "a block is queued twice")
        for b in pool.blocks:
            if b.is_null:
                continue
            if b.ref_cnt != holders[b.block_id]:
                raise Violation("bookkeeping", "refcount_equals_holders",
                                f"block #{b.block_id}: ref_cnt {b.ref_cnt} but {holders[b.block_id]} "
                                f"holder(s) {where.get(b.block_id, [])}")
            if (b.block_id in fset) != (b.ref_cnt == 0):
                raise Violation("bookkeeping", "free_queue_iff_unreferenced",
                                f"block #{b.block_id}: ref_cnt {b.ref_cnt}, in free queue: {b.block_id in fset}")
        if null.block_id in fset or null.block_hash is not None \
                or null.block_id in pool.cached_block_hashes_by_block:
            raise Violation("bookkeeping", "null_block_inert", "the null block is queued or hashed")
        for bid, hs in where.items():
            if len(hs) < 2:
                continue
            for rid, g, i in hs:
                req = self.reqs.get(rid)
                bs = self.groups[g][1]
                if req is None or (i + 1) * bs > req.obj.num_computed_tokens \
                        or self.written.get(bid) != self._content(req, (i + 1) * bs):
                    raise Violation("bookkeeping", "no_alias",
                                    f"block #{bid} is in several tables {hs} but is not a complete "
                                    f"block with identical content for {rid}")
        for key, val in pool.cached_block_hash_to_block._cache.items():
            blks = [val] if not isinstance(val, dict) else list(val.values())
            h = bytes(_vllm()["ku"].get_block_hash(key))
            for b in blks:
                if b.is_null or not (b.block_hash == key or key in pool.cached_block_hashes_by_block.get(b.block_id, ())):
                    raise Violation("bookkeeping", "hash_map_sound",
                                    f"prefix-cache map entry points at block #{b.block_id} that does not carry it")
                want = self.hash_content.get(h)
                w = self.written.get(b.block_id)
                bs = self.groups[_vllm()["ku"].get_group_id(key)][1]
                # The block must hold the hash's prefix, and the hash must end inside the block
                # (vLLM also registers interior hash-block boundaries of a larger block).
                if want is not None and w is not None and not (
                        w[0] == want[0] and len(w[1]) >= len(want[1]) > ((len(w[1]) - 1) // bs) * bs
                        and w[1][:len(want[1])] == want[1]):
                    raise Violation("bookkeeping", "hash_map_sound",
                                    f"a published hash maps to block #{b.block_id}, which now holds other "
                                    "content (stale prefix-cache entry)")
        for req in self.reqs.values():
            if req.state != "running":
                continue
            L = req.obj.num_computed_tokens
            for g, (kind, bs, _) in enumerate(self.groups):
                table = self._table(g, req.rid)
                for i in self.needed_running(g, L):
                    b = table[i] if i < len(table) else None
                    if b is None or b.is_null or self.written.get(b.block_id) != self._content(req, min((i + 1) * bs, L)):
                        raise Violation("bookkeeping", "toctou_bound_stable",
                                        f"running {req.rid} at {L} tokens: group {g} ({kind}) block {i} that "
                                        "its next token reads is missing or overwritten")


# ---- driving -------------------------------------------------------------------------------

class _Gen:
    """Seeded generator of actions (swarm testing: each episode draws its own weights)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.bases = [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(3)]
        self.w = {a: rng.choice([0.3, 1, 2, 4]) for a in ACTIONS}
        self.w["lookup"] *= 2
        self.w["prefill"] *= 2
        self.w["decode"] *= 2

    def next(self, ad: VllmAdapter) -> tuple[str, dict]:
        rng = self.rng
        en = ad.enabled()
        cands = {a: self.w[a] for a, rs in en.items() if rs}
        if len(ad.reqs) < 5:
            cands["submit"] = self.w["submit"] * (3 if not ad.reqs else 1)
        cands["reset_prefix_cache"] = self.w["reset_prefix_cache"] * 0.15
        cands["evict_blocks"] = self.w["evict_blocks"] * 0.2
        acts = list(cands)
        a = rng.choices(acts, [cands[x] for x in acts])[0]
        if a == "submit":
            base = rng.choice(self.bases)
            n = rng.randint(2, 44)
            cut = rng.randint(0, n)
            toks = base[:cut] + [rng.randrange(VOCAB) for _ in range(n - cut)]
            salt = rng.choice([None, None, None, "s1"])
            return a, {"r": f"r{ad.next_id}", "tokens": toks, "salt": salt}
        if a == "reset_prefix_cache":
            return a, {}
        if a == "evict_blocks":
            return a, {"block_ids": [rng.randrange(1, ad.num_blocks) for _ in range(rng.randint(1, 3))]}
        r = rng.choice(en[a])
        if a == "lookup":
            rem = ad.reqs[r].obj.num_tokens
            return a, {"r": r, "chunk": rng.choice([rem, rem, rng.randint(1, max(1, rem))])}
        if a == "prefill":
            o = ad.reqs[r].obj
            rem = o.num_tokens - o.num_computed_tokens
            return a, {"r": r, "chunk": rng.choice([rem, rng.randint(1, rem)])}
        if a == "decode":
            return a, {"r": r, "tok": rng.randrange(VOCAB)}
        return a, {"r": r}


def _execute(layout: str, num_blocks: int, fault: str | None, steps: list[Step],
             strict: bool = False) -> tuple[VllmAdapter, Violation | None, int]:
    """Run steps on a fresh manager; return the adapter, the first violation and its index.
    Steps that are not enabled (possible after shrinking) are skipped."""
    ad = VllmAdapter(layout, num_blocks, fault)
    for i, s in enumerate(steps):
        try:
            ad.apply(s.action, s.params)
        except ActionRejected:
            continue
        except Violation as v:
            return ad, v, i
        except (AssertionError, ValueError, KeyError, IndexError, TypeError) as e:
            return ad, Violation("bookkeeping", "vllm_internal_error",
                                 f"vLLM raised {type(e).__name__}: {e}"), i
        if strict and ad.lost:
            return ad, ad.lost[0], i
    return ad, None, -1


def _shrink(layout: str, num_blocks: int, fault: str | None, steps: list[Step], check: str,
            strict: bool, deadline: float) -> list[Step]:
    """Greedy delta debugging: drop chunks of steps while the same check still fails."""
    def fails(st: list[Step]) -> bool:
        _, v, _ = _execute(layout, num_blocks, fault, st, strict)
        return v is not None and v.check == check

    cur = list(steps)
    size = max(1, len(cur) // 2)
    while size >= 1 and time.monotonic() < deadline:
        i, changed = 0, False
        while i < len(cur) and time.monotonic() < deadline:
            cand = cur[:i] + cur[i + size:]
            if cand and fails(cand):
                cur, changed = cand, True
            else:
                i += size
        if not changed:
            size //= 2
    return cur


def _save(layout: str, num_blocks: int, fault: str | None, seed: int, steps: list[Step],
          v: Violation, out_dir: str, tag: str) -> str:
    ad, v2, idx = _execute(layout, num_blocks, fault, steps, strict=(v.kind == "lost_reuse"))
    fin = v2 or v
    tr = Trace(layout_config(layout), [Step(s.action, s.params) for s in steps], fault=fault,
               engine="vllm-fuzz", seed=seed, sut="vllm",
               violation={"kind": fin.kind, "check": fin.check, "message": fin.message, "step": idx},
               meta={"vllm_version": vllm_version(), "layout": layout, "num_blocks": num_blocks,
                     "strict_reuse": v.kind == "lost_reuse"})
    safe_layout = layout.replace("+", "_")
    path = Path(out_dir) / f"vllm-{safe_layout}-{tag}-seed{seed}.json"
    tr.save(path)
    return str(path)


def _finding(v: Violation, path: str, steps: int) -> dict:
    return {"kind": v.kind, "check": v.check, "message": v.message, "trace": path,
            "steps": steps, "replay": f"kvcheck replay {path} --sut vllm"}


def run_campaign(layout: str, budget_s: float | None = 60, steps: int | None = None,
                 seed: int = 0, strict_reuse: bool = False, fault: str | None = None,
                 out_dir: str = "kvcheck-report") -> dict:
    """Fuzz one layout until the budget (seconds and/or steps) is spent or a violation is found."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown vLLM layout {layout!r}; known: {', '.join(LAYOUTS)}")
    VllmAdapter(layout, 24, fault)        # validate layout/fault early (and import vLLM)
    t0 = time.monotonic()
    if budget_s is None and steps is None:
        budget_s = 60
    deadline = t0 + budget_s if budget_s is not None else float("inf")
    coverage: Counter = Counter()
    findings: list[dict] = []
    lost_seen: set[str] = set()
    total, episodes, hits, lost_total = 0, 0, 0, 0
    exit_code = 0
    first_fail_s = first_lost_s = None
    while time.monotonic() < deadline and (steps is None or total < steps):
        ep_seed = seed * 1_000_003 + episodes
        rng = random.Random(ep_seed)
        gen = _Gen(rng)
        ng = len(_LAYOUTS[layout][1])
        num_blocks = rng.choice([10, 14, 20, 32]) * max(2, ng) // 2
        ad = VllmAdapter(layout, num_blocks, fault)
        trail: list[Step] = []
        viol = None
        ep_len = rng.randint(20, 120)
        for _ in range(ep_len):
            if steps is not None and total >= steps:
                break
            a, p = gen.next(ad)
            trail.append(Step(a, p))
            total += 1
            n_lost = len(ad.lost)
            try:
                obs = ad.apply(a, p)
                if a == "lookup" and obs.get("hit"):
                    hits += 1
            except Violation as v:
                viol = v
            except (AssertionError, ValueError, KeyError, IndexError, TypeError) as e:
                viol = Violation("bookkeeping", "vllm_internal_error", f"vLLM raised {type(e).__name__}: {e}")
            if len(ad.lost) > n_lost:
                lost_total += 1
                if first_lost_s is None:
                    first_lost_s = round(time.monotonic() - t0, 2)
                lv = ad.lost[-1]
                key = lv.message.split(":")[0]
                if strict_reuse and viol is None:
                    viol = lv
                elif key not in lost_seen and len(lost_seen) < 3:
                    lost_seen.add(key)
                    small = _shrink(layout, num_blocks, fault, trail, "lost_reuse", True,
                                    min(deadline, time.monotonic() + 20))
                    path = _save(layout, num_blocks, fault, ep_seed, small, lv, out_dir,
                                 f"lost_reuse{len(lost_seen)}")
                    findings.append(_finding(lv, path, len(small)))
            if viol is not None:
                break
        coverage.update(ad.coverage)
        episodes += 1
        if viol is not None:
            first_fail_s = round(time.monotonic() - t0, 2)
            small = _shrink(layout, num_blocks, fault, trail, viol.check, viol.kind == "lost_reuse",
                            time.monotonic() + 30)
            path = _save(layout, num_blocks, fault, ep_seed, small, viol, out_dir, viol.check)
            findings.append(_finding(viol, path, len(small)))
            exit_code = 13 if viol.kind in ("divergence", "lost_reuse") else 10
            break
    missing = [a for a in ACTIONS if not coverage.get(a)]
    if exit_code == 0 and missing:
        exit_code = 3
    return {
        "sut": "vllm", "vllm_version": vllm_version(), "layout": layout, "seed": seed,
        "fault": fault, "expected_check": FAULTS[fault][0] if fault else None,
        "caught": (any(f["check"] == FAULTS[fault][0] for f in findings) if fault else None),
        "strict_reuse": strict_reuse, "steps": total, "episodes": episodes,
        "elapsed_s": round(time.monotonic() - t0, 2), "time_to_failure_s": first_fail_s,
        "time_to_first_lost_reuse_s": first_lost_s,
        "coverage": {k: coverage[k] for k in sorted(coverage)}, "missing_actions": missing,
        "lookups_with_hit": hits, "lost_reuse_lookups": lost_total,
        "findings": findings, "exit_code": exit_code,
    }


def replay(trace: Trace | str | Path) -> dict:
    """Replay a vLLM trace; report whether it reproduces its recorded violation."""
    if not isinstance(trace, Trace):
        trace = Trace.load(trace)
    layout = trace.meta.get("layout")
    if layout not in LAYOUTS:
        raise ValueError(f"trace has no known vLLM layout in meta.layout (got {layout!r})")
    strict = bool(trace.meta.get("strict_reuse"))
    ad, v, idx = _execute(layout, int(trace.meta.get("num_blocks", 24)), trace.fault,
                          trace.steps, strict)
    want = (trace.violation or {}).get("check")
    got = v.check if v else None
    return {
        "sut": "vllm", "vllm_version": vllm_version(), "layout": layout, "fault": trace.fault,
        "steps": len(trace.steps), "violation": (None if v is None else
                                                 {"kind": v.kind, "check": v.check, "message": v.message,
                                                  "step": idx}),
        "expected": want, "reproduced": want == got,
        "lost_reuse": [str(x) for x in ad.lost],
        "exit_code": 0 if v is None else (13 if v.kind in ("divergence", "lost_reuse") else 10),
    }
