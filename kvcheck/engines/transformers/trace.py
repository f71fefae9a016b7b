"""Which operation of a divergent layer computes differently on reuse, and why.

For the first divergent layer, every submodule's output, the attention function's inputs (query,
key, value, mask) and outputs (weights, output) and every top-k inside the layer are recorded on
the reuse path and on the recompute path, aligned position by position (queries by absolute
position; cached keys/entries by the offset that fits) and compared in execution order. The
first operation that differs beyond tolerance is reported with how it differs, and whether the
recompute path alone already shows it (a full forward that is not causal).
"""

from __future__ import annotations

import sys
from typing import Any

MASK_MIN = -1e30  # an additive mask entry below this (or False) hides the key


class OpRecorder:
    """Records the operations of one decoder layer, in execution order, per model call."""

    def __init__(self, runner, layer_idx: int):
        import torch

        self.torch = torch
        self.layer = runner.layers[layer_idx]
        self.names = {id(m): f"layers.{layer_idx}" + (f".{n}" if n else "") for n, m in self.layer.named_modules()}
        self.ops: list[tuple[str, Any, Any]] = []  # (name, tensor, input tensor | None)
        self.stack: list[str] = []
        self.handles = []
        for _, mod in self.layer.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._enter))
            self.handles.append(mod.register_forward_hook(self._leave))
        # inside an experts module each call sees the tokens routed to it, not positions: its
        # router's top-k and the experts module's own output are compared instead
        self.skip = {id(m) for n, m in self.layer.named_modules() if ".experts." in f".{n}" and
                     not n.endswith("experts")}
        self.patched = []
        mod = sys.modules.get(type(self.layer).__module__)
        for holder in {m for m in (mod,) + tuple(sys.modules.get(type(x).__module__) for x in
                                                   self.layer.modules()) if m is not None}:
            fn = getattr(holder, "eager_attention_forward", None)
            if callable(fn) and not getattr(fn, "_kvcheck", False):
                self._patch(holder, "eager_attention_forward", self._attention(fn))
        self._patch(torch, "topk", self._topk(torch.topk))
        self._patch(torch.Tensor, "topk", self._topk(torch.Tensor.topk))

    def _patch(self, holder, attr, new):
        self.patched.append((holder, attr, getattr(holder, attr)))
        setattr(holder, attr, new)

    def _enter(self, mod, _inp):
        self.stack.append(self.names[id(mod)])

    def _leave(self, mod, inp, out):
        if self.stack:
            self.stack.pop()
        if id(mod) in self.skip:
            return
        x = inp[0] if isinstance(inp, tuple) and inp and self.torch.is_tensor(inp[0]) else None
        for j, t in enumerate(out if isinstance(out, (tuple, list)) else [out]):
            if self.torch.is_tensor(t) and t.dim() > 0:
                self.ops.append((self.names[id(mod)] + (f"[{j}]" if j else ""), t.detach(), x))

    def _attention(self, fn):
        def wrapped(module, query, key, value, attention_mask, *a, **kw):
            name = self.names.get(id(module))
            if name is not None:
                self.ops.append((f"{name}.attention.query", query.detach(), None))
                self.ops.append((f"{name}.attention.key", key.detach(), None))
                self.ops.append((f"{name}.attention.value", value.detach(), None))
                if attention_mask is not None:
                    self.ops.append((f"{name}.attention.mask", attention_mask.detach(), None))
            out = fn(module, query, key, value, attention_mask, *a, **kw)
            if name is not None and isinstance(out, tuple):
                if len(out) > 1 and self.torch.is_tensor(out[1]):
                    self.ops.append((f"{name}.attention.weights", out[1].detach(), None))
                self.ops.append((f"{name}.attention.output", out[0].detach(), None))
            return out
        wrapped._kvcheck = True
        return wrapped

    def _topk(self, fn):
        def wrapped(inp, *a, **kw):
            out = fn(inp, *a, **kw)
            if self.stack:
                self.ops.append((f"{self.stack[-1]}.topk", out[1].detach(), inp.detach()))
            return out
        return wrapped

    def take(self) -> list[tuple[str, Any, Any]]:
        """This call's operations, each named uniquely (``#k`` for the k-th call of one name)."""
        seen: dict[str, int] = {}
        out = []
        for name, t, x in self.ops:
            k = seen.get(name, 0)
            seen[name] = k + 1
            out.append((name if k == 0 else f"{name}#{k}", t, x))
        self.ops = []
        return out

    def close(self):
        for h in self.handles:
            h.remove()
        for holder, attr, old in reversed(self.patched):
            setattr(holder, attr, old)


def _align(a, b, start: int, n: int, T: int):
    """``(a, b_slice, offset)``: ``b`` (a recompute over T positions) cut to the ``n`` query
    positions from ``start`` that ``a`` (one reuse call) holds; a dim of cached keys/entries is
    matched at the offset that fits best (0 for a full cache, ``start+n-m`` for a window).
    ``None`` when the shapes cannot be aligned (they then depend on the cache length)."""
    if a.dim() != b.dim():
        return None
    qd = next((d for d in range(a.dim()) if a.shape[d] == n and b.shape[d] == T and n != T), None)
    if qd is not None:
        b = b.narrow(qd, start, n)
    off = 0
    for d in range(a.dim()):
        if a.shape[d] == b.shape[d]:
            continue
        m, full = a.shape[d], b.shape[d]
        if m > full:
            return None
        best = None
        # rows that are not query positions (entries a call emits, e.g. a compressor's new
        # blocks) may sit anywhere: every offset is tried; key dims take the offsets that fit
        offsets = (range(full - m + 1) if qd is None else
                   sorted({0, max(0, min(full - m, start + n - m)), min(start, full - m)}))
        for o in offsets:
            cut = b.narrow(d, o, m)
            err = (_mismatches(a, cut) if a.shape == cut.shape and a.numel() else float("inf"))
            if best is None or err < best[0]:
                best = (err, o, cut)
        b, off = best[2], best[1]
    return a, b, off


def compare(name: str, a, xa, b, xb, start: int, n: int, T: int, rel_tol: float) -> dict[str, Any] | None:
    """How operation ``name`` differs between a reuse call and the recompute (None if it does not)."""
    import torch

    if name.endswith(".mask") or a.dtype == torch.bool:
        al = _align(a, b, start, n, T)
        if al is None:
            return dict(how=f"mask shape {list(a.shape)} depends on the cache length (recompute "
                            f"{list(b.shape)}); the masks cannot be matched position by position")
        a2, b2, off = al
        va = a2 if a2.dtype == torch.bool else a2.double() > MASK_MIN
        vb = b2 if b2.dtype == torch.bool else b2.double() > MASK_MIN
        if torch.equal(va, vb):
            return None
        hid = sorted({off + int(i) for i in (vb & ~va).nonzero()[:, -1].tolist()})
        extra = sorted({off + int(i) for i in (va & ~vb).nonzero()[:, -1].tolist()})
        parts = []
        if hid:
            parts.append(f"hides key positions {hid[:8]} that the recompute attends")
        if extra:
            parts.append(f"attends key positions {extra[:8]} that the recompute hides")
        return dict(how="mask " + " and ".join(parts), positions=hid or extra)
    is_topk = name.split("#")[0].endswith(".topk")
    if not a.is_floating_point() and not is_topk:
        al = _align(a, b, start, n, T)
        if al is None or al[0].shape != al[1].shape:
            return dict(how=f"index tensor shape {list(a.shape)} on reuse vs {list(b.shape)} on recompute")
        if torch.equal(al[0].sort(-1).values, al[1].sort(-1).values):
            return None
        return dict(how="returns a different set of indices")
    if is_topk:
        sa = _align(xa, xb, start, n, T) if xa is not None and xb is not None else None
        ia = _align(a, b, start, n, T)
        if ia is None or a.shape[-1] != b.shape[-1]:
            return dict(how=f"top-k result shape {list(a.shape)} depends on the cache length (recompute {list(b.shape)})")
        off = sa[2] if sa is not None else 0
        ra = (ia[0].long() + off).reshape(-1, a.shape[-1]).sort(-1).values
        rb = ia[1].long().reshape(-1, a.shape[-1]).sort(-1).values
        if torch.equal(ra, rb):
            return None
        row = int((ra != rb).any(-1).nonzero()[0, 0])
        q = start + row % n if ra.shape[0] % n == 0 else None
        only_r = sorted(set(ra[row].tolist()) - set(rb[row].tolist()))
        only_f = sorted(set(rb[row].tolist()) - set(ra[row].tolist()))
        detail = f" (query {q}: only reuse picks {only_r[:6]}, only recompute picks {only_f[:6]}"
        if sa is not None and sa[0].shape == sa[1].shape:
            va, vb = sa[0].reshape(-1, sa[0].shape[-1])[row], sa[1].reshape(-1, sa[1].shape[-1])[row]
            sc = [f"{float(va[i - off]):.4g}" for i in only_r[:3] if 0 <= i - off < va.numel()]
            sc += [f"{float(vb[i - off]):.4g}" for i in only_f[:3] if 0 <= i - off < vb.numel()]
            detail += f", scores {sc}"
        if q is not None and only_f and min(only_f) > q:
            detail += "; the recompute's picks lie after the query: masked future keys fill its top-k"
        detail += ")"
        scores_equal = sa is not None and _rel(sa[0], sa[1]) <= rel_tol
        how = ("selected a different set of indices while its input scores were equal within tolerance"
               " (a tie broken differently)" if scores_equal else
               "selected a different set of indices; its input scores differ "
               f"(relative {_rel(sa[0], sa[1]):.2g})" if sa is not None else
               "selected a different set of indices (its input scores could not be aligned)")
        return dict(how=how + detail)
    al = _align(a, b, start, n, T)
    if al is None or al[0].shape != al[1].shape:
        return None  # not position-aligned (e.g. the tokens routed to one expert): not comparable
    r = _rel(al[0], al[1])
    if r <= rel_tol:
        return None
    inp, shift = None, ""
    if xa is not None and xb is not None:
        ai = _align(xa, xb, start, n, T)
        inp = _rel(ai[0], ai[1]) if ai is not None else None
        if inp is not None and inp > rel_tol:
            shift = _shifted_row(ai[0], ai[1], xb, rel_tol)
    if name.split("#")[0].endswith((".attention.weights", ".attention.output")):
        inp = -1.0  # its inputs are the query/key/value/mask ops, compared (and equal) just before
    if name.split("#")[0].endswith((".attention.key", ".attention.value")):
        return dict(how=f"the {name.split('#')[0].rsplit('.', 1)[1]}s the attention reads (on reuse: the "
                        f"cached ones and this call's) differ from the recompute's (relative {r:.2g}, "
                        f"tolerance {rel_tol:.2g}) while every operation before agrees", relative=r)
    tail = (" while its inputs (query, key, value, mask) agree: the attention function computes "
            "differently for this call" if inp == -1.0 else "" if inp is None
            else " while its input is equal within tolerance" if inp <= rel_tol
            else f"; its input already differs (relative {inp:.2g}) while every operation recorded before "
                 "it agrees: the difference arises in code between recorded operations (functional code of "
                 "the enclosing module, e.g. a scan over the cached state), just before this one")
    return dict(how=f"output differs (relative {r:.2g}, tolerance {rel_tol:.2g}){tail}{shift}", relative=r)


def _shifted_row(a, b_aligned, b_full, rel_tol) -> str:
    """If the first differing row (dim -2) of the reuse input equals another row of the recompute's
    input, say so: the entry was built from a different token range / placed at another index."""
    if a.dim() < 2 or b_full.dim() != a.dim() or a.shape[-1] != b_full.shape[-1]:
        return ""
    A = _finite(a).reshape(-1, a.shape[-2], a.shape[-1])[0]
    Ba = _finite(b_aligned).reshape(-1, b_aligned.shape[-2], b_aligned.shape[-1])[0]
    B = _finite(b_full).reshape(-1, b_full.shape[-2], b_full.shape[-1])[0]
    scale = max(float(B.abs().max()), 1e-30)
    bad = ((A - Ba).abs().amax(-1) > rel_tol * scale).nonzero()
    if not bad.numel():
        return ""
    j = int(bad[0, 0])
    d = (B - A[j]).abs().amax(-1)
    k = int(d.argmin())
    if float(d[k]) > rel_tol * scale:
        return f"; row {j} of its input on reuse matches no row of the recompute's input"
    return (f"; row {j} of its input on reuse equals row {k} of the recompute's input (built from "
            "another token range, or placed at another index)")


def _mismatches(a, b) -> float:
    """How many elements differ clearly (offset choice: the right offset leaves only float noise)."""
    fa, fb = _finite(a), _finite(b)
    return float(((fa - fb).abs() > 1e-3 * (fb.abs() + 1e-3)).sum())


def _finite(x):
    import torch

    return torch.nan_to_num(x.double(), nan=0.0, posinf=1e30, neginf=-1e30)


def _rel(a, b) -> float:
    d = a.double() - b.double()
    d = d[d.isfinite()] if d.numel() else d
    if d.numel() == 0:
        return 0.0
    return float(d.abs().max()) / max(float(b.double()[b.double().isfinite()].abs().max()) if b.numel() else 0.0,
                                      1e-30)


def _first_diff(opsA, opsB, start, n, T, rel_tol):
    ref = {name: (t, x) for name, t, x in opsB}
    mine = {name for name, _, _ in opsA}
    for name, t, x in opsA:
        if name.endswith(".attention.query"):
            mask = name[: -len("query")] + "mask"
            if (mask in mine) != (mask in ref):
                side = ("reuse passes an attention mask while the recompute passes none" if mask in mine else
                        "reuse passes no attention mask (None) while the recompute passes one")
                return dict(operation=mask, how=side)
        if name not in ref:
            continue
        d = compare(name, t, x, ref[name][0], ref[name][1], start, n, T, rel_tol)
        if d is not None:
            return dict(operation=name, **d)
    return None


def trace(runner, ids, P: int, steps: list[int], restored, layer_idx: int, rel_tol: float) -> dict[str, Any]:
    """The first operation of layer ``layer_idx`` that differs, on reuse and on recompute alone."""
    import copy

    rec = OpRecorder(runner, layer_idx)
    try:
        T = ids.shape[1]
        cache, start, per_step = copy.deepcopy(restored), P, []
        for n in steps:
            _, cache = runner.step(ids[:, start:start + n], cache, past=start)
            per_step.append((start, n, rec.take()))
            start += n
        runner.full(ids)
        full_ops = rec.take()
        for start, n, ops in per_step:
            found = _first_diff(ops, full_ops, start, n, T, rel_tol)
            if found is None:
                continue
            # the recompute alone: the full forward of only the tokens the reuse call has seen
            runner.full(ids[:, :start + n])
            short_ops = rec.take()
            in_recompute = _first_diff(short_ops, full_ops, start, n, T, rel_tol) if start + n < T else None
            same_as_short = _first_diff(ops, short_ops, start, n, start + n, rel_tol) is None
            if in_recompute is not None:
                where = (f"present in the recompute path itself: the full forward is not causal ("
                         f"{in_recompute['operation']} at positions 0..{start + n - 1} changes when "
                         f"tokens {start + n}..{T - 1} are appended)"
                         + ("; reuse equals a recompute of the tokens it has seen" if same_as_short else ""))
            else:
                where = "only on reuse: a full forward of the same tokens is causal and agrees with the recompute"
            found.update(call=dict(start=start, tokens=n), recompute=where, in_recompute=in_recompute is not None)
            return found
        return dict(operation=None, how="no operation of this layer differs beyond the trace's tolerance "
                                        f"(relative {rel_tol:.2g}, a few times the layer's calibrated noise): "
                                        "the divergence of this layer is at float-noise scale")
    finally:
        rec.close()
