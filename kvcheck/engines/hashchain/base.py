"""A base class for adapters of paged, hash-chain block managers (vLLM-style prefix caches).

The user supplies the manager's own operations as callbacks — `start` (a fresh manager),
`hash`, `lookup`, `allocate`, `free`, and optionally `evict` and `decode_append` — and this
class supplies the rest of an adapter: the request lifecycle the spec's actions walk
(submit, lookup, bind, use, append, finish, preempt, resume, evict), the token content of
requests, the mapping of the manager's state onto the spec's (a full-attention config: one
group, `swa_window` pages), and an independent content shadow (shadow.py) that
reports a hit reusing a block that holds other content as an UNSAFE HIT.

Prompts with content (config `prompts = K`, spec/content.py): each request carries the
tokens (and tenant) of its prompt, allocated with its own chained hashes, so a manager whose
hash confuses two prompts serves a hit on real traffic, reported as an UNSAFE HIT. The spec
keeps one prompt per block position: when a request writes another prompt's block at a position
whose cached copy is unreferenced, this class evicts that copy after the allocation with
`evict`, or, without one, stops counting it. Holders are counted per physical block id and a
logical block is cached while any copy of its content is (legal duplicates; with duplicates =
"allow" and publish = "release", copies and late publishing are mapped onto the spec's copy
actions: copies.py, writes.py). Every eviction the manager does by itself inside an allocation (its LRU) is
reported as engine-initiated `("evict", j)` events before the append (spec/events.py). With
`alloc = "evict"`, `append_fail(r, j, x)` runs the manager's allocation where the spec says
nothing is evictable, and preempts the newest request (`{"instead": {"x": ...}}` when that is
not the spec's x). `append_evict` (the spec choosing the victim) is not declared: with full
attention and one copy per position the spec never enables it. With `prompts = 1`, read-only
shadow queries after each lookup ask about sibling prompts and another tenant. See
docs/adapters.md, "Hash-chain managers".
"""
from __future__ import annotations

from typing import Any

from kvcheck.spec.config import Config
from kvcheck.spec.content import chain as lineage
from kvcheck.spec.objects import (DECISIONS, READY, R_BOUND, R_DECIDED, R_IDLE,
                                  R_PREEMPTED, R_RUNNING, R_WAITING)
from kvcheck.spec.state import Layout
from kvcheck.spec.sut import ActionRejected
from kvcheck.fuzz.lockstep import Finding
from .copies import CopyActions, released
from .mapping import observe
from .writes import Writes
from .shadow import ContentShadow, prompt_table, siblings

TENANT, OTHER_TENANT = "tenant-0", "tenant-1"
CORE_ACTIONS = frozenset({"submit", "lookup", "bind", "use", "append", "finish", "preempt", "resume"})
# What this class declares besides the core, and what in a config or an adapter reaches it
# (adapter-check names these as the base class's declarations, never as the user's to drop).
REACH = {"evict": "an evict callback",
         "append_fail": 'alloc = "evict" in the config',
         "bind_stale": "an evict callback (an eviction between a lookup and its bind)",
         "append_copy": 'duplicates = "allow" in the config',
         "append_evict_copy": 'duplicates = "allow" and alloc = "evict" in the config',
         "evict_copy": 'duplicates = "allow" in the config and an evict callback'}


class HashChainAdapter(Writes, CopyActions):
    """Subclass it and implement the callbacks below (block ids are ints, requests are the
    spec's request slots 0..requests-1)."""

    name = "hashchain"
    faults: dict[str, str] = {}

    # ---- what the user supplies ------------------------------------------------------------
    def start(self, num_blocks: int, block_size: int) -> None:
        """Make a fresh, empty manager with `num_blocks` physical blocks of `block_size` tokens."""
        raise NotImplementedError

    def hash(self, parent: Any, tokens: tuple[int, ...], extra: tuple[str, ...]) -> Any:
        """The manager's block hash: of the parent block's hash (None for the first block), this
        block's tokens and the extra keys (here: the tenant's cache salt)."""
        raise NotImplementedError

    def lookup(self, hashes: list[Any]) -> list[int]:
        """Read-only: the block ids of the longest cached prefix of `hashes` (one per block)."""
        raise NotImplementedError

    def allocate(self, req: int, block_hash: Any, hit: int | None = None) -> int | None:
        """Give request `req` a block: `hit` a cached block to reuse (take a reference), or None
        for a fresh block that the request fills and publishes under `block_hash` (None: not full
        yet, see decode_append). Returns the block id, or None when there is no room."""
        raise NotImplementedError

    def free(self, req: int, blocks: list[int]) -> None:
        """Request `req` releases its references on `blocks` (cached blocks stay cached)."""
        raise NotImplementedError

    # optional: evict(block) -> bool (drop a cached, unreferenced block; False: refused) and
    # decode_append(req, block, token, block_hash) (one decoded token into `block`; block_hash
    # is its hash when this token fills it, else None).

    # ---- the adapter kvcheck runs ----------------------------------------------------------
    def __init__(self, fault: str | None = None) -> None:
        self.fault = fault
        cls = type(self)
        self.evicts = getattr(cls, "evict", None) is not None
        self.decodes = getattr(cls, "decode_append", None) is not None
        self.actions = self._declare("evict")

    def _declare(self, alloc: str) -> frozenset[str]:
        """The actions this class declares for a config (`alloc`; after reset, its `duplicates`):
        the core, `evict` with an evict callback, `append_fail` where allocations evict (alloc =
        "evict"), `bind_stale` where a decided hit can go (append_evict: never enabled here, see
        the docstring), the copy actions where duplicates are allowed (copies.py)."""
        acts = set(CORE_ACTIONS) | ({"evict"} if self.evicts else set())
        if alloc == "evict":
            acts.add("append_fail")
        if self.evicts:     # (allocations alone never evict a decided hit: one prefix, LRU takes no hole)
            acts.add("bind_stale")
        if getattr(getattr(self, "cfg", None), "duplicates", "forbid") == "allow":
            acts |= {"append_copy"} | ({"append_evict_copy"} if alloc == "evict" else set()) \
                | ({"evict_copy"} if self.evicts else set())
        self.base_actions = {a: REACH.get(a, "the core lifecycle") for a in acts}
        return frozenset(acts)

    def reset(self, cfg: Config) -> None:
        if [g.kind for g in cfg.groups] != ["full"]:
            raise ValueError("HashChainAdapter maps one full-attention group; the config has "
                             + ", ".join(g.name for g in cfg.groups))
        self.cfg, self.lay, self.B = cfg, Layout(cfg), cfg.block_size
        self.num_blocks = min(cfg.cap("swa_window"), 1 << 16)
        self.actions = self._declare(cfg.alloc)
        self.start(self.num_blocks, self.B)
        self.shadow = ContentShadow(self.B)
        if cfg.decode:
            raise ValueError("HashChainAdapter decodes inside append (decode_append); the config's "
                             "decode = true is not mapped yet")
        if cfg.publish == "release" and cfg.prompts > 1 and not self.evicts:
            raise ValueError("HashChainAdapter: a late publisher (publish = \"release\") with prompts > 1 "
                             "needs an evict callback (another prompt's copy of a rewritten position goes)")
        self.prompts = prompt_table(cfg, TENANT)
        self.tokens = self.prompts[0][1]
        self.want: list[Any] = [None] * cfg.blocks   # the content (tenant, prefix) block j stands for
        self.stale: set[int] = set()           # block ids whose content the spec no longer counts
        self.state = [0] * cfg.blocks          # logical block j's spec lifecycle state
        self.lineage = [0] * cfg.blocks        # the prompt lineage block j's copy holds (bcid)
        self.published: set[int] = set()       # logical blocks whose hash is published (`hashed`)
        self.pub: dict[int, int] = {}          # logical block -> the copy its hash names (copies.py)
        self.req = [{"st": R_IDLE, "n": 0, "k": 0, "pos": 0, "dec": 0, "blocks": [], "p": 0, "t": 0}
                    for _ in range(cfg.requests)]
        self.clock = 0                         # submit order (the scheduler preempts the newest)
        self.events: list[Any] = []

    # ---- helpers -----------------------------------------------------------------------------
    def chain(self, tokens: tuple[int, ...], tenant: str = TENANT) -> list[Any]:
        """The chained block hashes of `tokens` (full blocks only), with the user's hash."""
        out: list[Any] = []
        for i in range(len(tokens) // self.B):
            out.append(self.hash(out[-1] if out else None, tuple(tokens[i * self.B:(i + 1) * self.B]), (tenant,)))
        return out

    def _check_hits(self, what: str, hits: Any, n: int, tenant: str, tokens: tuple[int, ...]) -> list[int]:
        if not isinstance(hits, (list, tuple)) or len(hits) > n:
            raise TypeError(f"lookup() must return a list of at most {n} block ids, got {hits!r:.60}")
        why = self.shadow.unsafe(list(hits), tenant, tokens)
        if why:     # raised at once: what the hit reads comes before what it does to the state
            raise Finding("safety", ["hit_sound_content"], f"UNSAFE HIT (wrong content reused): {what}: {why}")
        return list(hits)

    def _prompt(self, r: int) -> tuple[str, tuple[int, ...]]:
        """(tenant, tokens) of request r's prompt."""
        return self.prompts[self.req[r]["p"]]

    def _engine_hits(self, r: int, n: int) -> list[int]:
        tenant, toks = self._prompt(r)
        toks = toks[:n * self.B]
        hits = self._check_hits(f"lookup for request {r}", self._ask(tenant, toks), n, tenant, toks)
        # a sound hit on a copy the spec no longer counts (another prompt's, at a position the
        # spec rewrote, kept by a manager without evict) ends the hit where the spec's does
        k = next((i for i, b in enumerate(hits) if b not in self.copies(i)), len(hits))
        return hits[:k]

    def _shadow_queries(self, n: int) -> None:
        """prompts = 1 only: read-only questions about what the spec's traffic does not carry, the
        same prompt from another tenant and sibling prompts. Every hit must hold its content."""
        toks = self.tokens[:n * self.B]
        other = [(OTHER_TENANT, toks)] if self.cfg.salt else []     # salt = false: no tenants to tell apart
        asks = other + [(TENANT, s) for s in
                                         siblings(self.cfg.seed, self.tokens, n, self.B, self.cfg.blocks)]
        for tenant, t in asks:
            hits = self._ask(tenant, t)
            self._check_hits(f"shadow query by {tenant} for blocks {[list(t[i:i + self.B]) for i in range(0, len(t), self.B)]}",
                             hits, len(t) // self.B, tenant, t)

    def _take(self, r: int, block: Any, j: int, hit: bool = False) -> None:
        """Request r now holds `block` at position j (a reused one must hold its prefix: the
        manager may hand out another block than the hit it was given)."""
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise TypeError(f"allocate() returned {block!r:.40}, not a block id in [0, {self.num_blocks})")
        q = self.req[r]
        if hit:
            tenant, toks = self._prompt(r)
            self._check_hits(f"allocate(hit=...) for request {r}", q["blocks"] + [block], j + 1, tenant,
                             toks[:(j + 1) * self.B])
        q["blocks"].append(block)
        q["pos"] = len(q["blocks"])

    def copies(self, j: int) -> list[int]:
        """The physical copies of logical block j: every block id holding its content (two
        requests that computed one prefix before either published it hold two; a legal
        duplicate). None while j is not cached."""
        if self.state[j] != READY:
            return []
        return [b for b, c in self.shadow.content.items() if c == self.want[j] and b not in self.stale]

    def _held(self) -> dict[int, list[tuple[int, int]]]:
        """Block id -> the (request, position) pairs of bound or running requests holding it."""
        out: dict[int, list[tuple[int, int]]] = {}
        for y, q in enumerate(self.req):
            if q["st"] in (R_BOUND, R_RUNNING):
                for i, b in enumerate(q["blocks"]):
                    out.setdefault(b, []).append((y, i))
        return out

    def _holders(self, j: int) -> int:
        """Requests holding a copy of logical block j, counted per physical block id."""
        held = self._held()
        return sum(len(held.get(b, ())) for b in self.copies(j))

    # ---- the calls into the manager (a shape overrides these: sequence.py) ---------------------
    def _ask(self, tenant: str, toks: tuple[int, ...]) -> Any:
        """The manager's answer to a read-only lookup of `toks` (whole blocks) by `tenant`."""
        return self.lookup(self.chain(toks, tenant))

    def _admit(self, r: int, hits: list[int]) -> None:
        """Request r references its decided hit (bind); ActionRejected when refused."""
        for i, b in enumerate(hits):
            got = self._alloc(r, i, b)
            if got is None:
                self._release(r, self.req[r]["blocks"])
                self.req[r]["blocks"] = []
                raise ActionRejected(f"allocate refused cached block {b}")

    def _alloc(self, r: int, j: int, hit: int | None) -> int | None:
        """Request r's block j from the manager: `hit` the cached block to reference, or None for
        a fresh one (decode_append completes a prompt's last block when the class has it). The
        block is taken (_take) before it returns; None: no room, nothing taken."""
        tenant, toks = self._prompt(r)
        toks = toks[:(j + 1) * self.B]
        h = self.chain(toks, tenant)[j]
        decode = hit is None and self.decodes and j == self.req[r]["n"] - 1 and self.B > 1
        got = self.allocate(r, None if decode else h, hit=hit)
        if got is None:
            return None
        self._take(r, got, j, hit=hit is not None)
        if decode:                                   # the prompt ends inside block j: decode the rest
            d = 1 + (self.cfg.seed + r + j) % (self.B - 1)
            for t in range(self.B - d, self.B):
                self.decode_append(r, got, toks[t], h if t == self.B - 1 else None)  # type: ignore[attr-defined]
        return got

    def _release(self, r: int, blocks: list[int]) -> None:
        self.free(r, blocks)

    # ---- the spec's actions ------------------------------------------------------------------
    def apply(self, action: str, p: dict[str, Any]) -> dict[str, Any]:
        self.events, self.after = [], []
        fn = getattr(self, f"_a_{action}", None)
        if fn is None or action not in self.actions:
            raise ActionRejected(f"{action} is not implemented")
        out = fn(**p) or {}
        if self.events:                # evictions inside allocation (spec/events.py)
            out["events_before"] = list(self.events)
        if self.after:                 # garbage copies after a release (copies.py)
            out["events"] = out.get("events", []) + self.after
        return out

    def _need(self, r: int, *states: int) -> dict[str, Any]:
        q = self.req[r]
        if q["st"] not in states:
            raise ActionRejected(f"request {r} is not in state {states}")
        return q

    def _a_submit(self, r: int, n: int, p: int = 0) -> None:
        self.clock += 1
        self._need(r, R_IDLE).update(st=R_WAITING, n=n, k=0, pos=0, dec=0, blocks=[], p=p, t=self.clock)

    def _a_lookup(self, r: int) -> dict[str, Any]:
        q = self._need(r, R_WAITING)
        k = len(self._engine_hits(r, q["n"]))
        if self.cfg.prompts == 1:
            self._shadow_queries(q["n"])
        mine = lambda j: j in self.published and self.lineage[j] == lineage(self.cfg, q["p"], j)  # noqa: E731
        logical = next((m for m in range(q["n"], 0, -1) if all(mine(j) for j in range(m))), 0)
        kind = "REUSE" if k >= logical > 0 else "PARTIAL" if k else "RECOMPUTE"
        q.update(st=R_DECIDED, k=k, dec=DECISIONS.index(kind))
        return {"decision": {"kind": kind, "k": k, "logical": logical,
                             "reasons": ["window_incomplete"] if k < logical else []}}

    def _valid(self, r: int) -> list[int] | None:
        q = self.req[r]
        hits = self._engine_hits(r, q["k"]) if q["k"] else []
        return hits if len(hits) >= q["k"] else None

    def _a_bind(self, r: int) -> None:
        q = self._need(r, R_DECIDED)
        active = sum(x["st"] in (R_BOUND, R_RUNNING) for x in self.req)
        hits = self._valid(r)
        if hits is None or active >= self.cfg.max_active:
            raise ActionRejected("the hit is gone or too many requests are active")
        self._admit(r, hits[:q["k"]])
        q.update(st=R_BOUND, pos=q["k"])

    def _a_bind_stale(self, r: int) -> None:
        self._need(r, R_DECIDED)
        if self._valid(r) is not None:
            raise ActionRejected("the hit is still valid")
        self.req[r]["st"] = R_WAITING

    def _a_use(self, r: int) -> None:
        self._need(r, R_BOUND)["st"] = R_RUNNING

    def _a_finish(self, r: int) -> None:
        q = self._need(r, R_RUNNING)
        if len(q["blocks"]) != q["n"]:
            raise ActionRejected(f"request {r} has not computed its prompt")
        blocks = list(q["blocks"])
        self._release(r, blocks)
        q.update(st=R_IDLE, blocks=[])
        self.after += released(self, r, blocks)

    def _a_preempt(self, r: int) -> None:
        q = self._need(r, R_DECIDED, R_BOUND, R_RUNNING)
        blocks = list(q["blocks"])
        if blocks:
            self._release(r, blocks)
        q.update(st=R_PREEMPTED, blocks=[])
        self.after += released(self, r, blocks)

    def _a_resume(self, r: int) -> None:
        self._need(r, R_PREEMPTED)["st"] = R_WAITING

    # ---- what kvcheck reads ------------------------------------------------------------------
    def observe(self) -> tuple[int, ...]:
        """The whole spec state (mapping.py)."""
        return observe(self)
