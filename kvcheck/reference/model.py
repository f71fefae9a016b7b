"""The reference model: a tiny DeepSeek-V4-like hybrid LM (bytes as tokens) whose every op is
batch-invariant, with an explicit per-layer cache state made of the brief's objects.

Owns: weights from a seed, the fingerprint/versions, `prefill`/`decode` over a `ModelState`, and
the get/put/snapshot surface a cache manager uses to page objects out and back. One-shot prefill,
any chunked prefill, token-by-token decode and restore-then-continue give bitwise-equal logits.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

import torch

from kvcheck.kernels.backend import get_ops
from kvcheck.spec.config import GROUP_OBJECTS, Config, LayerSpec

VOCAB = 256


class StateError(ValueError):
    """A cache object has the wrong shape for the state's position (missing/extra tokens)."""


# Which tensors make up each object kind in a LayerState.
OBJECT_FIELDS: dict[str, tuple[str, ...]] = {
    "swa_window": ("win_k", "win_v"),
    "compressed_kv": ("comp",),
    "tail": ("tail_kv", "tail_gate"),
    "indexer": ("idx_keys", "idx_tail_kv", "idx_tail_gate"),
}
KIND_OBJECTS: dict[str, tuple[str, ...]] = GROUP_OBJECTS   # the spec's one definition


@dataclass
class LayerState:
    """One layer's cache at position L (all plain float32 tensors, rows in position order):
    win_k/win_v [n, H, D]: raw roped K and V of positions [max(0, L-W+1), L) ([0, L) for full);
    comp [L//m, 2*H*D]: compressed entries (K | V); tail_kv/tail_gate [L - m*(L//m), 2*H*D]: the
    compressor's projected kv and gate of the incomplete block; idx_keys [L//m, Di] and
    idx_tail_kv/idx_tail_gate [.., Di]: the indexer's own compressed keys and tail."""

    kind: str
    win_k: torch.Tensor
    win_v: torch.Tensor
    comp: torch.Tensor | None = None
    tail_kv: torch.Tensor | None = None
    tail_gate: torch.Tensor | None = None
    idx_keys: torch.Tensor | None = None
    idx_tail_kv: torch.Tensor | None = None
    idx_tail_gate: torch.Tensor | None = None

    @property
    def objects(self) -> tuple[str, ...]:
        return KIND_OBJECTS[self.kind]

    def get(self, obj: str) -> dict[str, torch.Tensor]:
        """The tensors of one object kind (references, not copies)."""
        if obj not in self.objects:
            raise KeyError(f"{self.kind} layer has no {obj!r} object")
        return {f: getattr(self, f) for f in OBJECT_FIELDS[obj]}

    def put(self, obj: str, tensors: dict[str, torch.Tensor]) -> None:
        """Replace one object kind's tensors (shapes are checked at the next forward)."""
        if obj not in self.objects:
            raise KeyError(f"{self.kind} layer has no {obj!r} object")
        if set(tensors) != set(OBJECT_FIELDS[obj]):
            raise KeyError(f"{obj} needs exactly {OBJECT_FIELDS[obj]}, got {tuple(tensors)}")
        for f, t in tensors.items():
            setattr(self, f, t)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f: t for o in self.objects for f, t in self.get(o).items()}

    def clone(self) -> "LayerState":
        kw = {f: (None if getattr(self, f) is None else getattr(self, f).clone())
              for fs in OBJECT_FIELDS.values() for f in fs}
        return LayerState(self.kind, **kw)


@dataclass
class ModelState:
    """The whole cache of one sequence after `position` tokens."""

    position: int
    layers: list[LayerState] = field(default_factory=list)

    def snapshot(self) -> "ModelState":
        """Deep copy; the model never mutates a state in place, so snapshots stay valid."""
        return ModelState(self.position, [l.clone() for l in self.layers])

    def get(self, layer: int, obj: str) -> dict[str, torch.Tensor]:
        return self.layers[layer].get(obj)

    def put(self, layer: int, obj: str, tensors: dict[str, torch.Tensor]) -> None:
        self.layers[layer].put(obj, tensors)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat {"<layer>.<field>": tensor} of every cached tensor (for equality checks)."""
        return {f"{i}.{f}": t for i, l in enumerate(self.layers) for f, t in l.tensors().items()}


def _need(name: str, t: torch.Tensor | None, rows: int) -> torch.Tensor:
    if t is None or t.shape[0] != rows:
        got = None if t is None else t.shape[0]
        raise StateError(f"{name}: expected {rows} rows for this position, got {got}")
    return t


class HybridLM:
    """Tiny hybrid LM. width 64, 4 heads of 16, MLP 128, indexer 4 heads of 16, vocab 256."""

    def __init__(self, config: Config | None = None, *, seed: int | None = None, width: int = 64,
                 n_heads: int = 4, mlp: int = 128, idx_heads: int = 4, idx_dim: int = 16,
                 inference_mode: bool = True, backend: str = "torch"):
        # inference_mode: run forwards under torch.inference_mode (~17% faster decode: no
        # autograd dispatch). Returned logits and new state tensors are then inference tensors:
        # read, copy, compare and clone them freely; clone before editing one in place.
        self.inference_mode = inference_mode
        # backend: "torch" (reference) or "triton" (kvcheck/kernels/triton_ops.py); every op call
        # goes through this table. versions["kernels"] names it: caches are per backend.
        self.backend = backend
        self.ops = get_ops(backend)
        self.config = config or Config()
        self.seed = self.config.seed if seed is None else seed
        self.width, self.n_heads, self.head_dim = width, n_heads, width // n_heads
        self.idx_heads, self.idx_dim, self.mlp = idx_heads, idx_dim, mlp
        self.scale = 1.0 / math.sqrt(self.head_dim)
        g = torch.Generator().manual_seed(self.seed)

        def W(*shape: int, fan_in: int | None = None) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(fan_in or shape[0])

        C, HD = width, n_heads * self.head_dim
        self.weights: dict[str, torch.Tensor] = {"embed": torch.randn(VOCAB, C, generator=g)}
        for i, spec in enumerate(self.config.layers):
            p = f"l{i}."
            self.weights |= {p + "norm1": torch.ones(C), p + "norm2": torch.ones(C),
                             p + "wqkv": W(C, 3 * HD), p + "wo": W(HD, C),
                             p + "w1": W(C, mlp), p + "w2": W(mlp, C)}
            if spec.kind in ("hca", "csa"):
                self.weights |= {p + "wc": W(C, 4 * HD),      # compressor kv | gate
                                 p + "cbias": 0.5 * torch.randn(spec.m, 2 * HD, generator=g)}
            if spec.kind == "csa":
                self.weights |= {p + "wi": W(C, idx_heads * idx_dim + idx_heads + 2 * idx_dim),
                                 p + "ibias": 0.5 * torch.randn(spec.m, idx_dim, generator=g)}
        self.weights |= {"norm_f": torch.ones(C), "head": W(C, VOCAB)}
        # one GEMM per layer input: q|k|v (| compressor kv|gate) (| indexer q|w|kv|gate)
        self._w_in = [torch.cat([self.weights[f"l{i}.{n}"] for n in ("wqkv", "wc", "wi")
                                 if f"l{i}.{n}" in self.weights], dim=1).contiguous()
                      for i in range(len(self.config.layers))]
        self.fingerprint = self._digest(lambda n: True, with_config=True)
        self.versions = {
            "model": self.fingerprint[:16],
            "compressor": self._digest(lambda n: n.endswith((".wc", ".cbias")))[:16],
            "indexer": self._digest(lambda n: n.endswith((".wi", ".ibias")))[:16],
            # the reduction order of the batch-invariant kernels: caches computed under another
            # tiling are numerically different (still correct, but not bitwise reusable)
            "kernels": self.ops.version,
        }

    def _digest(self, pick, with_config: bool = False) -> str:
        h = hashlib.sha256()
        if with_config:
            h.update(json.dumps(self.config.to_dict(), sort_keys=True).encode())
            h.update(json.dumps([self.width, self.n_heads, self.mlp, self.idx_heads,
                                 self.idx_dim]).encode())
        for name in sorted(self.weights):
            if pick(name):
                h.update(name.encode())
                h.update(self.weights[name].numpy().tobytes())
        return h.hexdigest()

    # ---- state ------------------------------------------------------------------------
    def new_state(self) -> ModelState:
        H, D, HD, Di = self.n_heads, self.head_dim, self.n_heads * self.head_dim, self.idx_dim
        layers = []
        for spec in self.config.layers:
            ls = LayerState(spec.kind, torch.zeros(0, H, D), torch.zeros(0, H, D))
            if spec.kind in ("hca", "csa"):
                ls.comp, ls.tail_kv, ls.tail_gate = (torch.zeros(0, 2 * HD) for _ in range(3))
            if spec.kind == "csa":
                ls.idx_keys, ls.idx_tail_kv, ls.idx_tail_gate = (torch.zeros(0, Di) for _ in range(3))
            layers.append(ls)
        return ModelState(0, layers)

    def restore(self, snapshot: ModelState) -> ModelState:
        return snapshot.snapshot()

    def object_rows(self, layer: int, L: int) -> dict[str, tuple[int, int, str]]:
        """What row r of each cached tensor of `layer` holds at position L: {field: (lo, hi,
        unit)}, row r = unit index lo + r; unit "pos" = token position, "entry" = compressed
        entry id (block w covers positions [w*m, (w+1)*m)). For paging objects out and back."""
        spec = self.config.layers[layer]
        lo = 0 if spec.kind == "full" else max(0, L - spec.window + 1)
        rows = {"win_k": (lo, L, "pos"), "win_v": (lo, L, "pos")}
        if spec.kind in ("hca", "csa"):
            e, t0 = L // spec.m, spec.m * (L // spec.m)
            rows |= {"comp": (0, e, "entry"), "tail_kv": (t0, L, "pos"),
                     "tail_gate": (t0, L, "pos")}
            if spec.kind == "csa":
                rows |= {"idx_keys": (0, e, "entry"), "idx_tail_kv": (t0, L, "pos"),
                         "idx_tail_gate": (t0, L, "pos")}
        return rows

    # ---- forward ----------------------------------------------------------------------
    def prefill(self, tokens, state: ModelState | None = None,
                trace: dict | None = None) -> tuple[torch.Tensor, ModelState]:
        """Run tokens (list/1-D tensor of ints in 0..255) after `state` (None = empty).
        Returns (logits [T, 256] for the new tokens, new state); `state` is left untouched.
        `trace`, if given, receives {"select.<layer>": [T, topk] csa selections (sorted
        ascending; -1 = empty slot, sorts first)}."""
        if self.inference_mode and not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.prefill(tokens, state, trace)
        state = self.new_state() if state is None else state
        tok = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        L0, T = state.position, tok.shape[0]
        if T == 0:
            return torch.zeros(0, VOCAB), state.snapshot()
        pos = torch.arange(L0, L0 + T)
        x = self.weights["embed"][tok]
        layers = []
        for i, spec in enumerate(self.config.layers):
            x, ls = self._layer(i, spec, x, pos, state.layers[i], L0, trace)
            layers.append(ls)
        x = self.ops.rms_norm(x, self.weights["norm_f"])
        return self.ops.linear(x, self.weights["head"]), ModelState(L0 + T, layers)

    def decode(self, token: int, state: ModelState) -> tuple[torch.Tensor, ModelState]:
        logits, st = self.prefill([int(token)], state)
        return logits[0], st

    def _layer(self, i: int, spec: LayerSpec, x: torch.Tensor, pos: torch.Tensor,
               st: LayerState, L0: int, trace: dict | None):
        w = self.weights
        o = self.ops
        p = f"l{i}."
        T = x.shape[0]
        L1 = L0 + T
        H, D, HD = self.n_heads, self.head_dim, self.n_heads * self.head_dim
        xn = o.rms_norm(x, w[p + "norm1"])
        proj = o.linear(xn, self._w_in[i])
        qk = o.rope(proj[:, :2 * HD].reshape(T, 2 * H, D), pos)
        q, k = qk[:, :H] * self.scale, qk[:, H:]
        v = proj[:, 2 * HD:3 * HD].reshape(T, H, D)
        out = LayerState(spec.kind, st.win_k, st.win_v)

        # raw KV: full keeps [0, L), others the window [max(0, L-W+1), L)
        W = None if spec.kind == "full" else spec.window
        lo0 = 0 if W is None else max(0, L0 - W + 1)
        ks = torch.cat([_need(f"{p}win_k", st.win_k, L0 - lo0), k])
        vs = torch.cat([_need(f"{p}win_v", st.win_v, L0 - lo0), v])
        lo1 = 0 if W is None else max(0, L1 - W + 1)
        out.win_k, out.win_v = ks[lo1 - lo0:], vs[lo1 - lo0:]
        hi = pos + 1
        lo = torch.zeros_like(pos) if W is None else (pos - W + 1).clamp(min=0)
        c = o.new_carry(H, T, D)
        o.attend_range(q, ks, vs, lo0, lo, hi, c, span=(max(0, L0 - W + 1) if W else 0, L1))

        if spec.kind in ("hca", "csa"):
            m = spec.m
            limit = (pos + 1) // m                                  # entries w < (t+1)//m
            kvg = proj[:, 3 * HD:7 * HD]
            comp, out.tail_kv, out.tail_gate = self._compress(
                f"{p}", st.comp, st.tail_kv, st.tail_gate, kvg[:, :2 * HD], kvg[:, 2 * HD:],
                w[p + "cbias"], L0, L1, m)
            out.comp = comp
            ek = comp[:, :HD].reshape(-1, H, D)
            ev = comp[:, HD:].reshape(-1, H, D)
            if spec.kind == "hca":
                o.attend_range(q, ek, ev, 0, torch.zeros_like(limit), limit, c,
                             span=(0, L1 // m))
            else:
                Hi, Di = self.idx_heads, self.idx_dim
                ip = proj[:, 7 * HD:]
                iq = ip[:, :Hi * Di].reshape(T, Hi, Di)
                iw = ip[:, Hi * Di:Hi * Di + Hi]
                ikv, igate = ip[:, Hi * Di + Hi:Hi * Di + Hi + Di], ip[:, Hi * Di + Hi + Di:]
                keys, out.idx_tail_kv, out.idx_tail_gate = self._compress(
                    f"{p}idx_", st.idx_keys, st.idx_tail_kv, st.idx_tail_gate, ikv, igate,
                    w[p + "ibias"], L0, L1, m)
                out.idx_keys = keys
                if keys.shape[0] != comp.shape[0]:
                    raise StateError(f"{p}indexer: {keys.shape[0]} keys for {comp.shape[0]} entries")
                sel = o.topk_desc(o.index_scores(iq, iw, keys, limit), spec.topk)
                # attend over the selected *set*: ascending entry order (empty slots, -1, sort
                # first and add exact zeros, so only the order of real entries matters)
                sel = torch.sort(sel, dim=1).values
                if trace is not None:
                    trace[f"select.{i}"] = sel
                src = comp if comp.shape[0] else comp.new_zeros(1, 2 * HD)
                picked = src[sel.clamp(min=0)]                        # [T, k, 2*H*D]
                o.attend_gathered(q, picked[..., :HD].reshape(T, -1, H, D),
                                picked[..., HD:].reshape(T, -1, H, D), sel >= 0, c)
        att = o.finish(c).reshape(T, HD)
        h = x + o.linear(att, w[p + "wo"])
        hn = o.rms_norm(h, w[p + "norm2"])
        h = h + o.linear(o.silu(o.linear(hn, w[p + "w1"])), w[p + "w2"])
        return h, out

    def _compress(self, name, comp, tail_kv, tail_gate, kv, gate, bias, L0, L1, m):
        """Append the chunk to the tail, compress every completed block, keep the rest as tail."""
        comp = _need(f"{name}comp", comp, L0 // m)
        t0 = m * (L0 // m)
        akv = torch.cat([_need(f"{name}tail_kv", tail_kv, L0 - t0), kv])
        ag = torch.cat([_need(f"{name}tail_gate", tail_gate, L0 - t0), gate])
        nb = L1 // m - L0 // m
        if nb == 0:                                   # no block completes: tail grows only
            return comp, akv, ag
        C = kv.shape[1]
        new = self.ops.compress(akv[:nb * m].reshape(nb, m, C), ag[:nb * m].reshape(nb, m, C),
                                bias)
        return torch.cat([comp, new]), akv[nb * m:], ag[nb * m:]
