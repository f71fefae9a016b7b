"""The reference engine behind the SUT protocol (kvcheck/spec/sut.py): every spec action maps
onto one engine operation, and `observe()` is the abstraction function from the engine's page
tables, pools, copies and requests onto the spec's state tuple (Layout order).

Paired spec actions whose choice the spec leaves to the state (`bind`/`bind_stale`,
`use`/`use_stale`, `verify_ok`/`checksum_fail`) call the engine's one routine, which decides
from its own state (its leases, its data pointers, the real bytes of the copy): when the engine
would take the other branch the action is refused — or, with a planted fault, taken anyway and
the divergence shows in the observed state.
"""
from __future__ import annotations

import json
from typing import Any

import torch

from kvcheck.spec.config import SEMANTIC_DEFAULTS, Config, ConfigError
from kvcheck.spec.content import chain
from kvcheck.spec.objects import PARTIAL, REUSE
from kvcheck.spec.state import Layout
from kvcheck.spec.sut import ActionRejected

from kvcheck.reference import faults as _faults
from kvcheck.reference.engine import Engine
from kvcheck.reference.prompts import salt_of
from kvcheck.reference.records import Refused
from kvcheck.reference.slots import content_key
from kvcheck.reference.pools import PoolError

# The configurable semantics the reference engine implements (slots.py, decode.py); any other
# key a config switches on is refused in one line (exit 2).
IMPLEMENTS = ("prompts", "salted_prompts", "decode", "eviction", "alloc")
_BUMP = {"bump_model": "ver", "bump_compressor": "cmp", "bump_indexer": "ix", "bump_abi": "abi"}


# Where engines put their disk tier when no cache_dir is given: None = a fresh temp dir each;
# `kvcheck diff --cache-dir DIR` sets it (each engine then gets its own subdirectory of DIR).
CACHE_ROOT: str | None = None


_TIER_ACTIONS = frozenset({"offload_start", "offload_ack", "prefetch_start", "prefetch_complete",
                           "verify_ok", "checksum_fail", "corrupt"})


def declared_actions(cfg: Config, lay: Layout) -> frozenset[str] | None:
    """The spec's actions this engine can be driven with under cfg (None: all). Those the spec
    can never enable there are left out, so that a clean run covers what it declares: the
    tier actions without a host or disk tier, and `append_evict` over full-attention groups
    only (a block v > j was written while 0..v were resident, so a pool full while block j is
    missing never has an unreferenced victim)."""
    drop = set()
    if not cfg.offload_enabled:
        drop |= _TIER_ACTIONS
    if all(g.kind == "full" for g in cfg.groups):
        drop.add("append_evict")
    if not drop:
        return None
    from kvcheck.spec.actions import ACTIONS
    return frozenset(a for a, act in ACTIONS.items() if a not in drop and act.params(lay))


class ReferenceSUT:
    name = "reference"
    actions = None
    faults = {f.name: f.expected for f in _faults.ENGINE_FAULTS}

    def __init__(self, fault: str | None = None, cache_dir: str | None = None) -> None:
        if fault is not None and fault not in self.faults:
            raise ValueError(f"unknown reference-engine fault {fault!r}; known: {', '.join(sorted(self.faults))}")
        self.fault = fault
        self.cache_dir = cache_dir
        self.engine: Engine | None = None
        self.cfg: Config | None = None
        self._pending_check: tuple | None = None

    # ---- protocol ------------------------------------------------------------------------------
    def reset(self, cfg: Config) -> None:
        cfg.refuse_semantics("the reference engine", IMPLEMENTS)
        if cfg.prompts > 1 and tuple(cfg.tiers) != ("device",):
            raise ConfigError(f"config: prompts = {cfg.prompts} with tiers = {json.dumps(list(cfg.tiers))}: the "
                              "reference engine does not implement offloaded copies that carry their content "
                              "(dcid); use tiers = [\"device\"] or --sut spec")
        f = _faults.BY_NAME.get(self.fault or "")
        off = [(k, v) for k, v in (f.needs if f else ()) if k in SEMANTIC_DEFAULTS
               and getattr(cfg, k) == SEMANTIC_DEFAULTS[k]]
        if off:
            raise ConfigError(f"config: fault {f.name} plants nothing here: it lives in the semantic "
                              f"{off[0][0]} = {json.dumps(off[0][1])}, which this config leaves off")
        if self.engine is not None:
            self.engine.close()
        torch.set_num_threads(1)
        self.cfg, self.lay = cfg, Layout(cfg)
        self.actions = declared_actions(cfg, self.lay)
        cache_dir = self.cache_dir
        if cache_dir is None and CACHE_ROOT is not None:
            import tempfile
            cache_dir = tempfile.mkdtemp(prefix="engine-", dir=CACHE_ROOT)
        self.engine = Engine(cfg, self.fault, cache_dir)
        self._pending_check = None
        self._index()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        # Never close() here: it joins the disk tier's threads, which can deadlock when the
        # garbage collector runs inside threading's own lock. Owners call close().
        tiers = getattr(getattr(getattr(self, "engine", None), "mgr", None), "tiers", None)
        if tiers is not None:
            tiers.discard()

    def _entry(self, j: int):
        e = self.engine
        return e.mgr.entry(e.prefix_hashes[j], j)

    def _obj(self, p: dict[str, Any]):
        o = self._entry(p["j"]).objs.get((p["g"], p["kind"]))
        if o is None:
            raise ActionRejected(f"no {p['kind']} object for group {p['g']} block {p['j']}")
        return o

    def apply(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        assert self.engine is not None, "reset() first"
        eng, mgr, p = self.engine, self.engine.mgr, params
        self._pending_check = None
        try:
            if action == "submit":
                eng.submit(p["r"], p["n"], p=p.get("p", 0))
            elif action == "lookup":
                return {"decision": mgr.lookup(p["r"]).to_dict()}
            elif action == "bind":
                mgr.bind(p["r"])
            elif action == "bind_stale":
                mgr.bind_stale(p["r"])
            elif action == "use":
                eng.use(p["r"])
                q = mgr.requests[p["r"]]
                if q.dec in (REUSE, PARTIAL) and q.pos > 0:
                    self._pending_check = ("use", p["r"])
            elif action == "use_stale":
                eng.use(p["r"], stale=True)
            elif action == "append":
                eng.append(p["r"], p["j"])
            elif action == "decode":
                eng.decode(p["r"], p["j"])
            elif action == "append_evict":
                v = eng.append(p["r"], p["j"], evict=True)
                return {"instead": {"v": v}} if v != p["v"] else {}
            elif action == "append_fail":
                what, x = eng.append_fail(p["r"], p["j"])
                if what == "evicted":       # the engine's allocation evicted block x by itself
                    return {"events_before": [("evict", x)]}
                return {"instead": {"x": x}} if x != p["x"] else {}
            elif action == "drop_hash":
                mgr.drop_hash(p["j"])
            elif action == "slide":
                mgr.slide(p["r"])
            elif action == "finish":
                eng.finish(p["r"])
                self._pending_check = ("finish", p["r"])
            elif action == "preempt":
                mgr.preempt(p["r"])
                eng.runs.pop(p["r"], None)
            elif action == "resume":
                mgr.resume(p["r"])
            elif action in ("compress", "indexer_sync"):
                mgr.compress(self._obj(p))
            elif action == "evict":
                mgr.evict(self._obj(p))
            elif action == "migrate":
                mgr.migrate(self._obj(p))
            elif action == "offload_start":
                mgr.offload_start(self._entry(p["j"]))
            elif action == "offload_ack":
                mgr.offload_ack(self._entry(p["j"]))
            elif action == "prefetch_start":
                mgr.prefetch_start(self._entry(p["j"]))
            elif action == "prefetch_complete":
                mgr.prefetch_complete(self._entry(p["j"]))
            elif action == "verify_ok":
                mgr.verify(self._entry(p["j"]), p["aligned"], want_ok=True)
            elif action == "checksum_fail":
                mgr.verify(self._entry(p["j"]), 1, want_ok=False)
            elif action == "corrupt":
                mgr.corrupt(self._entry(p["j"]))
            elif action in _BUMP:
                mgr.bump(_BUMP[action])
                eng.drop_preempted()
            elif action == "capture":
                mgr.capture(p["r"])
            elif action == "release_graph":
                mgr.release_graph()
            else:
                raise ActionRejected(f"unknown action {action!r}")
        except Refused as e:
            raise ActionRejected(f"{action}: {e}") from None
        except (KeyError, IndexError) as e:
            raise ActionRejected(f"{action} {params}: {e}") from None
        except PoolError as e:                 # out of physical slots (only past the caps)
            raise ActionRejected(f"{action}: {e}") from None
        return {}

    # ---- the abstraction function ----------------------------------------------------------------
    def _index(self) -> None:
        lay = self.lay
        self._obj_slots = [(o, [lay.o(o.group, o.kind, o.block, f) for f in
                                ("st", "ver", "abi", "aln", "pool", "ref", "gmv")]) for o in lay.objects]
        self._blk_slots = [[lay.b(j, f) for f in ("hashed", "dst", "dver", "dix", "dcmp", "dabi", "dbad")]
                           for j in range(self.cfg.blocks)]
        self._req_slots = [[lay.r(r, f) for f in ("rst", "rlen", "rk", "rpos", "rwin", "rdec", "rver",
                                                  "rix", "rabi", "rcmp")] for r in range(self.cfg.requests)]
        self._glob = [lay.g(f) for f in ("cur_ver", "cur_ix", "cur_cmp", "cur_abi", "inflight", "graph",
                                         "gwin", "gpos")]
        cfg, eng = self.cfg, self.engine
        # the engine keeps each group's window start; the spec one step of the config's table
        self._step = {t: i for i, t in enumerate(cfg.window_steps())}
        # the configurable semantics' slots: a block's content and hash as prompt lineages (the
        # token prefix it was computed from, named by content.chain), decode's partial blocks
        self._lineage = {content_key(salt_of(cfg, eng.salt, p), t[:(j + 1) * cfg.block_size]): chain(cfg, p, j)
                         for p, t in enumerate(eng.prompts) for j in range(cfg.blocks)}
        self._content = [(lay.b(j, "bcid"), lay.b(j, "bkey")) for j in range(cfg.blocks)] \
            if cfg.prompts > 1 else []
        self._bpart = [lay.b(j, "bpart") for j in range(cfg.blocks)] if cfg.decode else []
        self._rp = [lay.r(r, "rp") for r in range(cfg.requests)] if cfg.prompts > 1 else []
        self._rtok = [lay.r(r, "rtok") for r in range(cfg.requests)] if cfg.decode else []

    def observe(self) -> tuple[int, ...]:
        eng = self.engine
        assert eng is not None
        mgr = eng.mgr
        s = self.lay.init()
        s = list(s)
        slots = mgr.slots
        for o, idx in self._obj_slots:
            if slots is not None:
                rec = slots.objs[o.block].get((o.group, o.kind))
            else:
                e = mgr.entries.get(eng.prefix_hashes[o.block])
                rec = e.objs.get((o.group, o.kind)) if e is not None else None
            if rec is None:
                continue
            vals = (rec.state, rec.ver, rec.abi, rec.aln, rec.pool_id, rec.ref, rec.moved)
            for i, v in zip(idx, vals):
                s[i] = v
        for j, idx in enumerate(self._blk_slots):
            if slots is not None:
                published, c = mgr.slot_published(j), slots.copy[j]
            else:
                e = mgr.entries.get(eng.prefix_hashes[j])
                if e is None:
                    continue
                published, c = e.published, e.copy
            vals = (int(published), c.dst, c.hdr["ver"], c.hdr["ix"], c.hdr["cmp"], c.hdr["abi"], c.damaged)
            for i, v in zip(idx, vals):
                s[i] = v
        for j, (ic, ik) in enumerate(self._content):
            s[ic] = self._lineage.get(slots.content[j], -1)
            s[ik] = self._lineage.get(slots.keyed_by[j], -1)
        for j, i in enumerate(self._bpart):
            s[i] = mgr.bpart[j]
        for r, idx in enumerate(self._req_slots):
            q = mgr.requests.get(r)
            if q is None:
                continue
            vals = (q.st, q.n, q.k, q.pos, self._step.get(q.win, -1), q.dec, q.lease["ver"], q.lease["ix"], q.lease["abi"],
                    q.lease["cmp"])
            for i, v in zip(idx, vals):
                s[i] = v
            if self._rp:
                s[self._rp[r]] = q.p
            if self._rtok:
                s[self._rtok[r]] = q.tok
        g = mgr.graph
        vals = (mgr.cur["ver"], mgr.cur["ix"], mgr.cur["cmp"], mgr.cur["abi"], mgr.inflight,
                int(g is not None), self._step.get(g["win"], -1) if g else 0, g["pos"] if g else 0)
        for i, v in zip(self._glob, vals):
            s[i] = v
        return tuple(s)

    # ---- tenant isolation --------------------------------------------------------------------------
    def isolation_check(self, r: int) -> str | None:
        """After request r's lookup: what would a request of another tenant (another cache salt)
        with the same tokens hit? The spec's answer is nothing (prefix caches are per tenant)."""
        eng = self.engine
        req = eng.mgr.requests.get(r) if eng is not None else None
        if req is None:
            return None
        d = eng.mgr.probe_decision(req.tokens, req.n, eng.extra("tenant-b"))
        if d.logical != 0:
            return (f"a request with another cache salt hits {d.logical} blocks of request {r}'s "
                    "prefix (the spec: none)")
        return None

    # ---- the differential oracle ------------------------------------------------------------------
    def differential_check(self, action: str, params: dict[str, Any]) -> str | None:
        """Reuse vs full recompute, bitwise (torch.equal), after a request finishes and at the
        use of a REUSE/PARTIAL hit (the next chunk's logits from the reconstructed state)."""
        pend, self._pending_check = self._pending_check, None
        if pend is None or self.engine is None:
            return None
        eng = self.engine
        kind, r = pend
        req = eng.mgr.requests[r]
        if kind == "use":
            run = eng.runs.get(r)
            if run is None:
                return None
            pos, logits = eng.probe(r)
            ref = eng.recompute(req.tokens)[pos:pos + logits.shape[0]]
            what = f"request {r} reusing {req.pos} blocks: logits of positions {pos}..{pos + logits.shape[0] - 1}"
        else:
            if eng.last_finished is None or eng.last_finished[0] != r:
                return None
            _, run, toks, _ = eng.last_finished
            logits = run.result
            ref = eng.recompute(toks)[run.start:]
            pos = run.start
            what = f"request {r} (reused {run.start // eng.B} blocks): logits of positions {pos}..{len(toks) - 1}"
        if logits.shape == ref.shape and torch.equal(logits, ref):
            return None
        if logits.shape != ref.shape:
            return f"{what}: shape {tuple(logits.shape)} vs recompute {tuple(ref.shape)}"
        bad = (logits != ref).any(dim=-1).nonzero().flatten().tolist()
        return (f"{what} differ from a full recompute (first differing position {pos + bad[0]}, "
                f"max |diff| {float((logits - ref).abs().max()):.3g})")
