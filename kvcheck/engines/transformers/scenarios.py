"""One reuse-vs-recompute scenario on a transformers model, and a whole run of them.

A scenario prefills a prefix into the model's own cache, snapshots it (deep copy) at the prefix
boundary, restores it (optionally through a planted fault), continues with the suffix (one chunk,
token by token, or chunks) and greedy-generates; logits are compared with one full forward
without cache. A crash in any path is the scenario's verdict ``error`` (one line naming the path,
layer and module) and the run goes on.
"""

from __future__ import annotations

import copy
import random
import re
from typing import Any

from . import assist, paths, plan as planlib, positions
from .cache import FAULTS, SLIDING_FAULTS, CacheFault, compare_caches
from .interface import (CannotDrive, cache_keyword, call_with_cache, classify, here, output_fields, release,
                        returned_cache)
from .interface import prefill as first_call
from .models import AdapterError, finite, one_line

VERDICT_ORDER = ("exact", "within-tolerance", "divergent", "error")
GEN_TOKENS = 3


def decoder_layers(model) -> list:
    """The decoder-layer ModuleList (the longest ``*.layers`` list matching num_hidden_layers)."""
    import torch

    n = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
            if n is None or len(mod) == n:
                if best is None or len(mod) > len(best):
                    best = mod
    if best is None:
        raise AdapterError(f"cannot find the decoder layers of {type(model).__name__}")
    return list(best)


def cache_of(out):
    """The cache object a forward returned, from the output field this release declares
    (``cache`` in 5.24, ``past_key_values`` in 5.16: interface.returned_cache)."""
    return returned_cache(out)


class LayerRecorder:
    """Forward hooks on the decoder layers, recording each layer's output hidden states."""

    def __init__(self, layers):
        self.on = False
        self.shape = (0, 0)  # (tokens, batch) of the model call under way
        self.calls: list[list] = [[] for _ in layers]
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(layers)]

    def _hook(self, i):
        def hook(_mod, _inp, out):
            if self.on:
                h = out[0] if isinstance(out, (tuple, list)) else out
                if hasattr(h, "last_hidden_state"):
                    h = h.last_hidden_state
                if hasattr(h, "detach") and h.dim() >= 2:
                    h = self._as_btf(h.detach())
                    if h is not None:
                        self.calls[i].append(h)
        return hook

    def _as_btf(self, h):
        """``[batch, tokens, features]`` whatever the layout (gemma3n's altup streams first,
        DeepSeek-V4's hyper-connection copies after the tokens): found by the call's sizes."""
        n, b = self.shape
        td = next((d for d in range(1, h.dim()) if h.shape[d] == n), 0 if h.shape[0] == n else None)
        bd = next((d for d in range(h.dim()) if d != td and h.shape[d] == b), None)
        if td is None or bd is None:
            return None
        return h.movedim((bd, td), (0, 1)).reshape(b, n, -1)

    def start(self):
        self.calls = [[] for _ in self.calls]
        self.on = True

    def stop(self):
        import torch

        self.on = False
        return [torch.cat(c, dim=1) if c and len({x.shape[0] for x in c}) == 1 else None for c in self.calls]

    def close(self):
        for h in self.handles:
            h.remove()


class ModuleStack:
    """Which module is running: after an exception, the innermost one that did not return."""

    def __init__(self, model):
        self.stack: list[str] = []
        self.handles = []
        for name, mod in model.named_modules():
            if name:
                self.handles.append(mod.register_forward_pre_hook(self._enter(name)))
                self.handles.append(mod.register_forward_hook(self._leave(name)))

    def _enter(self, name):
        def pre(_m, _i):
            self.stack.append(name)
        return pre

    def _leave(self, name):
        def post(_m, _i, _o):
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
        return post

    def where(self) -> tuple[int | None, str | None]:
        name = self.stack[-1] if self.stack else None
        m = re.search(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)(?:\.|$)", name or "")
        return (int(m.group(1)) if m else None), name

    def close(self):
        for h in self.handles:
            h.remove()


class Runner:
    def __init__(self, model, config, model_type: str, dtype: str, seed: int):
        import torch

        self.torch = torch
        self.model, self.config, self.model_type = model, config, model_type
        self.dtype_name, self.seed = dtype, seed
        self.vocab = int(config.get_text_config(decoder=True).vocab_size)
        self.layers = decoder_layers(model)
        self.cache_keyword = cache_keyword(model)   # this release's own keyword (CannotDrive if none)
        self.rec = LayerRecorder(self.layers)
        self.mods = ModuleStack(model)
        self.eps = float(torch.finfo(next(model.parameters()).dtype).eps)
        self.cache_layer_classes: list[str] = []
        self.path, self.in_model = "setup", False
        self.kept: dict[str, Any] = {}  # the divergent scenario with the earliest layer, for tracing

    def close(self):
        self.rec.close()
        self.mods.close()

    # -- model calls ---------------------------------------------------------------------
    def _call(self, path: str, **kw):
        self.path, self.in_model = path, True
        self.rec.shape = (kw["input_ids"].shape[1], kw["input_ids"].shape[0])
        self.mods.stack.clear()
        with self.torch.no_grad():
            out = self.model(**kw)
        self.in_model = False
        return out

    def full(self, ids, record=False):
        if record:
            self.rec.start()
        out = self._call("recompute", input_ids=ids, use_cache=False)
        hs = self.rec.stop() if record else None
        return out.logits[0].double(), hs

    def prefill(self, ids):
        out, cache = first_call(self.model, ids, call=lambda **kw: self._call("prefill", **kw))
        if cache is None:
            raise CannotDrive("transformers", release(), (
                f"{type(self.model).__name__} returned no cache kvcheck can read after a prefill with use_cache=True "
                f"(its output {type(out).__name__} declares {', '.join(output_fields(out)) or 'no fields'})"), here())
        return out.logits[0].double(), cache

    def step(self, ids, cache, path="extend", past=None, **extra):
        """Continue ``cache`` (holding ``past`` tokens) with ``ids`` through the keyword this
        release's forward declares; a model that ignored the cache is CannotDrive
        (interface.check_used), never a divergence."""
        path = path if ids.shape[1] > 1 else "decode"
        out, got = call_with_cache(self.model, cache, call=lambda **kw: self._call(path, **kw), past=past,
                                   input_ids=ids, use_cache=True, **extra)
        return out.logits[0].double(), got

    def tokens(self, gen, n: int, batch: int = 1):
        return self.torch.randint(0, self.vocab, (batch, n), generator=gen)

    def crash(self, exc: BaseException, where: str) -> str:
        if not self.in_model:
            return (f"{where}: kvcheck could not compare this model's outputs after its {self.path} call "
                    f"(not a model crash): {type(exc).__name__}: {one_line(exc)}")
        layer, module = self.mods.where()
        return (f"{where}: {self.path} crashed in layer {layer}, module {module or '(model)'}: "
                f"{type(exc).__name__}: {one_line(exc)}")

    # -- one scenario --------------------------------------------------------------------
    def scenario(self, idx, P, tag, S, mode, chunks, gen, cal, fault) -> dict[str, Any]:
        ids = self.tokens(gen, P + S)
        res: dict[str, Any] = dict(index=idx, prefix_len=P, prefix_boundary=tag, suffix_len=S, suffix_mode=mode,
                                   chunks=chunks if mode == "chunks" else None)
        try:
            res.update(self._scenario(idx, ids, P, S, mode, chunks, cal, fault))
        except Exception as exc:  # noqa: BLE001 - a crash of the SUT is a finding, not ours
            cd = classify(exc)   # kvcheck's side of the boundary (fuzz/boundary.py): no verdict
            if cd is not None:
                raise cd from exc
            res.update(verdict="error", error=self.crash(exc, f"scenario {idx} (prefix {P}, {mode})"),
                       max_abs_diff=None, first_divergent_layer=None)
        return res

    def _scenario(self, idx, ids, P, S, mode, chunks, cal, fault) -> dict[str, Any]:
        torch = self.torch
        tol = cal["tolerance"]
        full_logits, full_hs = self.full(ids, record=True)
        _, cache = self.prefill(ids[:, :P])
        snapshot = copy.deepcopy(cache)
        del cache
        restored = copy.deepcopy(snapshot)
        fault_info = fault.apply(restored, snapshot) if fault is not None else None
        restored_rows = compare_caches(restored, snapshot)
        kept = copy.deepcopy(restored)
        steps = [S] if mode == "one_chunk" else [1] * S if mode == "token_by_token" else chunks
        pieces = []
        self.rec.start()
        c, start = restored, P
        for n in steps:
            lg, c = self.step(ids[:, start:start + n], c, past=start)
            pieces.append(lg)
            start += n
        reuse_hs = self.rec.stop()
        reuse_logits = torch.cat(pieces, dim=0)
        ref = full_logits[P:]
        per_pos = (reuse_logits - ref).abs().max(dim=-1).values
        max_abs = float(per_pos.max())
        bad = (per_pos > tol).nonzero()
        first_pos = int(bad[0, 0]) + P if bad.numel() else None
        flips = int((reuse_logits.argmax(-1) != ref.argmax(-1)).sum())
        _, oneshot = self.prefill(ids)
        after_rows = compare_caches(c, oneshot)
        gen_res = self._generate(ids, reuse_logits[-1], c, GEN_TOKENS, tol)
        max_abs = max(max_abs, gen_res["max_abs_diff"])
        if max_abs == 0.0 and flips == 0 and gen_res["match"]:
            verdict = "exact"
        elif max_abs <= tol and (gen_res["match"] or gen_res.get("tie_flip")):
            verdict = "within-tolerance"
        else:
            verdict = "divergent"
        layer_diff, first_layer = planlib.layer_diffs(reuse_hs, full_hs, P, cal["layer_tolerance"])
        res: dict[str, Any] = dict(
            max_abs_diff=max_abs, first_divergent_position=first_pos, argmax_flips=flips,
            generation=gen_res, verdict=verdict, steps=steps,
            first_divergent_layer=first_layer if verdict == "divergent" else None,
            layer_max_abs_diff=layer_diff)
        if fault is not None:
            res["fault"] = dict(name=fault.name, layer=fault.layer, **(fault_info or {}))
            res["fault_layer"] = fault.layer
        if verdict == "divergent":
            res["cache_diff"] = self._explain(restored_rows, after_rows, cal)
            res["explained_by"] = explanation(res["cache_diff"], first_layer)
            res["positions_probe"] = positions.probe(self, ids, P, steps, kept, ref, tol, float(per_pos.max()))
            if first_layer is not None and (not self.kept or first_layer < self.kept["layer"]):
                self.kept = dict(layer=first_layer, index=idx, ids=ids, cache=kept)
        return res

    def _generate(self, ids, last_logits, cache, n_gen: int, tol: float) -> dict[str, Any]:
        torch = self.torch
        seq, with_cache, without = ids, [], []
        max_abs, mismatch, tie_flip, lg_c = 0.0, None, False, last_logits
        for step in range(n_gen):
            lg_f = self.full(seq)[0][-1]
            max_abs = max(max_abs, float((lg_c - lg_f).abs().max()))
            tc, tf = int(lg_c.argmax()), int(lg_f.argmax())
            with_cache.append(tc)
            without.append(tf)
            if tc != tf:
                mismatch, tie_flip = step, planlib.near_tie(lg_f, tol)
                break
            nxt = torch.tensor([[tc]], dtype=seq.dtype)
            seq = torch.cat([seq, nxt], dim=1)
            if step + 1 < n_gen:
                lg, cache = self.step(nxt, cache, past=seq.shape[1] - 1)
                lg_c = lg[-1]
        return dict(tokens_with_cache=with_cache, tokens_without_cache=without, match=mismatch is None,
                    first_mismatch_step=mismatch, tie_flip=tie_flip, max_abs_diff=max_abs)

    def _explain(self, restored_rows, after_rows, cal) -> list[dict[str, Any]]:
        out = []
        for stage, rows, exact in (("restored_snapshot", restored_rows, True), ("after_suffix", after_rows, False)):
            for r in rows:
                thr = 0.0
                if not exact and r["kind"] != "counter":
                    n = cal["obj_noise"].get((r["layer"], r["object"]), 0.0)
                    thr = max(planlib.NOISE_FACTOR * n, planlib.EPS_FLOOR * self.eps * max(r["scale"], 1e-6))
                if r["max_abs_diff"] > thr or r["shape_mismatch"]:
                    out.append(dict(stage=stage, **r, threshold=thr))
        out.sort(key=lambda r: (r["stage"] != "restored_snapshot", r["layer"], -finite(r["max_abs_diff"])))
        return out

    # -- whole run -----------------------------------------------------------------------
    def make_fault(self, fault_name: str | None, rng: random.Random) -> CacheFault | None:
        if fault_name is None:
            return None
        name, _, at = fault_name.partition("@")
        if name not in FAULTS:
            raise AdapterError(f"unknown fault {fault_name!r}; known: {', '.join(FAULTS)} (optionally NAME@LAYER)")
        _, probe = self.prefill(self.torch.zeros((1, 4), dtype=self.torch.long))
        eligible = CacheFault.eligible(name, probe)
        if not eligible:
            raise AdapterError(f"fault {name} needs a layer with cached keys"
                               f"{' in a sliding window' if name in SLIDING_FAULTS else ''};"
                               f" {self.model_type} has none")
        if at:
            try:
                layer = int(at)
            except ValueError:
                raise AdapterError(f"bad fault layer {at!r} in {fault_name!r}") from None
            if layer not in eligible:
                raise AdapterError(f"layer {layer} is not eligible for {name}; eligible: {eligible}")
        else:
            layer = rng.choice(eligible)
        return CacheFault(name, layer, random.Random(rng.randrange(2**31)))

    def run(self, scenarios: int, fault_name: str | None, cover: bool = False) -> dict[str, Any]:
        torch = self.torch
        rng = random.Random(self.seed)
        gen = torch.Generator().manual_seed(self.seed)
        bounds = planlib.boundaries(self)
        fault = self.make_fault(fault_name, rng)
        min_prefix = 3 if fault is not None else 1
        extra = assist.plan(bounds, scenarios, self.seed, fault)   # assisted decoding: draft, roll back, continue
        reuse = paths.plan(bounds, scenarios, self.seed, fault)   # a shared prompt cache, generate(), a batch
        scenarios = max(1, scenarios - len(extra) - len(reuse))
        cap = planlib.MAX_MULTIPLE_LEN
        if getattr(self, "sizes", "fixed") == "ratios":  # cross every real-ratio boundary at least twice
            from .ratios import multiple_cap
            cap = multiple_cap({k: b for k, b in bounds.items() if k != "linear_chunk"}, cap)
        if cover:  # at least on, one before and one after every boundary
            scenarios = max(scenarios, planlib.first_tier(bounds, min_prefix, cap))
        todo = planlib.plan(bounds, scenarios, rng, min_prefix, cap)
        max_len = max(p[0] + p[2] + GEN_TOKENS for p in todo)
        try:
            cal = planlib.calibrate(self, max_len, gen)
        except Exception as exc:  # noqa: BLE001
            cd = classify(exc)
            if cd is not None:
                raise cd from exc
            return dict(boundaries=bounds, verdict="error", error=self.crash(exc, "calibration"),
                        scenarios=[], counts={v: 0 for v in VERDICT_ORDER})
        results = [self.scenario(i, *p, gen, cal, fault) for i, p in enumerate(todo)]
        results += assist.run_all(self, extra, len(results), gen, cal, fault)
        results += paths.run_all(self, reuse, len(results), gen, cal, fault)
        counts = {v: sum(1 for r in results if r["verdict"] == v) for v in VERDICT_ORDER + ("unsupported",)
                  if v != "unsupported" or extra or reuse}
        worst = max((r["verdict"] for r in results if r["verdict"] != "unsupported"), key=VERDICT_ORDER.index,
                    default="exact")
        divergent = [r for r in results if r["verdict"] == "divergent"]
        return dict(
            boundaries=bounds, cal=cal, tolerance=cal["tolerance"], observed_noise=cal["noise"],
            logit_scale=cal["scale"], layer_tolerance=cal["layer_tolerance"],
            recompute_causality=cal["causality"], fault_layer=fault.layer if fault is not None else None,
            first_divergent_layer=min((r["first_divergent_layer"] for r in divergent
                                       if r["first_divergent_layer"] is not None), default=None),
            max_abs_diff=max((r["max_abs_diff"] for r in results if r.get("max_abs_diff") is not None),
                             default=0.0),
            verdict=worst, counts=counts, scenarios=results,
            errors=[r["error"] for r in results if r["verdict"] == "error"],
            suffix_modes={m: sorted({r["verdict"] for r in results if r["suffix_mode"] == m})
                          for m in planlib.SUFFIX_MODES + (assist.MODES if extra else ())
                          + (paths.MODES if reuse else ())})


def explanation(rows: list[dict[str, Any]], first_layer: int | None) -> dict[str, Any] | None:
    """The cache object that best explains the divergence: a corrupted restored object first,
    else the first-divergent layer's object with the largest difference after the suffix."""
    restored = [r for r in rows if r["stage"] == "restored_snapshot"]
    pool = restored or rows
    if first_layer is not None and not any(r["layer"] <= first_layer for r in pool):
        return dict(stage=None, layer=first_layer, object=None, kind="computation", max_abs_diff=None,
                    note="every cache object of this layer matches a one-shot prefill: the difference "
                         "arises in the layer's computation on the reused state, not in the stored state")
    if not pool:
        return None
    if first_layer is not None and any(r["layer"] == first_layer for r in pool):
        pool = [r for r in pool if r["layer"] == first_layer]
    else:
        lay = min(r["layer"] for r in pool)
        pool = [r for r in pool if r["layer"] == lay]
    best = max(pool, key=lambda r: (r["kind"] != "counter", finite(r["max_abs_diff"]) / max(r["scale"], 1e-30)))
    return dict(stage=best["stage"], layer=best["layer"], object=best["object"], kind=best["kind"],
                max_abs_diff=best["max_abs_diff"])
