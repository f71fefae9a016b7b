"""The vLLM adapter's own checks: a shadow content model independent of vLLM's hashes, the
ground truth of what a resume reads, and the safety, bookkeeping and lost-reuse checks.

Every block a request writes is stamped with the exact token prefix (and cache salt) it was
computed from; a hit is *safe* when it is aligned, leaves the last token, has one length
across groups and every block the resume reads (``kvcheck.spec.objects.needed_objects`` on
the layout's Config) holds the right content; *bookkeeping* holds when ref counts equal
holders, the free queue is exactly the unreferenced blocks, the null block is inert, no block
is shared unless complete and identical, every published hash maps to its content and a
running request's window is intact; *lost reuse* is a hit shorter than the spec allows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcheck.spec.objects import needed_objects

from . import mamba
from .violation import Violation
from .bookkeeping import Bookkeeping
from .content import prefix
from .layouts import cdiv, vllm_modules


def _per_layout(fn: Any) -> Any:
    """Memoise a pure function of the adapter's layout (its ground-truth rules): the hot path
    asks the same (group, length) questions every step."""
    def memo(self: Any, *a: Any) -> Any:
        m = self.__dict__.setdefault(f"_memo_{fn.__name__}", {})
        got = m.get(a)
        if got is None:
            got = m[a] = fn(self, *a)
        return got
    memo.__doc__, memo.__name__ = fn.__doc__, fn.__name__
    return memo


@dataclass
class Req:
    rid: str
    obj: Any                  # vllm Request
    salt: str | None
    state: str = "waiting"    # waiting | running | preempted
    owned: list[set[int]] = field(default_factory=list)   # per group: blocks this request wrote
    hashed: int = 0           # hash blocks whose content is recorded (hashes only grow)
    stamped: int = 0          # computed tokens when its blocks were last stamped
    state_block: int | None = None   # engine drive, Mamba: its running state's table index this step
    prefixes: dict = field(default_factory=dict, repr=False)   # end -> _content (a memo)
    chain: Any = field(default=None, repr=False)               # its tokens' prefix hashes (content.py)


class ShadowChecks(Bookkeeping):
    """The checks, mixed into the adapter (its manager, pool, groups and requests); the
    bookkeeping check is bookkeeping.py's."""

    groups: list[tuple[str, int, int | None]]
    reqs: dict[str, Req]
    written: dict[int, tuple]
    hash_content: dict[bytes, tuple]
    hb: int                   # hash block size (tokens)
    eagle_groups: set[int]    # groups whose hits take the EAGLE drop

    # ---- shadow content model ------------------------------------------------------------
    def _table(self, g: int, rid: str) -> list:
        m = self.coord.single_type_managers[g].req_to_blocks
        return m[rid] if rid in m else []

    def _own(self, req: Req, new: Any) -> None:
        for g, lst in enumerate(new.blocks):
            req.owned[g].update(b.block_id for b in lst if not b.is_null)

    @staticmethod
    def _content(req: Req, end: int) -> tuple:
        # one object per (request, prefix): equal contents of one request compare by identity
        got = req.prefixes.get(end)
        if got is None:
            got = prefix(req, end)
            if end <= len(got[1]):          # (a prefix past the tokens would grow later)
                req.prefixes[end] = got
        return got

    def _after_step(self) -> None:
        # Only what changed since the last step is recorded: new hashes, and the blocks that
        # overlap the tokens computed since (a block's content changes only when its owner writes).
        hc = self.hash_content
        for req in self.reqs.values():
            o = req.obj
            hs = o.block_hashes
            for j in range(req.hashed, len(hs)):
                k = bytes(hs[j])
                if k not in hc:
                    hc[k] = self._content(req, (j + 1) * self.hb)
            for g, (_, bs, _) in enumerate(self.groups):    # larger blocks' own keys
                for i in range(req.hashed * self.hb // bs, len(hs) * self.hb // bs if bs != self.hb else 0):
                    h = self._group_hash(req, g, i)
                    if h is not None and bytes(h) not in hc:
                        hc[bytes(h)] = self._content(req, (i + 1) * bs)
            req.hashed = len(hs)
            if req.state != "running":
                continue
            self._stamp(req, min(o.num_computed_tokens, o.num_tokens))   # (draft positions: once accepted)
        self.check_step()

    def _stamp(self, req: Req, n: int) -> None:
        """Record what `req`'s blocks hold once its tokens up to `n` are computed (its own blocks)."""
        lo = req.stamped
        for g, (kind, bs, _) in enumerate(self.groups):
            if kind == mamba.MAMBA:             # a state block: written whole, at n
                mamba.stamp(self, req, g, n)
                continue
            table = self._table(g, req.rid)
            for i in range(lo // bs, min(len(table), cdiv(n, bs))):
                b = table[i]
                if b.block_id in req.owned[g] and not b.is_null:
                    end = min((i + 1) * bs, n)
                    if end > i * bs:
                        self.written[b.block_id] = self._content(req, end)
        # (never lowered: a request cut back -- a failed connector load's truncation -- keeps what its
        # published blocks are promised to hold; preemption forgets its blocks and restarts at 0)
        req.stamped = max(lo, n)

    def _check_table_starts(self, req: Req, blocks: Any, hit: int) -> None:
        """An admitted request's block table starts with exactly its hit blocks."""
        r = req.rid
        bs = [x[1] for x in self.groups]
        # the admitted table starts with exactly the hit blocks
        for g, lst in enumerate(blocks.blocks):
            table = self._table(g, r)
            # (allocate_slots may already have nulled blocks that fell out of a window)
            if len(table) < len(lst) or any(t.block_id != b.block_id and not t.is_null
                                            and not (i == hit // bs[g] and hit % bs[g])   # copy-on-write
                                            for i, (t, b) in enumerate(zip(table, lst))):
                raise Violation("bookkeeping", "hit_blocks_bound",
                                f"group {g}: request {r}'s table does not start with its hit blocks")

    def _judge_hit(self, req: Req, usable: int, hit: int) -> dict[str, Any]:
        """A hit shorter than the spec allows is lost reuse (recorded); a longer one, a divergence."""
        r, o = req.rid, req.obj
        self.last_usable = usable         # (what a known defect's fixed lookup is judged against)
        if hit < usable:
            v = Violation("lost_reuse", "lost_reuse",
                          f"{self.layout}: request {r} ({o.num_tokens} tokens): the spec allows a "
                          f"hit of {usable} tokens from the cached blocks, vLLM returned {hit}",
                          {"tokens_lost": usable - hit, "prompt_tokens": o.num_tokens,
                           "share": round((usable - hit) / o.num_tokens, 3), "usable": usable, "hit": hit})
            self.lost.append(v)
            return {"lost_reuse": str(v)}
        elif hit > usable:
            raise Violation("divergence", "hit_exceeds_spec",
                            f"vLLM hit {hit} > spec-usable {usable} for {r} although every needed "
                            "block holds the right content (alignment rule differs?)")
        return {}

    # ---- ground truth --------------------------------------------------------------------
    @_per_layout
    def needed_hit(self, g: int, L: int) -> list[int]:
        """Physical blocks of group g that a resume at L (a multiple of the hash block) reads."""
        kind, bs, p = self.groups[g]
        if kind == "chunked_local":   # not a spec layer kind: [C*floor(L/C), L)
            lo = (L // p) * p
            return list(range(lo // bs, cdiv(L, bs)))
        if kind == "tail_ring":       # not prefix-cacheable: never part of a hit
            return []
        if kind == mamba.MAMBA:       # spec: the recurrent state at the boundary, nothing older
            sg = next(x for x in self.cfg.groups if x.kind == mamba.MAMBA)
            return [j * self.hb // bs for j in needed_objects(self.cfg, sg, L // self.hb)["recurrent_state"]]
        if kind in ("compressed", "indexer"):
            sk = "csa" if p == 4 else "hca"
            sg = next(x for x in self.cfg.groups if x.kind == sk)
            obj = "indexer" if kind == "indexer" else "compressed_kv"
            js = needed_objects(self.cfg, sg, L // self.hb)[obj]
            return sorted({j * self.hb // bs for j in js})
        skind, w = ("full", None) if kind in ("full", "mla", "mla_indexer") else ("swa", p)
        sg = next(x for x in self.cfg.groups if x.kind == skind and x.window == w)
        js = needed_objects(self.cfg, sg, L // self.hb)["swa_window"]
        return sorted({j * self.hb // bs for j in js})

    @_per_layout
    def needed_running(self, g: int, L: int) -> list[int]:
        """Blocks the next token of a request at L computed tokens reads (token-level rule)."""
        kind, bs, p = self.groups[g]
        if kind == "tail_ring":
            return []
        if kind in ("compressed", "indexer"):   # entries of complete compression blocks
            return list(range(0, (L // p) * p // bs))
        if kind == mamba.MAMBA:        # the running state only
            return [cdiv(L, bs) - 1] if L else []
        if kind in ("full", "mla", "mla_indexer"):
            lo = 0
        elif kind == "chunked_local":
            lo = (L // p) * p
        else:
            lo = max(0, L - p + 1)
        return list(range(lo // bs, cdiv(L, bs)))

    def _check_kind(self, g: int) -> str:
        return {"chunked_local": "hit_sound_chunked_local", "compressed": "hit_sound_compressed_kv",
                "indexer": "hit_sound_indexer",
                mamba.MAMBA: "hit_sound_recurrent_state"}.get(self.groups[g][0], "hit_sound_swa_window")

    @_per_layout
    def tail_needed(self, L: int) -> bool:
        """Does a resume at L need a tail snapshot (a compression block open at L)? vLLM keeps
        the open group's raw keys in a per-request ring that is never prefix-cached."""
        return any(needed_objects(self.cfg, sg, L // self.hb).get("tail")
                   for sg in self.cfg.groups if "tail" in sg.objects)

    def _group_hash(self, req: Req, g: int, i: int) -> bytes | None:
        """The prefix-cache key of group g's block i, derived the way the installed release
        derives it (its own BlockHashListWithBlockSize: the last hash-block hash in 0.33,
        the concatenation of the block's hash-block hashes in earlier releases)."""
        bs = self.groups[g][1]
        hs = req.obj.block_hashes
        if (i + 1) * bs // self.hb > len(hs):
            return None
        if bs == self.hb:
            return hs[i]
        return vllm_modules()["ku"].BlockHashListWithBlockSize(hs, self.hb, bs)[i]

    def spec_usable(self, req: Req) -> int:
        """Longest hit the spec allows: aligned, <= tokens-1, and every needed block of every
        group present in the prefix-cache map with the right content. A group that takes the
        EAGLE drop also needs the block just past the hit (its drafter recomputes that block's
        hidden states, so the hit must be proven one block longer, within the hashed prompt)."""
        cap = ((req.obj.num_tokens - 1) // self.align) * self.align
        cap = min(cap, self.full_reach(req) // self.align * self.align)
        for L in range(cap, 0, -self.align):
            if self.usable_at(req, L) is not None:
                return L
        return 0

    def full_reach(self, req: Req) -> int:
        """Tokens up to the first block a whole-block full-attention group lacks (or holds with
        other content): a resume past it needs that block, so no longer hit is usable. One pass
        instead of one per candidate length: at real size a lookup has hundreds of candidates."""
        if mamba.partial(self):
            return 1 << 62                    # (fine-grained groups: entries inside blocks)
        reach = 1 << 62
        for g, (kind, bs, _) in enumerate(self.groups):
            if kind not in ("full", "mla", "mla_indexer"):
                continue
            i = 0
            while i * bs < reach and self._cached_holds(req, g, i, (i + 1) * bs):
                i += 1
            reach = min(reach, i * bs)
        return reach

    def _cached_holds(self, req: Req, g: int, i: int, end: int) -> bool:
        """Is group g's block i under its own key in the prefix-cache map, holding exactly the
        request's first `end` tokens (a state: the state after them)?"""
        h = self._group_hash(req, g, i)
        blk = self.pool.cached_block_hash_to_block.get_one_block(
            vllm_modules()["ku"].make_block_hash_with_group_id(h, g)) if h else None
        return blk is not None and self.written.get(blk.block_id) == self._content(req, end)

    def usable_at(self, req: Req, L: int) -> list[tuple] | None:
        """The prefix-cache entries that make a hit at L usable (the witness a reproducer shows:
        ("block", g, i) = group g's block i under its own key, ("entry", g, end) = the entry keyed
        at `end` tokens of a fine-grained group), or None when L is not usable."""
        hashed = len(req.obj.block_hashes) * self.hb
        fine = mamba.partial(self)            # hits inside blocks (0.33's fine-grained lookup)
        if self.tail_needed(L):
            return None
        witness: list[tuple] = []
        for g in range(len(self.groups)):
            if fine and self.groups[g][0] in mamba.FINE_KINDS:
                if not mamba.fine_usable(self, req, g, L, g in self.eagle_groups, witness):
                    return None
                continue
            need = self.needed_hit(g, L)
            if g in self.eagle_groups and self.groups[g][0] != "tail_ring":
                bs = self.groups[g][1]
                if L + bs > hashed:
                    return None
                need = [*need, L // bs]
            kind, bs, _ = self.groups[g]
            for i in need:
                end = L if kind == mamba.MAMBA else (i + 1) * bs    # (whole blocks here: not fine-grained)
                if not self._cached_holds(req, g, i, end):
                    return None
                witness.append(("block", g, i))
        return witness

    # ---- checks ----------------------------------------------------------------------------
    def _check_hit(self, req: Req, blocks: Any, hit: int) -> None:
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
            if len(lst) != cdiv(hit, bs):      # (a fine-grained hit may end inside a block)
                dropped = g in self.eagle_groups and len(lst) == cdiv(hit, bs) - 1 and any(
                    k == mamba.MAMBA and len(x) == cdiv(hit, b2) for (k, b2, _), x in zip(self.groups, blocks.blocks))
                raise Violation("safety", "hit_length_equal",
                                f"group {g} ({self.groups[g][0]}) returned {len(lst)} blocks of {bs} "
                                f"for a {hit}-token hit" + (" (the EAGLE group dropped its last block while the "
                                                            "Mamba groups kept the hit: the resume skips that "
                                                            "block's tokens)" if dropped else ""))
            need = set(self.needed_hit(g, hit)) if hit else set()
            kind = self.groups[g][0]
            for i, b in enumerate(lst):
                end, exact = ((i + 1) * bs, True) if kind != mamba.MAMBA and (i + 1) * bs <= hit \
                    else mamba.block_want(kind, bs, i, hit)      # (a state, or a block the hit ends in)
                want = self._content(req, end)
                if i in need and b.is_null:
                    raise Violation("safety", self._check_kind(g),
                                    f"{self.layout} group {g} ({self.groups[g][0]}): hit of {hit} tokens "
                                    f"for {r}, but block {i} (tokens {i*bs}..{(i+1)*bs-1}) that the resume "
                                    "reads is the null block")
                w = self.written.get(b.block_id)
                if not b.is_null and (w != want if exact else not mamba.holds(w, want, exact)):
                    raise Violation("safety", self._check_kind(g),
                                    f"{self.layout} group {g}: hit of {hit} tokens for {r} returns block "
                                    f"#{b.block_id} at index {i} whose content is not the request's "
                                    + ("state at the hit" if kind == mamba.MAMBA else "prefix")
                                    + (f" (it is published under the key of {end} tokens but holds the state "
                                       f"after {len(w[1])}: a stale prefix-cache entry)"
                                       if kind == mamba.MAMBA and w is not None and len(w[1]) != end else ""))
