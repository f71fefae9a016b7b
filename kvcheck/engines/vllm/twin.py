"""Retention-aware lost reuse: the layout under test runs next to a dense twin.

The map-based lost-reuse check (checks.py `spec_usable`) compares vLLM's hit with vLLM's
own prefix-cache map, so a retention policy that never publishes a block a later request needs
cannot show up. Here every operation also runs on a twin ``KVCacheManager`` of the same layout
with dense retention (``prefix_cache_retention_interval=None``). At a lookup the twin first
reports its uncapped hit D, then is admitted with the hit of the layout under test (S, through
``get_computed_blocks(max_cache_hit_length=S)``), so both allocate as many blocks and stay in
step; D - S is what dense retention would have reused on top. The twin alone cannot be the
oracle: vLLM frees unpublished blocks to the front of the free queue and published ones to its
end (``vllm/v1/core/block_pool.py:837-846``), so from the first free on the two managers use
different physical blocks and evict differently. The promise below is therefore checked on the
layout under test's own blocks, through the shadow content model.

What the policy promises (the slack), from vLLM 0.33.0's own text and code:
  * ``vllm/config/cache.py:275-281``: ``0`` "retains only semantic checkpoints, including the
    latest replay boundary and shared-prefix junctions"; ``N > 0`` additionally retains a
    checkpoint every N tokens (a multiple of the scheduler block size); ``None`` is dense.
  * ``vllm/v1/core/kv_cache_coordinator.py:65-87`` (``replay_boundaries``): without EAGLE the
    replay boundary is ``num_prompt_tokens - 1`` (a resend is capped there).
  * ``vllm/v1/core/single_type_kv_cache_manager.py:1093-1146`` (SWA ``reachable_block_mask``):
    the ``cdiv(W - 1, block)``-block tail ending at each kept boundary (floored to the hit
    alignment) is cached: every N-token segment end for ``N > 0``, and for every interval the
    replay boundary and the junction ``get_computed_blocks`` reported
    (``kv_cache_manager.py:318-324``, pinned at ``single_type_kv_cache_manager.py:511-520``).
So a boundary b of a request is *promised* once the request has computed b tokens; the promise
stands while the very blocks of that tail still hold the request's prefix (not reallocated,
not evicted by the connector, no ``reset_prefix_cache`` since) and the groups retention does
not thin (full attention) are cached up to b. A lookup whose hit S is below a standing promise
is lost reuse beyond the declared slack: check ``lost_reuse_retention``, kind ``lost_reuse``,
with its size (tokens lost, share of the prompt). Everything between S and D that no promise
covers is the slack the policy declares: counted, not a finding. The twin leaves an episode
(``desynced``) once it accepts an operation with another outcome; the promise check goes on.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from kvcheck.spec.sut import ActionRejected

from .adapter import VllmAdapter
from .checks import Violation, Req
from .layouts import (RETENTION, RETENTION_DROPS_TAIL, cdiv, vllm_modules)

SWA_KINDS = ("swa", "swa_mla")


class DenseTwin(VllmAdapter):
    """The same layout with dense retention; its lookups can be capped (``cap``)."""

    cap: int | None = None

    def retention(self) -> int | None:
        return None

    def reset(self, cfg: Any = None) -> None:
        super().reset(cfg)
        import inspect
        if "max_cache_hit_length" in inspect.signature(self.mgr.get_computed_blocks).parameters:
            self.uncapped = self.mgr.get_computed_blocks
            self.mgr.get_computed_blocks = self._capped
        else:                   # 0.29-0.32: the lookup's bound is the coordinator's max_length
            coord = self.mgr.coordinator
            find = coord.find_longest_cache_hit

            def capped_find(hashes: Any, max_length: int, *a: Any, **k: Any) -> Any:
                return find(hashes, max_length if self.cap is None else min(max_length, self.cap), *a, **k)
            coord.find_longest_cache_hit = capped_find
            real = self.mgr.get_computed_blocks

            def uncapped(request: Any) -> Any:
                cap, self.cap = self.cap, None
                try:
                    return real(request)
                finally:
                    self.cap = cap
            self.uncapped = uncapped

    def _capped(self, request: Any, max_cache_hit_length: int | None = None) -> Any:
        return self.uncapped(request, self.cap if self.cap is not None else max_cache_hit_length)


class TwinAdapter(VllmAdapter):
    """The layout under test (usually sparse retention) with its dense twin beside it."""

    twin_oracle = True

    def __init__(self, layout: str, num_blocks: int = 24, fault: str | None = None,
                 strict: bool = False) -> None:
        if fault == RETENTION_DROPS_TAIL.name and RETENTION.get(layout) is None:
            raise ValueError(f"fault {fault!r} needs a layout with a retention interval "
                             f"(prefix_cache_retention_interval 0 or N), e.g. full+swa-sparse")
        super().__init__(layout, num_blocks, fault, strict)

    def reset(self, cfg: Any = None) -> None:
        self.promises: dict[tuple, list[list]] = {}    # content -> [[tail (g, id, i)..., why]]
        self.by_block: dict[int, set[tuple]] = {}      # block id -> contents it keeps a promise of
        self.promised_at: dict[str, set[int]] = {}     # rid -> boundaries recorded
        self.unpublished: set[int] = set()             # evicted by the connector since allocated
        super().reset(cfg)
        self.interval = self.retention()
        self.twin = DenseTwin(self.layout, self.num_blocks, None, False)
        self.desynced = False
        self.twin_stats: Counter = Counter()
        self.lost_sizes: list[dict] = []

    def _plant(self) -> None:
        super()._plant()
        if not self.planted(RETENTION_DROPS_TAIL):
            return
        for g, mgr in enumerate(self.coord.single_type_managers):
            if self.groups[g][0] in SWA_KINDS:
                mgr.reachable_block_mask = _drop_replay_tail(mgr.reachable_block_mask)

    # ---- lockstep with the twin ----------------------------------------------------------
    def apply(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        dense, promised, n = None, None, 0
        if action == "lookup" and params.get("r") in self.reqs:   # all measured before the lookup
            promised = self._promised(self.reqs[params["r"]])
            n = self.reqs[params["r"]].obj.num_tokens        # (its admission may sample a token)
            if not self.desynced and params["r"] in self.twin.reqs:
                dense = self.twin.uncapped(self.twin.reqs[params["r"]].obj)[1]
        if action == "evict_blocks":     # a connector eviction of a published block ends its promise
            ids = [i for i in params.get("block_ids", []) if isinstance(i, int) and 0 < i < self.num_blocks]
            self.unpublished.update(i for i in ids if self.pool.blocks[i].block_hash is not None)
        n_lost = len(self.lost)
        obs = super().apply(action, params)
        if action == "reset_prefix_cache" and obs.get("reset"):
            self.promises.clear()
            self.by_block.clear()
        elif action == "evict_blocks":
            self._forget(params.get("block_ids", []))
        if not self.desynced:
            self._mirror(action, params, obs)
        if promised is not None and "hit" in obs:
            self._compare(params["r"], n, obs["hit"], None if self.desynced else dense, promised, obs)
            if self.broken is None and self.strict and len(self.lost) > n_lost:
                self.broken = self.lost[-1]
        self._record_promises()
        return obs

    def _mirror(self, action: str, params: dict[str, Any], obs: dict[str, Any]) -> None:
        """The same operation on the twin (a lookup admitted with the same hit). vLLM frees
        unpublished blocks to the front of the free queue and published ones to its end
        (vllm/v1/core/block_pool.py:837-846), so the two managers pick different physical
        blocks from the first free on; the twin stays in step while it accepts the same
        operations with the same outcomes, and is left (``desynced``) when it does not."""
        self.twin.cap = obs.get("hit") if action == "lookup" else None
        try:
            tobs = self.twin.apply(action, params)
        except ActionRejected:
            tobs = None
        finally:
            self.twin.cap = None
        tb, self.twin.broken = self.twin.broken, None
        if tb is not None and self.broken is None:
            self.broken = Violation(tb.kind, tb.check, f"dense twin of {self.layout}: {tb.message}")
        if tobs is None or any(tobs.get(k) != obs.get(k) for k in ("hit", "admitted", "allocated")) \
                or set(self.reqs) != set(self.twin.reqs):
            self.desynced = True
            self.twin_stats["desynced"] += 1

    # ---- the promise ----------------------------------------------------------------------
    def _own(self, req: Req, new: Any) -> None:
        """Freshly allocated blocks were evicted from wherever they were: promises on them end."""
        super()._own(req, new)
        fresh = [b.block_id for lst in new.blocks for b in lst if not b.is_null]
        self.unpublished.difference_update(fresh)
        self._forget(fresh)

    def _forget(self, ids: Any) -> None:
        for bid in ids:
            for key in self.by_block.pop(bid, ()):
                recs = [r for r in self.promises.get(key, []) if all(t[1] != bid for t in r[:-1])]
                if recs:
                    self.promises[key] = recs
                else:
                    self.promises.pop(key, None)

    def _boundaries(self, req: Req) -> list[tuple[int, str]]:
        """(boundary, why) the policy keeps for this request, as far as it has computed, each
        floored to the hit alignment. With a drafter the reachable points are one scheduler
        block lower than without (``replay_boundaries``: the resend's and the extension's
        boundary minus a block; a junction also one SWA block lower, kv_cache_coordinator.py:
        65-87, single_type_kv_cache_manager.py:511-520): a hit there matches the block above
        and drops it. A boundary only some sliding-window groups keep is promised by none."""
        o, a = req.obj, self.align
        c = o.num_computed_tokens
        out: list[tuple[int, str]] = []
        if self.interval is None:
            return [(b, "dense") for b in range(a, c + 1, a)]
        if self.interval > 0:
            out += [(b // a * a, f"every {self.interval} tokens") for b in range(self.interval, c + 1, self.interval)]
        P, sb = o.num_prompt_tokens, self.sched_bs
        if self.drafter:
            resend, ext = (P - 1) // sb * sb, P // sb * sb
            out += [((x - sb) // a * a, f"EAGLE replay boundary of {req.rid}'s prompt") for x in {resend, ext}]
        else:
            out.append(((P - 1) // a * a, f"replay boundary of {req.rid}'s prompt"))
        j = getattr(o, "shared_prefix_boundary", 0) or 0
        if j:
            out.append((j // a * a, f"junction {j} pinned at {req.rid}'s lookup"))
            swa = [(g, bs) for g, (kind, bs, _) in enumerate(self.groups) if kind in SWA_KINDS]
            if all(g in self.eagle_groups for g, _ in swa) and len({bs for _, bs in swa}) == 1:
                jb = j - swa[0][1]            # every SWA group keeps it (else some do not: no promise)
                out.append((jb // a * a, f"junction {j} pinned at {req.rid}'s lookup, one block lower (EAGLE)"))
        return [(b, why) for b, why in out if 0 < b <= c]

    def _record_promises(self) -> None:
        for req in self.reqs.values():
            if req.state != "running":
                continue
            seen = self.promised_at.setdefault(req.rid, set())
            for b, why in self._boundaries(req):
                if b in seen:
                    continue
                tail = self._tail(req, b)
                if tail is not None:
                    seen.add(b)
                    key = self._content(req, b)
                    recs = self.promises.setdefault(key, [])
                    recs[:] = [*recs[-3:], [*tail, why]]
                    for _, bid, _ in tail:
                        self.by_block.setdefault(bid, set()).add(key)

    def _tail(self, req: Req, b: int) -> list[tuple[int, int, int]] | None:
        """(group, block id, index) of the blocks each SWA group keeps for a hit at b: the
        ``cdiv(W - 1, block)`` blocks before b, and for a group that takes the EAGLE drop the
        block above b too (``reachable_block_mask``: ``need`` + 1 blocks, shifted by one)."""
        out = []
        for g, (kind, bs, w) in enumerate(self.groups):
            if kind not in SWA_KINDS:
                continue
            table = self._table(g, req.rid)
            shift = 1 if g in self.eagle_groups else 0
            end = b // bs + shift
            for i in range(max(0, end - cdiv(w - 1, bs) - shift), end):
                if i >= len(table) or table[i].is_null or table[i].block_id in self.unpublished:
                    return None               # never held that tail, or the connector evicted it
                out.append((g, table[i].block_id, i))
        return out

    def _standing(self, req: Req, b: int) -> str | None:
        """Why b is promised to this request now: a kept tail whose blocks still hold the
        request's prefix (not reused, evicted or reset since), and every group the retention
        policy does not thin (full attention: dense in both) cached up to b. None: not promised."""
        if self.tail_needed(b):
            return None
        for *tail, why in reversed(self.promises.get(self._content(req, b), [])):
            if all(self.written.get(bid) == self._content(req, (i + 1) * self.groups[g][1]) for g, bid, i in tail) \
                    and self._dense_groups_cached(req, b):
                return why
        return None

    def _dense_groups_cached(self, req: Req, b: int) -> bool:
        ku = vllm_modules()["ku"]
        cache = self.pool.cached_block_hash_to_block
        for g, (kind, bs, _) in enumerate(self.groups):
            if kind in SWA_KINDS:
                continue
            peek = [b // bs] if g in self.eagle_groups else []     # the EAGLE drop's proof block
            for i in [*self.needed_hit(g, b), *peek]:
                h = self._group_hash(req, g, i)
                blk = cache.get_one_block(ku.make_block_hash_with_group_id(h, g)) if h else None
                if blk is None or self.written.get(blk.block_id) != self._content(req, (i + 1) * bs):
                    return False
        return True

    def _promised(self, req: Req) -> tuple[int, str]:
        """The longest hit the policy promises this request now, and why ((0, "") if none)."""
        cap = ((req.obj.num_tokens - 1) // self.align) * self.align
        for b in range(cap, 0, -self.align):
            why = self._standing(req, b)
            if why is not None:
                return b, why
        return 0, ""

    def _compare(self, r: str, n: int, hit: int, dense: int | None, promised: tuple[int, str], obs: dict) -> None:
        """`n`: the request's tokens at the lookup."""
        self.twin_stats["lookups"] += 1
        if dense is not None:
            self.twin_stats["compared_with_twin"] += 1
            self.twin_stats["below_twin"] += dense > hit
            self.twin_stats["slack_tokens"] += max(0, dense - hit)
        b, why = promised
        if b > hit:
            size = {"tokens_lost": b - hit, "prompt_tokens": n, "share": round((b - hit) / n, 3),
                    "promised": b, "dense_twin": dense, "hit": hit}
            twin = f"the dense twin hits {dense}" if dense is not None else "the twin has left the run"
            v = Violation("lost_reuse", "lost_reuse_retention",
                          f"{self.layout}: request {r} ({n} tokens): retention interval {self.interval} "
                          f"promises a hit of {b} tokens ({why}; the blocks still hold the prefix), "
                          f"{twin}, vLLM returned {hit}: {b - hit} tokens lost "
                          f"({size['share']:.0%} of the prompt)", size)
            self.lost.append(v)
            self.lost_sizes.append(size)
            obs["lost_reuse"] = str(v)


def _drop_replay_tail(orig: Any) -> Any:
    """PLANTED FAULT retention_drops_tail: the mask forgets the last SWA block before the
    replay boundary (a resend or longer sibling of the prompt then cannot hit there)."""
    def mask(*args: Any, **kw: Any) -> Any:
        out = orig(*args, **kw)
        bounds = list(kw.get("reachable_boundaries", ()))
        if out is None or kw.get("retention_interval") is None or not bounds:
            return out
        start, bs = kw["start_block"], kw["kv_cache_spec"].block_size
        a = kw["alignment_tokens"]
        j = (bounds[0] // a * a) // bs - 1
        if start <= j < kw["end_block"]:
            out[j - start] = False
        return out
    return mask


def wants_twin(layout: str, fault: str | None) -> bool:
    """The twin runs by default where retention can differ from dense: a layout with a
    retention interval (0 or N), or the planted retention fault."""
    return RETENTION.get(layout) is not None or fault == RETENTION_DROPS_TAIL.name


def twin_summary(ads: list[TwinAdapter]) -> dict:
    """Campaign totals of the twin comparison."""
    st: Counter = Counter()
    sizes: list[dict] = []
    for ad in ads:
        st.update(ad.twin_stats)
        sizes += ad.lost_sizes
    return {"lookups": st["lookups"], "compared_with_twin": st["compared_with_twin"], "below_twin": st["below_twin"],
            "slack_tokens": st["slack_tokens"], "desynced_episodes": st["desynced"],
            "lost_lookups": len(sizes), "tokens_lost": sum(s["tokens_lost"] for s in sizes),
            "max_share": max((s["share"] for s in sizes), default=0.0)}
