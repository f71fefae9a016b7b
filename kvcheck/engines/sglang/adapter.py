"""SGLang's real radix caches as a system under test: its actions, how to apply one, how to
observe it, and its own checks (checks.py).

The adapter plays SGLang's scheduler around the tree: a request's prompt is matched
(`match_prefix` on all but its last token), the hit is locked (`inc_lock_ref`), the rest is
allocated from the token-to-KV pool allocator built on device="cpu" (evicting from the tree
when the pool is short, as the scheduler does), decode appends tokens, and a finished request
is inserted (`insert`; the caller frees the duplicate slots [hit, prefix_len) and whatever
lies past the key, as `RadixCache._insert_cache` does) and unlocked (`dec_lock_ref`).
For PureSWARadixCache, decode frees what leaves the window behind the prefill end, and only
[0, prefill end) is inserted (SGLang's `swa_evict_floor`). Its state has no mapping onto the
spec's, so it runs on the lockstep core with the free model; `extra_checks` is the truth.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from kvcheck.fuzz.boundary import check_exception
from kvcheck.spec.sut import ActionRejected

from .checks import Req, ShadowChecks, Violation
from .sched import SchedMixin
from .compat import has_params, new_allocator, new_cache, new_key
from .steps import expand
from .install import load
from kvcheck.spec.faults import Planted

from .layouts import (ACTIONS, FAULTS, MAX_TOKENS, Layout, LayoutError, check_supported, fault_applies,
                      fault_refusal, get_layout)


def lock_ref(node: Any) -> int:
    """The full-attention lock count (SWARadixCache names it full_lock_ref)."""
    return node.full_lock_ref if hasattr(node, "full_lock_ref") else node.lock_ref


class SglangAdapter(SchedMixin, ShadowChecks):
    """An SGLang radix cache behind kvcheck's adapter protocol: reset / apply / observe and
    extra_checks. A planted fault wraps the cache instance's methods (SGLang is not edited)."""

    name = "sglang"
    actions = frozenset(ACTIONS)

    def __init__(self, layout: str | Layout, fault: str | None = None, capacity: int | None = None) -> None:
        self.lay = get_layout(layout)
        if "swa" in self.lay.components and self.lay.page_size != 1:
            raise LayoutError(f"layout {self.lay.name}: the SWA window is driven with page_size 1 only")
        if fault is not None and fault not in FAULTS:
            raise LayoutError(f"unknown SGLang fault {fault!r}; known: {', '.join(FAULTS)}")
        if fault is not None and not fault_applies(fault, self.lay):
            raise LayoutError(fault_refusal(fault, self.lay))
        check_supported(self.lay)
        self.fault = fault
        self.planted = Planted(FAULTS.get(fault) if fault else None)   # its sites ask planted(F)
        self.capacity = capacity or self.lay.capacity
        self.reset()

    # ---- construction --------------------------------------------------------------------
    def reset(self, cfg: Any = None) -> None:
        import torch
        S = load()
        self.S, self.torch = S, torch
        al, ps = S["allocator"], self.lay.page_size
        if ps == 1:
            self.alloc = new_allocator(al.TokenToKVPoolAllocator, self.capacity, torch.int64, "cpu", None)
        else:
            self.alloc = new_allocator(al.PagedTokenToKVPoolAllocator, self.capacity, ps, torch.int64, "cpu", None)
        self.cache = new_cache(self.lay.cls, self.alloc, ps, self.lay.window if "swa" in self.lay.components else None)
        self.params_api = hasattr(S["bpc"], "MatchPrefixParams")   # *Params objects: 0.5.23 has them, 0.5.7 not
        self.reqs: dict[str, Req] = {}
        self.written: dict[int, tuple[int, ...]] = {}
        self.twin: set[tuple[int, ...]] = set()
        self.coverage: Counter = Counter()
        self.lost: list[Violation] = []
        self.hits = 0
        self.next_id = 0
        self.broken: Violation | None = None
        self._inserts = 0
        self._plant()

    def _plant(self) -> None:
        """The planted fault: a wrapper around one method of this cache instance."""
        f, c, S = self.fault, self.cache, self.S
        if f == "lock_ref_leak":
            real_dec = c.dec_lock_ref

            def dec(node: Any, *rest: Any, **kw: Any) -> Any:
                out = real_dec(node, *rest, **kw)
                if node is not c.root_node:     # a reference nobody holds
                    if hasattr(node, "full_lock_ref"):
                        node.full_lock_ref += 1
                    else:
                        node.lock_ref += 1
                return out
            c.dec_lock_ref = dec
        elif f in ("evict_locked", "evict_no_free"):
            real_evict = c.evict

            def evict(*params: Any, **kw: Any) -> Any:
                if f == "evict_no_free":
                    a = c.token_to_kv_pool_allocator
                    real = {n: getattr(a, n) for n in ("free", "free_segment", "free_swa") if hasattr(a, n)}
                    for n in real:
                        setattr(a, n, lambda *x, **k: None)
                    try:
                        return real_evict(*params, **kw)
                    finally:
                        for n, fn in real.items():
                            setattr(a, n, fn)
                out = real_evict(*params, **kw)
                locked = [n for n, _ in self.tree() if lock_ref(n) > 0 and not n.children]
                if locked:
                    n = locked[0]
                    c.token_to_kv_pool_allocator.free(n.value)
                    c._delete_leaf(n)
                return out
            c.evict = evict

    # ---- the protocol --------------------------------------------------------------------
    def observe(self) -> None:
        """The tree has no mapping onto the spec's state tuple: None (the checks are the truth)."""
        return None

    def enabled(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {a: [] for a in ACTIONS}
        for rid, r in self.reqs.items():
            if r.state == "waiting":
                out["match"].append(rid)
                out["abort"].append(rid)
            else:
                if len(r.tokens) < MAX_TOKENS:
                    out["decode"].append(rid)
                out["finish"].append(rid)
                out["abort"].append(rid)
        return self.sched_enabled(out)

    def apply(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        """One action (a compound one: each of its parts), then every check; the first
        broken one is kept for `extra_checks`."""
        parts = expand(action, params)
        obs: dict[str, Any] = {}
        for i, (a, p) in enumerate(parts):
            try:
                obs = self._apply1(a, p)
            except ActionRejected:
                if i == 0:
                    raise
                break               # a burst that ran into a refusal stops there
            if self.broken is not None:
                break
        return obs

    def _apply1(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        fn = getattr(self, f"_a_{action}", None)
        if action in ("decode", "finish", "abort") and params.get("r") in self._sched_state():
            fn = getattr(self, f"_s_{action}")       # a scheduler-path request: SGLang's own release
        if fn is None or action not in ACTIONS:
            raise ActionRejected(f"unknown SGLang adapter action {action!r}")
        try:
            obs = fn(**params) or {}
            self.coverage[action] += 1
            self.check_all()
        except ActionRejected:
            raise
        except Violation as v:
            self.broken, obs = v, {}
        except Exception as e:  # noqa: BLE001 - whose it is decides: a finding or "cannot drive"
            if isinstance(e, TypeError) and "_a_" in str(e):
                raise ActionRejected(f"bad parameters for {action}: {e}") from None
            self.broken, obs = self.engine_raised(e), {}
        return obs

    def engine_raised(self, e: Exception) -> Violation:
        """SGLang's own code raised: a finding (sglang_internal_error). One raised on kvcheck's
        side of the boundary (its stand-ins, its calls) is CannotDrive instead (fuzz/boundary.py)."""
        check_exception(e, "sglang", load()["version"], ("sglang",))
        return Violation("bookkeeping", "sglang_internal_error", f"SGLang raised {type(e).__name__}: {e}")

    def extra_checks(self, action: str, params: dict[str, Any]) -> tuple[str, str, str] | None:
        v, self.broken = self.broken, None
        return None if v is None else (v.kind, v.check, v.message)

    # ---- helpers -------------------------------------------------------------------------
    def _get(self, r: str, state: str | None = None) -> Req:
        req = self.reqs.get(r)
        if req is None or (state is not None and req.state != state):
            raise ActionRejected(f"request {r} is not {state or 'known'}")
        return req

    def _key(self, tokens: list[int]) -> Any:
        return new_key(tokens, self.params_api)

    # ---- the release's API: *Params objects (0.5.8+) or positional arguments (0.5.7) -------
    def _match(self, tokens: list[int]) -> tuple[int, Any]:
        """(hit, last node); the `match_overreach` fault claims one page more than the path."""
        key = self._key(tokens)
        if self.params_api:
            m = self.cache.match_prefix(self.S["bpc"].MatchPrefixParams(key=key))
            # 0.5.23: device_prefix_len; 0.5.12: device_indices (the *Params API came first)
            hit = m.device_prefix_len if hasattr(m, "device_prefix_len") else len(m.device_indices)
        else:
            m = self.cache.match_prefix(key)
            hit = len(m.device_indices)
        if self.planted(FAULTS["match_overreach"]) and hit:
            hit += self.lay.page_size
        return hit, m.last_device_node

    def _insert(self, tokens: list[int], vals: Any) -> int:
        """The prefix length the tree already had. Faults: `insert_shifted_values` stores the
        values shifted by one; `drop_insert` declines every other insert (the caller frees the
        new slots, as for a duplicate)."""
        if self.planted(FAULTS["insert_shifted_values"]):
            vals = self.torch.roll(vals, 1)
        elif self.planted(FAULTS["drop_insert"]):
            self._inserts += 1
            if self._inserts % 2 == 0:
                return len(tokens) // self.lay.page_size * self.lay.page_size
        key = self._key(tokens)
        if has_params("InsertParams"):
            return self.cache.insert(self.S["bpc"].InsertParams(key=key, value=vals)).prefix_len
        return int(self.cache.insert(key, vals))

    def _cache_evict(self, n: int, swa: int | None = None) -> int:
        if has_params("EvictParams"):
            return self.cache.evict(self.S["bpc"].EvictParams(num_tokens=n)).num_tokens_evicted
        before = self.alloc.available_size()
        self.cache.evict(n)
        return self.alloc.available_size() - before

    def path_slots(self, node: Any) -> list[int]:
        vals = []
        while node is not self.cache.root_node:
            vals.append([int(v) for v in node.value.tolist()])
            node = node.parent
        return [v for part in reversed(vals) for v in part]

    def _evict(self, n: int, swa: int | None = None) -> int:
        """Evict from the tree; the twin forgets exactly what the tree dropped."""
        before = self.tree_prefixes()
        locked = self._locked_prefixes()
        got = self._cache_evict(n, swa)
        gone = before - self.tree_prefixes()
        self.twin -= gone
        if gone & locked:
            raise Violation("bookkeeping", "no_evict_locked",
                            f"evict({n}) removed a locked node ({len(max(gone & locked, key=len))} tokens deep)")
        self.coverage["state:evicted"] += got > 0
        return got

    def _locked_prefixes(self) -> set[tuple[int, ...]]:
        """The token prefixes of the nodes a request's lock protects (eviction must keep them)."""
        return {path + tuple(int(t) for t in node.key) for node, path in self.tree() if lock_ref(node) > 0}

    def _alloc(self, n: int) -> list[int] | None:
        """n slots (whole pages), evicting from the tree when the pool is short."""
        if n == 0:
            return []
        out = self.alloc.alloc(n)
        if out is None:
            self._evict(n - self.alloc.available_size())
            out = self.alloc.alloc(n)
        return None if out is None else [int(x) for x in out.tolist()]

    def _free(self, slots: list[int]) -> None:
        if slots:
            self.alloc.free(self.torch.tensor(slots, dtype=self.torch.int64))

    def _write(self, req: Req, p: int, slot: int) -> None:
        self.written[slot] = tuple(req.tokens[:p + 1])

    # ---- actions -------------------------------------------------------------------------
    def _a_submit(self, r: str, tokens: list[int]) -> dict:
        if r in self.reqs:
            raise ActionRejected(f"request {r} already exists")
        if not 2 <= len(tokens) < MAX_TOKENS:
            raise ActionRejected(f"a request needs 2..{MAX_TOKENS - 1} tokens")
        self.reqs[r] = Req(r, list(tokens))
        self.next_id += 1
        return {}

    def _a_match(self, r: str) -> dict:
        req = self._get(r, "waiting")
        ps = self.lay.page_size
        hit, node = self._match(req.tokens[:-1])
        path = self.path_slots(node)
        self.check_hit(req, hit, path)
        self.hits += hit > 0
        want = self.twin_hit(req.tokens)
        if want > hit:
            v = Violation("lost_reuse", "lost_reuse",
                          f"{r}: the no-eviction twin holds a {want}-token prefix, the tree matched {hit}")
            self.lost.append(v)
            raise v
        self.last_receipt = self.cache.inc_lock_ref(node)
        need = self._need(req, hit)             # all of the prompt, or its first chunk
        new = self._alloc(-(-need // ps) * ps)
        if new is None:
            self.cache.dec_lock_ref(node)
            self.coverage["state:admission_refused"] += 1
            return {"hit": hit, "admitted": False}
        req.node, req.hit, req.state = node, hit, "running"
        req.slots, req.spare, req.floor = path + new[:need], new[need:], len(req.tokens)
        for p in range(hit, hit + need):
            self._write(req, p, req.slots[p])
        self.coverage["state:hit" if hit else "state:miss"] += 1
        return {"hit": hit, "admitted": True}

    def _a_decode(self, r: str, tok: int) -> dict:
        req = self._get(r, "running")
        if len(req.tokens) >= MAX_TOKENS:
            raise ActionRejected(f"request {r} is at {MAX_TOKENS} tokens")
        if not req.spare:
            new = self._alloc(self.lay.page_size)
            if new is None:
                self.coverage["state:decode_refused"] += 1
                return {"allocated": False}
            req.spare = new
        req.tokens.append(tok)
        slot = req.spare.pop(0)
        req.slots.append(slot)
        self._write(req, len(req.tokens) - 1, slot)
        if self.lay.components == ("swa",) and r not in self.sched:   # PureSWA: free what left the window
            lo, hi = max(req.hit, req.floor), len(req.tokens) - self.lay.window
            dead = [p for p in range(lo, hi) if req.slots[p] is not None]
            self._free([req.slots[p] for p in dead])
            for p in dead:
                req.slots[p] = None
            self.coverage["state:window_freed"] += bool(dead)
        return {"allocated": True}

    def _a_finish(self, r: str) -> dict:
        req = self._get(r, "running")
        ps = self.lay.page_size
        n = req.floor if "swa" in self.lay.components else len(req.tokens)
        n = n // ps * ps
        vals = self.torch.tensor(req.slots[:n], dtype=self.torch.int64)
        prefix_len = self._insert(req.tokens[:n], vals)
        self._free(req.slots[req.hit:prefix_len])               # duplicates of the tree's
        self._free([s for s in req.slots[n:] if s is not None] + req.spare)   # past the key
        self._release(req)
        self._remember(req, n)
        del self.reqs[r]
        return {"prefix_len": prefix_len}

    def _a_abort(self, r: str) -> dict:
        req = self._get(r)
        if req.state == "running":
            self._free([s for s in req.slots[req.hit:] if s is not None] + req.spare)
            self._release(req)
        del self.reqs[r]
        return {}

    def _release(self, req: Req) -> None:
        """Unlock a request's matched node (a class with lock receipts replays its receipt)."""
        self.cache.dec_lock_ref(req.node)

    def _a_evict(self, n: int) -> dict:
        return {"evicted": self._evict(n)}
