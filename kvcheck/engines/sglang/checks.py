"""What SGLang's radix cache must keep true after every step, checked from outside.

The adapter keeps its own shadow of what each KV slot holds (the token prefix it was written
for), who holds which lock, and a no-eviction twin of every prefix it inserted (less what the
tree reported evicting); the checks compare SGLang's tree and allocator with them. None of the
checks trusts SGLang's own counters: each is recomputed from the tree. Campaigns run them
incrementally (incremental.py: only what a step changed, a full scan every N steps);
shrinking and replay run the full scan after every step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .incremental import Incremental
from .violation import Violation


@dataclass
class Req:
    rid: str
    tokens: list[int]
    state: str = "waiting"                 # waiting | running
    node: Any = None                       # the locked node (running)
    hit: int = 0                           # the matched prefix length
    slots: list[int | None] = field(default_factory=list)   # per position; None: freed (window)
    spare: list[int] = field(default_factory=list)          # allocated, not yet written (last page)
    floor: int = 0                         # SWA: the prefill end (kept; decode frees behind the window)


def key_tokens(node: Any) -> list[int]:
    return [int(t) for t in node.key]


def tokens_of(key: Any) -> tuple[int, ...]:
    return tuple(int(t) for t in key)


def slots_of(value: Any) -> list[int]:
    """A node's values (a tensor of slot indices) as ints."""
    return value.tolist() if hasattr(value, "tolist") else [int(v) for v in value]


def ints(parts: list) -> list[int]:
    """The slots of several index tensors (None: absent), in order."""
    out: list[int] = []
    for p in parts:
        if p is not None:
            out += p.tolist()
    return out


class ShadowChecks(Incremental):
    """Mixed into the adapter: needs self.cache, self.alloc, self.lay, self.reqs,
    self.written (slot -> token prefix), self.twin (set of inserted prefixes)."""

    # ---- views of SGLang's state ---------------------------------------------------------
    def tree(self) -> list[tuple[Any, tuple[int, ...]]]:
        """Every non-root node with the token path before it."""
        out, stack = [], [(self.cache.root_node, ())]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                out.append((child, path))
                stack.append((child, self.prefix_of(path, child.key, tokens_of)))
        return out

    def vals(self, node: Any) -> list[int]:
        """A node's slots (kept while its value tensor is the same object; do not modify)."""
        return self.conv(node.value, slots_of)

    def tree_prefixes(self) -> set[tuple[int, ...]]:
        """The page-aligned prefixes the tree holds."""
        ps, out = self.lay.page_size, set()
        for node, path in self.tree():
            full = self.prefix_of(path, node.key, tokens_of)
            for end in range((len(path) // ps + 1) * ps, len(full) + 1, ps):
                out.add(full[:end])
        return out

    def free_slots(self) -> list[int]:
        a, ps = self.alloc, self.lay.page_size
        parts = [a.free_pages, getattr(a, "release_pages", None)]     # release_pages: 0.4.9+
        if ps == 1:
            return ints(parts)
        pages = a.get_all_free_pages().tolist() if hasattr(a, "get_all_free_pages") else ints(parts)
        return [p * ps + i for p in pages for i in range(ps)]

    def snapshot(self) -> dict[str, list]:
        """What dirties a slot between two checks: its free state, the prefix written to it."""
        return {"full": [frozenset(self.free_slots()), dict(self.written)]}

    def all_slots(self) -> set[int]:
        ps = self.lay.page_size
        return set(range(1, self.alloc.size + 1)) if ps == 1 else set(range(ps, (self.alloc.num_pages + 1) * ps))

    # ---- the checks ----------------------------------------------------------------------
    def check_hit(self, req: Req, hit: int, path_slots: list[int]) -> None:
        """Hit safety: every position a resume at `hit` reads is live and holds its prefix
        (full: all of [0, hit); swa: the window behind the hit)."""
        name = "hit_sound_swa_window" if "swa" in self.lay.components else "hit_sound_full"
        if hit % self.lay.page_size or hit > len(req.tokens) - 1:
            raise Violation("safety", "hit_sound", f"{req.rid}: hit {hit} is not page-aligned or "
                            f"leaves no token to compute ({len(req.tokens)} tokens)")
        if len(path_slots) != hit:
            raise Violation("safety", "hit_sound", f"{req.rid}: match says {hit} tokens, its path holds "
                            f"{len(path_slots)} slots")
        lo = max(0, hit - self.lay.window) if "swa" in self.lay.components else 0
        free = set(self.free_slots())
        for p in range(lo, hit):
            s = path_slots[p]
            want = tuple(req.tokens[:p + 1])
            if s in free or self.written.get(s) != want:
                got = "free" if s in free else self.written.get(s)
                raise Violation("safety", name, f"{req.rid}: hit {hit} reads position {p} from slot "
                                f"{s}, which holds {got!r:.60} instead of its prefix")

    def check_state(self, inc: Any = None) -> None:
        """After every step, in the leading order: locks, tree content, sizes, sanity
        (`inc`: the incremental check's memo, None: the full scan)."""
        nodes = self.walk(inc, self.tree)
        if inc is None or not inc.reqs_same:
            self._locks(nodes)
        self._content(nodes, inc)
        self._sizes(nodes, inc)
        fn = getattr(self.cache, "sanity_check", None)
        if fn is not None and self.sanity_due(inc):
            try:
                fn()
            except AssertionError as e:
                raise Violation("bookkeeping", "tree_sanity_check", f"sanity_check failed: {e}") from None
            self.sanity_passed(inc)

    def _locks(self, nodes: list) -> None:
        """lock_ref = holders through the node; a holder's path is still in the tree."""
        want: dict[int, int] = {}
        root = self.cache.root_node
        for r in self.reqs.values():
            if r.state != "running":
                continue
            n = r.node
            while n is not root:
                if n.parent is None or not any(c is n for c in n.parent.children.values()):
                    raise Violation("bookkeeping", "no_evict_locked",
                                    f"{r.rid} holds a node that is no longer in the tree")
                want[id(n)] = want.get(id(n), 0) + 1
                n = n.parent
        for node, path in nodes:
            if node.lock_ref != want.get(id(node), 0):
                raise Violation("bookkeeping", "lock_ref_equals_holders",
                                f"node at depth {len(path)} (+{len(node.key)} tokens) has lock_ref "
                                f"{node.lock_ref}, holders {want.get(id(node), 0)}")

    def _content(self, nodes: list, inc: Any = None) -> None:
        """Content shadow: every tree slot is live and holds the prefix of its position."""
        free = set(self.free_slots())
        for node, path in nodes:
            vals = self.vals(node)
            if inc is not None and inc.clean(node, (id(path), id(node.key), id(node.value)), full=vals):
                continue
            toks = self.prefix_of(path, node.key, tokens_of)
            if len(vals) != len(node.key):
                raise Violation("bookkeeping", "tree_content_matches",
                                f"node at depth {len(path)}: {len(node.key)} tokens, {len(vals)} slots")
            for i, s in enumerate(vals):
                p = len(path) + i
                if s in free:
                    raise Violation("bookkeeping", "tree_slots_live",
                                    f"tree position {p} is in slot {s}, which the allocator has free")
                if self.written.get(s) != toks[:p + 1]:
                    raise Violation("bookkeeping", "tree_content_matches",
                                    f"tree position {p} is in slot {s}, which holds "
                                    f"{self.written.get(s)!r:.60} instead of {toks[:p + 1]!r:.60}")

    def _sizes(self, nodes: list, inc: Any = None) -> None:
        """evictable + protected = tree tokens; tree + requests' own + free = capacity, disjoint."""
        c = self.cache
        total = sum(len(self.vals(n)) for n, _ in nodes)
        prot = sum(len(self.vals(n)) for n, _ in nodes if n.lock_ref > 0)
        if (inc is None or not inc.same) and (c.evictable_size(), c.protected_size()) != (total - prot, prot):
            raise Violation("bookkeeping", "size_accounting",
                            f"evictable {c.evictable_size()} / protected {c.protected_size()}, the tree "
                            f"has {total - prot} / {prot}")
        owned: list[int] = [v for n, _ in nodes for v in self.vals(n)]
        for r in self.reqs.values():
            if r.state == "running":
                owned += [s for s in r.slots[r.hit:] if s is not None] + r.spare
        free = self.free_slots()
        if self.lay.page_size > 1:      # a tree or request page is owned whole
            ps = self.lay.page_size
            owned = sorted({p * ps + i for p in {s // ps for s in owned} for i in range(ps)})
        seen = owned + free
        if len(seen) != len(set(seen)) or set(seen) != self.all_slots():
            dup = len(seen) - len(set(seen))
            lost = len(self.all_slots() - set(seen))
            raise Violation("bookkeeping", "size_accounting",
                            f"{len(owned)} owned + {len(free)} free slots of {len(self.all_slots())}: "
                            f"{dup} counted twice, {lost} leaked")
        if self.alloc.available_size() != len(free):
            raise Violation("bookkeeping", "size_accounting",
                            f"available_size {self.alloc.available_size()} != {len(free)} free slots")

    def twin_hit(self, tokens: list[int]) -> int:
        """The longest page-aligned prefix (leaving a token to compute) of the no-eviction twin."""
        ps, best = self.lay.page_size, 0
        for end in range(ps, len(tokens), ps):
            if tuple(tokens[:end]) in self.twin:
                best = end
            else:
                break
        return best
