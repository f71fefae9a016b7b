"""What UnifiedRadixCache must keep true after every step, recomputed from its tree.

On the Python tree (any release) every check reads the nodes: per-component values, lock
references and tombstones. The Rust tree core hands out no nodes (only paths, sizes and the
flattened values), so on it the checks that need nodes are replaced by the lockstep against
the Python core (unified_diff.py); the rest run on both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .checks import (Req, ShadowChecks, Violation, ints)



@dataclass
class Hold:
    """What a running request holds: the lock receipt and the SWA segment it locked."""
    receipt: Any
    seg_lo: int = 0                                  # SWA segment: positions [seg_lo, hit)
    skipped: list[tuple[int, int]] = field(default_factory=list)   # tombstones skipped (0.5.11-12)
    live: list[int] = field(default_factory=list)    # SWA positions live at lock time


class NodeView(NamedTuple):
    node: Any
    path: tuple[int, ...]            # the tokens before the node
    key: tuple[int, ...]
    full: list[int] | None           # full KV slots (None: evicted)
    swa: list[int] | None            # SWA slots (None: a tombstone, or no SWA component)
    full_lock: int
    swa_lock: int


@dataclass
class _Ranges:
    lo: int
    hi: int


def _ints(t: Any) -> list[int] | None:
    return None if t is None else (t.tolist() if hasattr(t, "tolist") else [int(v) for v in t])


def _toks(key: Any) -> tuple[int, ...]:
    return tuple(int(t) for t in key.token_ids)


class UnifiedChecks(ShadowChecks):
    """Mixed into UnifiedAdapter (needs cache, alloc, lay, reqs, holds, written(_swa), twin, CT)."""

    incremental_pays = True         # (measured: sglang_incremental.Incremental)

    # ---- views of the Python tree --------------------------------------------------------
    def _view(self, node: Any, path: tuple[int, ...]) -> NodeView:
        cd = node.component_data
        F = cd[self.CT.FULL]
        S = cd[self.CT.SWA] if self.swa else None
        return NodeView(node, path, self.conv(node.key, _toks), self.conv(F.value, _ints),
                        self.conv(S.value, _ints) if S is not None else None, F.lock_ref,
                        S.lock_ref if S is not None else 0)

    def views(self) -> list[NodeView]:
        out, stack = [], [(self.root(), ())]
        while stack:
            node, path = stack.pop()
            for ch in node.children.values():
                v = self._view(ch, path)
                out.append(v)
                stack.append((ch, self.prefix_of(path, ch.key, _toks)))
        return out

    def sig(self, v: NodeView) -> tuple:
        """What a node's content checks read, as object identities (the incremental check's)."""
        cd = v.node.component_data
        return (id(v.path), id(v.node.key), id(cd[self.CT.FULL].value),
                id(cd[self.CT.SWA].value) if self.swa else 0)

    def path_views(self, h: Any) -> list[NodeView]:
        """Root-first views of the nodes on the path to the node behind handle h."""
        chain, node, root = [], self.handle_node(h), self.root()
        while node is not root:
            if node.parent is None or not any(c is node for c in node.parent.children.values()):
                raise Violation("bookkeeping", "no_evict_locked", "a held node is no longer in the tree")
            chain.append(node)
            node = node.parent
        out, path = [], ()
        for n in reversed(chain):
            v = self._view(n, path)
            out.append(v)
            path = self.prefix_of(path, n.key, _toks)
        return out

    def tree_prefixes(self) -> set[tuple[int, ...]]:
        ps, out = self.lay.page_size, set()
        for v in self.views():
            if v.full is None:
                continue
            full = v.path + v.key
            for end in range((len(v.path) // ps + 1) * ps, len(full) + 1, ps):
                out.add(full[:end])
        return out

    # ---- pools ---------------------------------------------------------------------------
    def swa_of(self, slot: int) -> int:
        return int(self.alloc.full_to_swa_index_mapping[slot])

    def swa_map(self) -> list[int]:
        """The full -> SWA slot mapping now (read once per check)."""
        return self.alloc.full_to_swa_index_mapping.tolist() if self.swa else []

    def _free_sets(self) -> tuple[set[int], set[int]]:
        if not self.swa:
            return set(ShadowChecks.free_slots(self)), set()

        def free(a: Any) -> set[int]:
            return set(ints([a.free_pages, a.release_pages]))
        return free(self.alloc.full_attn_allocator), free(self.alloc.swa_attn_allocator)

    def free_slots(self) -> list[int]:
        return sorted(self._free_sets()[0])

    def snapshot(self) -> dict[str, list]:
        full_free, swa_free = self._free_sets()
        if not self.swa:
            return {"full": [frozenset(full_free), dict(self.written)]}
        return {"full": [frozenset(full_free), dict(self.written), self.swa_map()],
                "swa": [frozenset(swa_free), dict(self.written_swa)]}

    def swa_live(self, slot: int, prefix: tuple[int, ...], swa_free: set[int], m: list[int] | None = None) -> bool:
        s = self.swa_of(slot) if m is None else m[slot]
        return s > 0 and s not in swa_free and self.written_swa.get(s) == prefix

    # ---- hit safety and reuse ------------------------------------------------------------
    def check_hit(self, req: Req, hit: int, path: list[int]) -> None:
        """Full KV for all of [0, hit); with SWA, live SWA KV for the window [hit - W, hit)."""
        if hit % self.lay.page_size or hit > len(req.tokens) - 1 or len(path) != hit:
            raise Violation("safety", "hit_sound", f"{req.rid}: match says {hit} tokens, its path holds "
                            f"{len(path)} slots ({len(req.tokens)} tokens, page {self.lay.page_size})")
        full_free, swa_free = self._free_sets()
        for p in range(hit):
            if path[p] in full_free or self.written.get(path[p]) != tuple(req.tokens[:p + 1]):
                raise Violation("safety", "hit_sound_full", f"{req.rid}: hit {hit} reads full KV of position "
                                f"{p} from slot {path[p]}, which does not hold its prefix")
        m = self.swa_map()
        for p in range(max(0, hit - self.W), hit) if self.swa else ():
            if not self.swa_live(path[p], tuple(req.tokens[:p + 1]), swa_free, m):
                raise Violation("safety", "hit_sound_swa_window", f"{req.rid}: hit {hit} needs SWA KV of "
                                f"position {p} (window {self.W}), which is not live")

    def check_reuse(self, req: Req, hit: int) -> None:
        """Lost reuse (Python tree): the no-eviction twin holds more full KV than the tree; with
        SWA, the tree holds a longer prefix with a live window behind it than the match gave."""
        if self.core == "rust":
            return
        usable, present = self.usable_hit(req.tokens)
        want = self.twin_hit(req.tokens)
        if want > (present if self.swa else hit):
            raise Violation("lost_reuse", "lost_reuse", f"{req.rid}: the no-eviction twin holds a {want}-token "
                            f"prefix, the tree {'has full KV for' if self.swa else 'matched'} "
                            f"{present if self.swa else hit}")
        if self.swa and usable > hit:
            raise Violation("lost_reuse", "lost_reuse", f"{req.rid}: the tree holds a {usable}-token prefix with "
                            f"a live window behind it, the match returned {hit}")

    def usable_hit(self, tokens: list[int]) -> tuple[int, int]:
        """(longest page-aligned prefix leaving a token whose full KV is in the tree and whose
        window is live; the longest whose full KV is in the tree)."""
        ps, q = self.lay.page_size, tokens[:-1]
        node, p, slots = self.root(), 0, []
        while p < len(q):
            nxt = None
            for c in node.children.values():
                k = self.conv(c.key, _toks)
                if k[:1] == tuple(q[p:p + 1]) and c.component_data[self.CT.FULL].value is not None:
                    nxt = (c, k)
                    break
            if nxt is None:
                break
            c, k = nxt
            m = 0
            while m < len(k) and p + m < len(q) and k[m] == q[p + m]:
                m += 1
            slots += self.conv(c.component_data[self.CT.FULL].value, _ints)[:m]
            p += m
            if m < len(k):
                break
            node = c
        present = len(slots) // ps * ps
        if not self.swa:
            return present, present
        _, swa_free = self._free_sets()
        m = self.swa_map()
        live = [self.swa_live(slots[i], tuple(tokens[:i + 1]), swa_free, m) for i in range(present)]
        best = 0
        for L in range(1, present + 1):
            if all(live[max(0, L - self.W):L]):
                best = L
        return best, present

    # ---- locks ---------------------------------------------------------------------------
    def lock_model(self, h: Any, hit: int) -> Any:
        """Before inc_lock_ref: the SWA segment SGLang's acquire walk will count (from the node up
        until a window of positions is covered; 0.5.11-0.5.12 skip tombstones without counting
        them, TreeCore releases count them) and the SWA positions live in it."""
        hold = Hold(None)
        if not self.swa or self.core == "rust" or hit == 0:
            return hold
        pv = self.path_views(h)
        covered, ends = 0, hit
        hold.seg_lo = 0
        for v in reversed(pv):
            lo = len(v.path)
            if v.swa is None and self.skips_tombstones:
                hold.skipped.append((lo, ends))
            else:
                covered += len(v.key)
                hold.seg_lo = lo
            ends = lo
            if covered >= self.W:
                break
        else:
            hold.seg_lo = 0
        path = [s for v in pv for s in (v.full or [])]
        _, swa_free = self._free_sets()
        reqtok, m = pv[-1].path + pv[-1].key, self.swa_map()
        hold.live = [p for p in range(hold.seg_lo, hit) if self.swa_live(path[p], reqtok[:p + 1], swa_free, m)]
        return hold

    def _locks(self, views: list[NodeView], inc: Any = None) -> None:
        full: dict[int, int] = {}
        swa: dict[int, int] = {}
        full_free, swa_free = self._free_sets()
        m = self.swa_map()
        locks = inc is None or not inc.reqs_same     # (else: the tree and its holders are as they were)
        for r in self.reqs.values():
            if r.state != "running":
                continue
            hold = self.holds[r.rid]
            for v in self.path_views(r.node) if r.hit and locks else ():
                full[id(v.node)] = full.get(id(v.node), 0) + 1
                lo, hi = len(v.path), len(v.path) + len(v.key)
                if self.swa and lo >= hold.seg_lo and not any(a <= lo and hi <= b for a, b in hold.skipped):
                    swa[id(v.node)] = swa.get(id(v.node), 0) + 1
            self._held_live(r, hold, full_free, swa_free, m, inc)
        self.coverage["state:swa_locked_nodes_checked"] += sum(1 for v in views if v.swa_lock > 0)
        for v in views if locks else ():
            got, want = (v.full_lock, v.swa_lock), (full.get(id(v.node), 0), swa.get(id(v.node), 0))
            if got != want:
                raise Violation("bookkeeping", "lock_ref_equals_holders", f"node at depth {len(v.path)} "
                                f"(+{len(v.key)} tokens): (full, swa) lock_ref {got}, holders {want}")

    def _held_live(self, r: Req, hold: Any, full_free: set[int], swa_free: set[int], m: list[int],
                   inc: Any = None) -> None:
        """A running request's prefix stays live while it holds the lock: full KV of [0, hit), and
        the SWA positions that were live in its locked window when it locked."""
        if inc is not None and inc.req_clean(r.rid, (id(r.node), r.hit, id(hold)), full=r.slots[:r.hit],
                                             swa=[m[r.slots[p]] for p in hold.live]):
            return
        for p in range(r.hit):
            s = r.slots[p]
            if s in full_free or self.written.get(s) != tuple(r.tokens[:p + 1]):
                raise Violation("bookkeeping", "no_evict_locked", f"{r.rid} holds position {p} (slot {s}), "
                                "which was freed or overwritten under its lock")
        for p in hold.live:
            if not self.swa_live(r.slots[p], tuple(r.tokens[:p + 1]), swa_free, m):
                raise Violation("bookkeeping", "no_evict_locked", f"{r.rid}: SWA KV of position {p}, live "
                                "and in its locked window when it locked, was evicted under the lock")

    # ---- after every step ----------------------------------------------------------------
    def check_state(self, inc: Any = None) -> None:
        if self.core == "rust":
            self._rust_checks(inc)
        else:
            views = self.walk(inc, self.views)
            self._locks(views, inc)
            self._u_content(views, inc)
            self._u_sizes(views, inc)
        # it assumes an idle scheduler
        if not any(r.state == "running" for r in self.reqs.values()) and self.sanity_due(inc):
            try:
                self.cache.sanity_check()
            except Exception as e:
                raise Violation("bookkeeping", "tree_sanity_check", f"sanity_check failed: {str(e)[:300]}") from None
            self.sanity_passed(inc)

    def _u_content(self, views: list[NodeView], inc: Any = None) -> None:
        full_free, swa_free = self._free_sets()
        m = self.swa_map()
        if inc is not None:                  # the nodes a step changed, or whose slots it changed
            views = [v for v in views if not inc.clean(v.node, self.sig(v), full=v.full, swa=v.swa)]
        for live_pass in (False, True):      # content first: a shifted value is reported as such
            for v in views:
                toks = v.path + v.key
                for i, s in enumerate(v.full or []):
                    p = len(v.path) + i
                    if not live_pass and self.written.get(s) != toks[:p + 1]:
                        raise Violation("bookkeeping", "tree_content_matches", f"tree position {p} is in slot {s}, "
                                        f"which holds {self.written.get(s)!r:.60} instead of {toks[:p + 1]!r:.60}")
                    if live_pass and s in full_free:
                        raise Violation("bookkeeping", "tree_slots_live",
                                        f"tree position {p} is in slot {s}, which the allocator has free")
                if v.full is not None and len(v.full) != len(v.key):
                    raise Violation("bookkeeping", "tree_content_matches",
                                    f"node at depth {len(v.path)}: {len(v.key)} tokens, {len(v.full)} slots")
                for i, s in enumerate(v.swa or []):
                    p, full_slot = len(v.path) + i, v.full[i] if v.full else None
                    if not live_pass and (full_slot is None or m[full_slot] != s
                                          or self.written_swa.get(s) != toks[:p + 1]):
                        raise Violation("bookkeeping", "tree_content_matches", f"tree position {p}: SWA slot {s} "
                                        f"is not the full slot's ({full_slot}) or does not hold its prefix")
                    if live_pass and s in swa_free:
                        raise Violation("bookkeeping", "tree_slots_live",
                                        f"tree position {p} is in SWA slot {s}, which the allocator has free")

    def _own(self) -> list[int]:
        return [s for r in self.reqs.values() if r.state == "running"
                for s in r.slots[r.hit:] + r.spare if s is not None]

    def _pool(self, name: str, owned: list[int], free: set[int], every: set[int], paged: bool = False) -> None:
        if paged:
            ps = self.lay.page_size
            owned = sorted({p * ps + i for p in {s // ps for s in owned} for i in range(ps)})
        seen = owned + sorted(free)
        if len(seen) != len(set(seen)) or set(seen) != every:
            raise Violation("bookkeeping", "size_accounting", f"{name}: {len(owned)} owned + {len(free)} free of "
                            f"{len(every)}: {len(seen) - len(set(seen))} counted twice, {len(every - set(seen))} leaked")

    def _u_sizes(self, views: list[NodeView], inc: Any = None) -> None:
        c = self.cache
        tree = inc is None or not inc.same       # (else: the tree and SGLang's counters are as they were)
        live = [v for v in views if v.full is not None]
        tot, prot = sum(len(v.full) for v in live), sum(len(v.full) for v in live if v.full_lock > 0)
        if tree and (c.full_evictable_size(), c.full_protected_size()) != (tot - prot, prot):
            raise Violation("bookkeeping", "size_accounting", f"full evictable {c.full_evictable_size()} / "
                            f"protected {c.full_protected_size()}, the tree has {tot - prot} / {prot}")
        full_free, swa_free = self._free_sets()
        every = self.all_slots() if not self.swa else set(range(1, self.capacity + 1))
        self._pool("full", [s for v in live for s in v.full] + self._own(), full_free, every,
                   paged=self.lay.page_size > 1)
        if not self.swa:
            if self.alloc.available_size() != len(full_free):
                raise Violation("bookkeeping", "size_accounting",
                                f"available_size {self.alloc.available_size()} != {len(full_free)} free slots")
            return
        sv = [v for v in views if v.swa is not None]
        stot, sprot = sum(len(v.swa) for v in sv), sum(len(v.swa) for v in sv if v.swa_lock > 0)
        if tree and (c.swa_evictable_size(), c.swa_protected_size()) != (stot - sprot, sprot):
            raise Violation("bookkeeping", "size_accounting", f"swa evictable {c.swa_evictable_size()} / "
                            f"protected {c.swa_protected_size()}, the tree has {stot - sprot} / {sprot}")
        m = self.swa_map()
        self._pool("swa", [s for v in sv for s in v.swa] + [m[s] for s in self._own()], swa_free,
                   set(range(1, self.size_swa + 1)))

    def _rust_checks(self, inc: Any = None) -> None:
        """What the Rust core exposes: holders' prefixes live, sizes against the flattened tree, pools."""
        c = self.cache
        full_free, swa_free = self._free_sets()
        m = self.swa_map()
        for r in self.reqs.values():
            if r.state == "running":
                self._held_live(r, self.holds[r.rid], full_free, swa_free, m, inc)
        vals = _ints(c.all_values_flatten())
        tot, aux = c.total_size()
        if c.full_evictable_size() + c.full_protected_size() != len(vals) or tot != len(vals):
            raise Violation("bookkeeping", "size_accounting", f"full evictable {c.full_evictable_size()} + protected "
                            f"{c.full_protected_size()}, total_size {tot}, the tree's values {len(vals)}")
        for s in vals:
            if s in full_free:
                raise Violation("bookkeeping", "tree_slots_live", f"the tree holds slot {s}, which the allocator has free")
        every = self.all_slots() if not self.swa else set(range(1, self.capacity + 1))
        self._pool("full", vals + self._own(), full_free, every, paged=self.lay.page_size > 1)
        if self.swa and (c.swa_evictable_size() + c.swa_protected_size() != aux
                         or aux + len(self._own()) + len(swa_free) != self.size_swa):
            raise Violation("bookkeeping", "size_accounting", f"swa evictable {c.swa_evictable_size()} + protected "
                            f"{c.swa_protected_size()}, tree {aux}, own {len(self._own())}, free {len(swa_free)} "
                            f"of {self.size_swa}")
