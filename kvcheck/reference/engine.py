"""The reference serving engine: the cache manager plus model execution.

Owns requests' token sequences (a shared prefix of `blocks*block_size` bytes drawn from a seed,
then a private suffix per request), prefill/decode with reuse per the decision (the ModelState
at k*B is reconstructed from pool pages through the kernel read path, then the request
continues), preemption, a full-recompute run of the same tokens, and the reuse metrics.

Versions: the model version selects the weights (seed + version); the compressor and indexer
versions select the *storage format* of compressed entries and indexer keys, and the ABI
version the pools' page layout (see pools.encode_shift). A page written under one version and
read under another decodes to garbage, so reusing a stale object shows in the logits.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from kvcheck.spec.config import Config
from kvcheck.spec.objects import D_DURABLE, PARTIAL, R_DECIDED, R_RUNNING, REUSE, block_objects

from . import faults as EF
from .decode import Decoder
from .hashing import ExtraKeys
from .kinds import manager_for
from .manager import CacheManager
from .records import CopyRec, Refused, Request
from .slots import Evictable
from .model import HybridLM, ModelState
from .prompts import prefix_tokens, prompt_table, salt_of, suffix_tokens
from .run import Run

# Kernel backend of every model the engine builds ("torch" | "triton"); see kernels/backend.py.
BACKEND = "torch"


def use_backend(name: str) -> None:
    global BACKEND
    from ..kernels.backend import BACKENDS
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    BACKEND = name


_MODELS: dict[tuple, HybridLM] = {}          # weights per (config, seed): built once per process
_FULL: dict[tuple, torch.Tensor] = {}        # full-recompute logits, memoised


class Engine:
    """The reference serving engine: a CacheManager (`mgr`) plus model execution; decode
    (decode.py) is a collaborator that runs through the engine's `DecodeHost` interface."""

    def __init__(self, cfg: Config, fault: str | None = None, cache_dir: str | None = None,
                 prefix_seed: int | None = None, reuse_disk: bool = False,
                 tier_max_bytes: int | None = None) -> None:
        self.cfg, self.fault = cfg, fault
        self.B = cfg.block_size
        self._cfg_key = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
        self.mgr = None  # type: ignore[assignment]
        m0 = self.model(0)
        self.H, self.D, self.Di = m0.n_heads, m0.head_dim, m0.idx_dim
        self.HD = self.H * self.D
        self.model_id = hashlib.sha256(json.dumps(
            {"config": {k: v for k, v in cfg.to_dict().items() if k != "seed"},
             "dims": [m0.width, m0.n_heads, m0.mlp, m0.idx_heads, m0.idx_dim]},
            sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.mgr = CacheManager(cfg, self.model_id, self._page_numel(), fault, cache_dir)
        self._layout_fp: dict[int, str] = {}
        self._bind_tiers(reuse_disk, tier_max_bytes)
        self.prefix = prefix_tokens(cfg, prefix_seed)
        self.prompts = prompt_table(cfg, self.prefix)     # prompts > 1: the edits of the prefix
        self.salt = "tenant-a"
        self.prefix_hashes = self.mgr.hashes(self.prefix, cfg.blocks, self.extra(self.salt))
        self.mgr.set_base(self.prefix, self.prefix_hashes, self.salt)
        self.runs: dict[int, Run] = {}
        self.serial = 0
        self.reused: dict[str, int] = {}             # objects read back from pages, per kind
        self.last_finished: tuple[int, Run, list[int], int] | None = None
        self.decoder = Decoder(self)

    # ---- the disk tier's binding and restarts (see tiers.py, recovery.py) --------------------
    def tier_identity(self) -> dict[str, Any]:
        """What every copy is bound to besides its key: the model architecture, the exact
        weights now in use (their fingerprint covers the seed and the version), the kernels'
        reduction order, the ABI and the pools' layout."""
        m, abi = self.model(), self.mgr.cur["abi"]
        if abi not in self._layout_fp:
            self._layout_fp[abi] = hashlib.sha256(json.dumps(
                self.mgr.pools.layouts(), sort_keys=True).encode()).hexdigest()[:16]
        return {"model_id": self.model_id, "weights": m.fingerprint[:32],
                "kernels": m.versions["kernels"], "abi": abi, "layout": self._layout_fp[abi]}

    def _bind_tiers(self, reuse_disk: bool, max_bytes: int | None) -> None:
        t = self.mgr.tiers
        if t is None:
            return
        unchecked = {"key"} if self.mgr.planted(EF.DISK_COPY_KEY_UNCHECKED) else \
            {"all"} if self.mgr.planted(EF.LOAD_BEFORE_CHECKSUM) else set()
        t.bind_identity(self.tier_identity, frozenset(unchecked))
        if max_bytes is not None:
            t.max_bytes = max_bytes
        if reuse_disk:
            self.adopt_recovered()

    def adopt_recovered(self) -> int:
        """A restarted engine takes the durable copies of its own identity found on disk as
        published blocks with a durable copy (objects not resident: a lookup answers PREFETCH).
        Off by default: the spec's lockstep starts from an empty cache."""
        n = 0
        for key, h in self.mgr.tiers.durable_copies().items():
            j = h.get("block")
            if not (isinstance(j, int) and 0 <= j < self.cfg.blocks) or key in self.mgr.entries:
                continue
            want = [[g, kind] for g, kind in sorted(self.mgr.block_kinds(j))]
            if sorted(h.get("bind", {}).get("objects", [])) != want:
                continue
            e = self.mgr.entry(key, j)
            e.copy = CopyRec(D_DURABLE, {f: h.get(f, 0) for f in ("ver", "ix", "cmp", "abi")}, 0)
            e.published = True
            self.mgr.tiers.expect(key, h)
            n += 1
        return n

    # ---- models and versions --------------------------------------------------------------
    def model(self, ver: int | None = None) -> HybridLM:
        ver = (self.mgr.cur["ver"] if self.mgr is not None else 0) if ver is None else ver
        key = (self._cfg_key, self.cfg.seed + 1000 * ver, BACKEND)
        if key not in _MODELS:
            _MODELS[key] = HybridLM(self.cfg, seed=self.cfg.seed + 1000 * ver, backend=BACKEND)
        return _MODELS[key]

    def recompute(self, tokens: list[int]) -> torch.Tensor:
        """Full recompute (no cache) of the same tokens under the current weights."""
        key = (self._cfg_key, self.mgr.cur["ver"], BACKEND, tuple(tokens))
        if key not in _FULL:
            if len(_FULL) > 512:
                _FULL.clear()
            _FULL[key] = self.model().prefill(tokens)[0]
        return _FULL[key]

    # ---- object <-> page layout -------------------------------------------------------------
    def fields(self, g: int, kind: str, j: int) -> list[tuple[int, str, tuple[int, ...]]]:
        """(layer, field, shape) of the tensors object (g, kind, j) stores, in page order."""
        grp = self.cfg.groups[g]
        dims = {"B": self.B, "H": self.H, "D": self.D, "HD": self.HD, "Di": self.Di}
        km = manager_for(kind)
        return [f for i in grp.layers for f in km.fields(grp, i, j, dims)]

    def _page_numel(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for j in range(self.cfg.blocks):
            for gk in self.mgr_block_kinds(j):
                n = sum(_numel(s) for _, _, s in self.fields(gk[0], gk[1], j))
                out[gk[1]] = max(out.get(gk[1], 1), n)
        return out

    def mgr_block_kinds(self, j: int) -> list[tuple[int, str]]:
        return block_objects(self.cfg, j)

    def block_data(self, st: ModelState, j: int) -> dict[tuple[int, str], torch.Tensor]:
        """The objects of block j cut from a state at L = (j+1)*B, flattened per page."""
        out = {}
        for g, kind in self.mgr_block_kinds(j):
            grp = self.cfg.groups[g]
            parts = []
            for i, f, shape in self.fields(g, kind, j):
                t = getattr(st.layers[i], f)
                if f in ("win_k", "win_v"):
                    t = t[t.shape[0] - shape[0]:]
                elif f in ("comp", "idx_keys"):
                    t = t[j * self.B // grp.m:(j + 1) * self.B // grp.m]
                assert tuple(t.shape) == shape, (g, kind, j, f, t.shape, shape)
                parts.append(t.reshape(-1))
            out[(g, kind)] = torch.cat(parts) if parts else torch.zeros(0)
        return out

    def _read_obj(self, req: Request, g: int, kind: str, j: int) -> dict[tuple[int, str], torch.Tensor]:
        """Kernel read of one object's page (null page -> zeros) split into its tensors."""
        specs = self.fields(g, kind, j)
        n = sum(_numel(s) for _, _, s in specs)
        o = self.mgr.obj(req, g, kind, j)
        if o is None or o.page is None:
            flat = torch.zeros(n)                               # the null page
        else:
            flat = o.page.pool.read(o.page, self.mgr.shift(kind))
            if flat.numel() < n:
                flat = torch.cat([flat, torch.zeros(n - flat.numel())])
        out, off = {}, 0
        for i, f, shape in specs:
            out[(i, f)] = flat[off:off + _numel(shape)].reshape(shape)
            off += _numel(shape)
        return out

    def reconstruct(self, req: Request, k: int) -> ModelState:
        """The ModelState at L = k*B assembled from pool pages (the recovery set at k)."""
        m = self.model()
        st = m.new_state()
        if k == 0:
            return st
        L = k * self.B
        got: dict[tuple[int, str], list[torch.Tensor]] = {}
        for g in self.cfg.groups:
            for kind, j in self.mgr.recovery_set(g, k):
                self.reused[kind] = self.reused.get(kind, 0) + 1
                for key, t in self._read_obj(req, g.index, kind, j).items():
                    got.setdefault(key, []).append(t)
        for i, spec in enumerate(self.cfg.layers):
            ls = st.layers[i]
            W = None if spec.kind == "full" else spec.window
            nw = L if W is None else L - max(0, L - W + 1)
            for f in ("win_k", "win_v"):
                rows = torch.cat(got.get((i, f), [torch.zeros(0, self.H, self.D)]))
                if rows.shape[0] < nw:
                    rows = torch.cat([torch.zeros(nw - rows.shape[0], self.H, self.D), rows])
                setattr(ls, f, rows[rows.shape[0] - nw:])
            if spec.kind in ("hca", "csa"):
                e, t = L // spec.m, L - spec.m * (L // spec.m)
                ls.comp = _rows(got.get((i, "comp")), e, 2 * self.HD)
                ls.tail_kv = _rows(got.get((i, "tail_kv")), t, 2 * self.HD)
                ls.tail_gate = _rows(got.get((i, "tail_gate")), t, 2 * self.HD)
                if spec.kind == "csa":
                    ls.idx_keys = _rows(got.get((i, "idx_keys")), e, self.Di)
                    ls.idx_tail_kv = _rows(got.get((i, "idx_tail_kv")), t, self.Di)
                    ls.idx_tail_gate = _rows(got.get((i, "idx_tail_gate")), t, self.Di)
        st.position = L
        return st

    # ---- request lifecycle (each maps onto one manager operation + model work) ---------------
    def extra(self, salt: str) -> ExtraKeys:
        return ExtraKeys(self.model_id, salt, "")

    def submit(self, rid: int, n: int, salt: str | None = None, suffix: list[int] | None = None,
               prefix: list[int] | None = None, p: int = 0) -> Request:
        """Request rid over n blocks of a prompt (`prefix`, else prompt p of the table), then
        its private suffix."""
        self.serial += 1
        if not 0 <= p < len(self.prompts):
            raise Refused(f"prompt {p} is not one of the {len(self.prompts)} prompts")
        pre = self.prompts[p] if prefix is None else prefix
        toks = pre[:n * self.B] + (suffix if suffix is not None else suffix_tokens(rid, 0))
        req = self.mgr.submit(rid, toks, n, self.extra(salt_of(self.cfg, self.salt, p) if salt is None else salt), p)
        self.runs.pop(rid, None)
        return req

    def use(self, rid: int, stale: bool = False) -> Run | None:
        """The scheduler runs a bound request: the manager re-validates the lease (`stale`: the
        spec's use_stale branch) and the state at k*B is rebuilt from the pool pages."""
        if stale:
            if self.mgr.use_stale(rid):
                self.runs.pop(rid, None)
                return None
        else:
            self.mgr.use(rid)
        req = self.mgr.requests[rid]
        run = Run(req.pos * self.B, self.reconstruct(req, req.pos))
        self.runs[rid] = run
        return run

    def probe(self, rid: int) -> tuple[int, torch.Tensor]:
        """Logits of the next chunk from the reconstructed state (kept for the next append)."""
        req, run = self.mgr.requests[rid], self.runs[rid]
        pos = run.state.position
        toks = req.tokens[pos:pos + self.B] if req.pos < req.n else req.tokens[pos:]
        logits, st = self.model().prefill(toks, run.state)
        run.probe = (pos, toks, logits, st)
        return pos, logits

    def _advance(self, run: Run, toks: list[int]) -> tuple[torch.Tensor, ModelState]:
        pos = run.state.position
        if run.probe is not None and run.probe[0] == pos and run.probe[1] == toks:
            _, _, logits, st = run.probe
        else:
            logits, st = self.model().prefill(toks, run.state)
        run.probe = None
        return logits, st

    def append(self, rid: int, j: int, evict: bool = False) -> int | None:
        """Compute and write block j; `evict` (alloc = evict): the allocation evicts a block to
        make room (returns the victim)."""
        req = self.mgr.requests.get(rid)
        run = self.runs.get(rid)
        if req is None or run is None or req.st != R_RUNNING or req.pos != j or j >= req.n:
            raise Refused(f"request {rid} cannot write block {j} now")
        toks = req.tokens[j * self.B:(j + 1) * self.B]
        logits, st = self._advance(run, toks)
        data = self.block_data(st, j)
        v = self.mgr.append_evict(rid, j, data) if evict else self.mgr.append(rid, j, data)
        run.logits.append(logits)
        run.state = st
        return v

    def append_fail(self, rid: int, j: int) -> tuple[str, int]:
        """The allocation of block j with full pools: ("preempted", x) when nothing can be
        evicted (the scheduler preempted x), or ("evicted", v) when the engine's allocation
        found a victim after all and wrote j (what the engine does, reported as its own event)."""
        try:
            x = self.mgr.append_fail(rid, j)
        except Evictable:
            return "evicted", self.append(rid, j, evict=True)
        self.runs.pop(x, None)
        return "preempted", x

    def decode(self, rid: int, j: int) -> None:
        """One decoded token into block j (decode.py)."""
        self.decoder.decode(rid, j)

    def finish(self, rid: int) -> Run:
        req = self.mgr.requests.get(rid)
        run = self.runs.get(rid)
        if req is None or run is None or req.st != R_RUNNING or req.pos != req.n:
            raise Refused(f"request {rid} cannot finish now")
        toks = req.tokens[req.n * self.B + req.tok:]     # decoded tokens are already computed
        logits, st = self._advance(run, toks)
        self.mgr.finish(rid)
        run.logits.append(logits)
        run.state = st
        run.result = torch.cat(run.logits) if run.logits else torch.zeros(0, 256)
        self.last_finished = (rid, run, list(req.tokens), self.mgr.cur["ver"])
        return run

    def drop_preempted(self) -> None:
        for rid, q in self.mgr.requests.items():
            if q.st != R_RUNNING:
                self.runs.pop(rid, None)

    # ---- whole-request convenience (benchmarks, examples) --------------------------------------
    def serve(self, rid: int, n: int, salt: str | None = None, suffix: list[int] | None = None
              ) -> dict[str, Any]:
        """Submit, look up, bind, use, compute the rest, finish. Returns logits and the trace."""
        self.submit(rid, n, salt, suffix)
        trace = []
        d = self.mgr.lookup(rid)
        trace.append(("lookup", d.to_dict()))
        if d.kind not in (REUSE, PARTIAL):
            req = self.mgr.requests[rid]
            req.st, req.k = R_DECIDED, 0  # decided at 0: recompute everything
        self.mgr.bind(rid)
        self.use(rid)
        req = self.mgr.requests[rid]
        for j in range(req.pos, n):
            self.append(rid, j)
            trace.append(("append", j))
            self.complete_writes(req, j)
        run = self.finish(rid)
        return {"logits": run.result, "start": run.start, "decision": d.to_dict(), "trace": trace}

    def complete_writes(self, req: Request, j: int) -> None:
        """Let the compressor and the indexer catch up with block j (writing -> ready)."""
        for o in self.mgr.entry(req.hashes[j], j).objs.values():
            if o.state == 1:                     # WRITING
                self.mgr.compress(o)

    def metrics(self) -> dict[str, Any]:
        s = self.mgr.stats
        lb = max(1, s["logical_blocks"])
        return {"lookups": s["lookups"], "logical_blocks": s["logical_blocks"],
                "usable_blocks": s["usable_blocks"],
                "usable_over_logical": round(s["usable_blocks"] / lb, 4),
                "decisions": dict(s["decisions"]), "degradations": dict(s["degradations"]),
                "transitions": dict(s["transitions"])}

    def close(self) -> None:
        self.mgr.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _rows(parts: list[torch.Tensor] | None, n: int, width: int) -> torch.Tensor:
    t = torch.cat(parts) if parts else torch.zeros(0, width)
    if t.shape[0] < n:
        t = torch.cat([t, torch.zeros(n - t.shape[0], width)])
    return t[:n]
