"""The Mamba state both SGLang Mamba adapters share: the pools, the state fingerprints, decode and
finish with the request's state slot (each adapter supplies only its release's insert) and the twin
of inserted keys (MambaRadixCache in mamba.py, UnifiedRadixCache FULL+MAMBA in
unified_mamba.py), written once.

A Mamba layer keeps one fixed-size recurrent state per request; a resume at a hit of k tokens
reads the state after exactly k tokens and nothing older (spec: objects.RECURRENT_STATE). The
adapter plays the model: it writes a fingerprint of a request's prefix into its state slot's
bytes at prefill and every decode, so a hit's state is checked byte for byte, after SGLang's
own copy into the request's slot too. The pools are real: `HybridReqToTokenPool`'s `MambaPool`
(one layer, 1x1x1 state tensors on CPU) and a `HybridLinearKVPool` under a
`TokenToKVPoolAllocator`. The state slots' free list is the `MambaPool`'s own up to 0.5.15 and
a separate `MambaSlotAllocator` (`req_to_token_pool.mamba_allocator`) on 0.5.23.
"""
from __future__ import annotations

import os
from typing import Any

from .compat import MAMBA_CHUNK, kw
from .layouts import FAULTS

CHUNK = MAMBA_CHUNK     # the Mamba cache chunk size the server args stand-in reports


def fingerprint(prefix: tuple[int, ...]) -> float:
    """A float32-exact tag of a token prefix: what the adapter writes as 'the state after it'."""
    return float(hash(prefix) % 16_777_213 + 1)


class _ServerArgsStandIn:
    """KVCHECK_CPU_STUB: the fields of SGLang's global server args the driven caches and SGLang's
    Req read (0.5.7-0.5.15: the Mamba tree's `mamba_cache_chunk_size`; `Req.pop_committed_kv_cache`
    and `release_kv_cache`: speculative decoding off, no thinking-strip); set only where none are set."""

    page_size = 1
    mamba_cache_chunk_size = CHUNK
    speculative_eagle_topk = None
    speculative_algorithm = None
    strip_thinking_cache = False


def unresolved(cls: Any, **values: Any) -> Any:
    """A dataclass instance of `cls` (SGLang's ServerArgs) with its defaults and `values`, without
    running its __post_init__: 0.5.15's resolves the model's HF config there (a download; there
    is no model); 0.5.23's is no dataclass and resolves nothing when built."""
    import dataclasses
    if not dataclasses.is_dataclass(cls):     # 0.5.23: a msgspec Struct, resolved only on demand
        return cls(**values)
    obj = cls.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            setattr(obj, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(obj, f.name, f.default_factory())
        else:
            setattr(obj, f.name, None)
    for k, v in values.items():
        setattr(obj, k, v)
    return obj


def set_server_args_stand_in() -> bool:
    """Make SGLang's global server args readable on a machine with no server; True if this call
    set them. Never replaces real ones (a user's own server args are left as they are): where
    some are set, only the fields they lack are added."""
    try:
        from sglang.srt import server_args as sa
    except Exception:
        return False
    try:              # 0.5.23: a runtime context projected from ServerArgs (0.5.14: a module of the
        #               same name holds only the parallel context; the server args are global)
        from sglang.srt import runtime_context as rc
    except ImportError:
        rc = None
    if rc is not None and hasattr(rc, "get_context") and hasattr(rc, "get_server_args"):
        try:
            cur = rc.get_server_args()
        except ValueError:                    # "Global server args is not set yet!"
            cur = None
        if cur is not None:                   # a dummy model's (ours, or SGLang's test default): its
            if cur.model_path in ("dummy", "kvcheck-cpu-stand-in") and \
                    "_mamba_cache_chunk_size" not in vars(cur):   # HF config would be downloaded
                cur._mamba_cache_chunk_size = CHUNK
            return False
        # an unresolved ServerArgs (resolving it would load the model's HF config) with the chunk
        # size pre-seeded, as SGLang's own test fixtures do for a dummy model
        args = unresolved(sa.ServerArgs, model_path="kvcheck-cpu-stand-in", device="cpu", page_size=1)
        args._mamba_cache_chunk_size = CHUNK
        rc.get_context().set_server_args(args)
        return True
    if not hasattr(sa, "set_global_server_args_for_scheduler"):
        return False
    cur = getattr(sa, "_global_server_args", None)
    if cur is None:
        sa.set_global_server_args_for_scheduler(_ServerArgsStandIn())
        return True
    for name, value in vars(_ServerArgsStandIn).items():
        if not name.startswith("_") and not hasattr(cur, name):
            setattr(cur, name, value)
    return False


def mamba_pools(capacity: int, min_states: int = 5) -> dict[str, Any]:
    """The real pools on CPU: a HybridReqToTokenPool (its MambaPool: one layer, 1x1x1 states,
    capacity/6 slots, at least `min_states`), a HybridLinearKVPool (one full-attention layer) under a
    TokenToKVPoolAllocator. Keys: rtp, mpool (state tensors), mslots (the state slots' free
    list), alloc, size (state slots), every (their ids)."""
    import torch
    os.environ.setdefault("SGLANG_MAMBA_SSM_DTYPE", "float32")
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

    from .install import load
    set_server_args_stand_in()
    size = max(min_states, capacity // 6)
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=2, n_groups=1, num_heads=1,
                                    head_dim=1, state_size=1, conv_kernel=2)
    cp = Mamba2CacheParams(shape=shape, layers=[0], dtype=Mamba2StateDType(conv=torch.float32, temporal=torch.float32))
    rtp = HybridReqToTokenPool(**kw(HybridReqToTokenPool.__init__, size=min(8, size), mamba_size=size,
                                    mamba_spec_state_size=size, max_context_len=64, device="cpu",
                                    enable_memory_saver=False, cache_params=cp, mamba_layer_ids=[0],
                                    enable_mamba_extra_buffer=False))
    mpool = rtp.mamba_pool
    mslots = getattr(rtp, "mamba_allocator", None) or mpool      # 0.5.23: a separate slot allocator
    kv = HybridLinearKVPool(**kw(HybridLinearKVPool.__init__, size=capacity, dtype=torch.float16, page_size=1,
                                 head_num=1, head_dim=2, full_attention_layer_ids=[1],
                                 enable_kvcache_transpose=False, device="cpu", mamba_pool=mpool))
    alloc = load()["allocator"].TokenToKVPoolAllocator(capacity, torch.float16, "cpu", kv, False)
    return {"rtp": rtp, "mpool": mpool, "mslots": mslots, "alloc": alloc, "size": size,
            "every": {int(x) for x in mslots.free_slots.tolist()}}      # 0..n-1 (0.5.7) or 1..n


class MambaStates:
    """Mixed into a Mamba adapter ahead of SglangAdapter (needs self.mpool, self.mslots,
    self.mwritten, self.mslot, self.mlocked, self.twin, self.finished, self.torch, self.capacity,
    an `_evict(n, mamba)` and an `_insert_state(req, vals, mv)`): the state bytes and their
    shadow, the state slots' free list, decode and finish with the state, the generator's hooks
    and the twin's hit."""

    # ---- state slots and their bytes ------------------------------------------------------
    def _state_write(self, slot: int, prefix: tuple[int, ...]) -> None:
        self.mpool.mamba_cache.temporal[:, slot] = fingerprint(prefix)
        self.mwritten[slot] = prefix

    def _state_holds(self, slot: int, prefix: tuple[int, ...], rows: list | None = None) -> bool:
        """The slot's bytes (every layer) and its shadow are the state after `prefix`; `rows`:
        the state tensor read once for a whole check."""
        if rows is None:
            rows = self._state_rows()
        f = fingerprint(prefix)
        return all(r[slot] == f for r in rows) and self.mwritten.get(slot) == prefix

    def _state_rows(self) -> list:
        t = self.mpool.mamba_cache.temporal
        return [t[i].flatten(1)[:, 0].tolist() for i in range(t.shape[0])]

    def mamba_free(self) -> set[int]:
        return {int(x) for x in self.mslots.free_slots.tolist()}

    def _mamba_alloc(self) -> int | None:
        """One state slot, evicting one state from the tree when the pool is short."""
        out = self.mslots.alloc(1)
        if out is None:
            self._evict(0, 1)
            out = self.mslots.alloc(1)
        return None if out is None else int(out[0])

    def _mamba_release(self, slot: int) -> None:
        self.mslots.free(self.torch.tensor([slot], dtype=self.torch.int64))

    def following_state_copies(self, fn: Any) -> None:
        """Run one of SGLang's calls with the state shadow following every copy it makes between
        state slots (the checks then read the bytes against it): SGLang copies a state with the
        pool's `copy_from` (0.5.23's checkpoint fork: a slot from the allocator, then copy_from),
        which `fork_from` calls too where a release has it (a new slot and the copy; 0.5.14 has
        none: the cache takes a slot and calls copy_from itself)."""
        pool = self.mpool
        had, real = "copy_from" in vars(pool), pool.copy_from

        def copy_from(src_index: Any, dst_index: Any) -> Any:
            out = real(src_index, dst_index)
            for d, s in zip(dst_index.flatten().tolist(), src_index.flatten().tolist()):
                self.mwritten[int(d)] = self.mwritten.get(int(s))
            return out
        pool.copy_from = copy_from
        try:
            fn()
        finally:
            if had:
                pool.copy_from = real
            else:
                del pool.copy_from

    # ---- actions: the request's state follows its tokens --------------------------------
    def _a_decode(self, r: str, tok: int) -> dict:
        """SglangAdapter's decode; the model's step then makes the request's state the state
        after all its tokens."""
        out = super()._a_decode(r, tok)     # type: ignore[misc]
        if out.get("allocated"):
            self._state_write(self.mslot[r], tuple(self.reqs[r].tokens))
        return out

    def _a_finish(self, r: str) -> dict:
        """Insert a finished request's key with its state slot as `mamba_value` (the release's
        insert: the adapter's `_insert_state`, which also frees the KV slots that are the caller's);
        the tree keeps the slot unless it reports `mamba_exist`, then the caller frees it."""
        req = self._get(r, "running")
        n, ms = len(req.tokens), self.mslot.pop(r)
        self.mlocked.pop(r)
        vals = self.torch.tensor(req.slots[:n], dtype=self.torch.int64)
        mv = self.torch.tensor([ms], dtype=self.torch.int64)
        if self.planted(FAULTS["insert_shifted_values"]):
            vals = self.torch.roll(vals, 1)
        self._inserts += 1
        prefix_len, exist = self._insert_state(req, vals, mv)
        if self.planted(FAULTS["mamba_state_freed_on_insert"]) and not exist:
            exist = True        # the caller believes the tree already had a state and frees its slot
        self.coverage["state:mamba_exist"] += bool(exist)
        if exist:
            self._mamba_release(ms)
        self._release(req)
        self.twin.add(tuple(req.tokens))
        self.finished.add(tuple(req.tokens))
        del self.reqs[r]
        return {"prefix_len": prefix_len, "mamba_exist": bool(exist)}

    # ---- the generator's hooks and the twin -----------------------------------------------
    def evict_params(self, rng: Any) -> dict:
        """The generator's evict: full tokens and/or Mamba states."""
        return {"n": rng.choice([0, rng.randint(1, self.capacity // 2)]), "mamba": rng.randint(0, 3)}

    def continue_prompt(self, rng: Any, toks: list[int]) -> list[int]:
        """Half the prompts continue a finished request (a chat's next turn): the state is kept
        only at inserted keys' ends, so only such prompts can hit."""
        from .layouts import MAX_TOKENS
        done = sorted(k for k in self.finished if len(k) < MAX_TOKENS - 2)
        if not done or rng.random() < 0.5:
            return toks
        k = list(rng.choice(done))
        if rng.random() < 0.2:      # the same prompt again: its insert finds the state there (mamba_exist)
            return k
        return k + toks[:rng.randint(1, min(len(toks), MAX_TOKENS - 1 - len(k)))]

    def twin_hit(self, tokens: list[int]) -> int:
        """The longest inserted key (its state at its end) that is a proper prefix of tokens."""
        return max((len(k) for k in self.twin if len(k) < len(tokens) and tuple(tokens[:len(k)]) == k), default=0)
