"""Where a transformers model's cache has boundaries, which scenarios cross them, and how much
float noise the model makes on its own (the tolerance of the oracle).

Boundaries come from the built config (transformers_models.boundaries_of) and from the live
cache layers; a scenario plan puts prefixes on, one before and one after each boundary and its
multiples, and cycles the suffix through one chunk, token by token, and chunks (the extend path).
"""

from __future__ import annotations

import contextlib
import math
import random
from typing import Any, Callable

from .cache import cache_layers, compare_caches, select_row
from .interface import classify, returned_cache
from .models import boundaries_of

SUFFIX_MODES = ("one_chunk", "token_by_token", "chunks")
# The PyTorch fallback of the gated delta rule works in chunks of 64 tokens (not a config field).
LINEAR_CHUNK = 64
MAX_MULTIPLE_LEN = 40  # multiples of a boundary up to this prefix length
NOISE_FACTOR = 8.0  # safety factor over the observed float noise
EPS_FLOOR = 16.0  # floor, in units of the dtype's epsilon relative to the compared magnitude


def boundaries(runner) -> dict[str, int]:
    """Granularities of the model's cache: the config's fields, then what the live cache reports."""
    torch = runner.torch
    found = boundaries_of(runner.config.get_text_config(decoder=True))
    _, cache = runner.prefill(torch.zeros((1, 2), dtype=torch.long))
    for layer in cache_layers(cache):
        w = getattr(layer, "sliding_window", None)
        if isinstance(w, int) and 0 < w < 1 << 20 and w not in found.values():
            found[f"window[{type(layer).__name__}]"] = w
        m = getattr(layer, "compress_rate", None)
        if isinstance(m, int) and m > 0 and m not in found.values():
            found[f"compress[{type(layer).__name__}]"] = m
        if hasattr(layer, "recurrent_states") and "linear_chunk" not in found:
            found["linear_chunk"] = LINEAR_CHUNK
    runner.cache_layer_classes = [type(x).__name__ for x in cache_layers(cache)]
    return found


def prefix_candidates(bounds: dict[str, int], min_len: int, cap: int = MAX_MULTIPLE_LEN) -> list[tuple[int, str]]:
    """Prefix lengths in priority order: on/-1/+1 of every boundary first (round robin), then its
    multiples up to ``cap`` tokens (``--sizes ratios`` raises it: ratios.multiple_cap), then the lcm
    of all, then small ones."""
    cand: dict[int, str] = {}

    def add(n: int, tag: str):
        if n >= min_len and n not in cand:
            cand[n] = tag
        elif n in cand and tag.split(":")[0] == cand[n].split(":")[0] and "small" not in cand[n]:
            cand[n] += "," + tag.split(":", 1)[1]  # two boundaries at one length: both named

    items = sorted(bounds.items(), key=lambda kv: kv[1])
    for name, b in items:
        add(b, f"on:{name}")
    for name, b in items:
        add(b - 1, f"off:{name}-1")
        add(b + 1, f"off:{name}+1")
    for name, b in items:
        if b >= LINEAR_CHUNK and (cap <= MAX_MULTIPLE_LEN or name == "linear_chunk"):
            continue
        k = 2
        while k * b <= cap:
            add(k * b, f"on:{k}*{name}")
            add(k * b - 1, f"off:{k}*{name}-1")
            add(k * b + 1, f"off:{k}*{name}+1")
            k += 1
    small = [b for b in bounds.values() if b < LINEAR_CHUNK]
    if len(small) > 1:
        lcm = 1
        for b in small:
            lcm = lcm * b // math.gcd(lcm, b)
        if lcm <= 64:
            add(lcm, "on:lcm(all)")
            add(lcm + 1, "off:lcm(all)+1")
    for n in (1, 2, 3, 5):
        add(n, "off:small")
    return list(cand.items())


def first_tier(bounds: dict[str, int], min_prefix: int, cap: int = MAX_MULTIPLE_LEN) -> int:
    """How many candidates are on, one before or one after a boundary (``cover`` runs them all)."""
    def tier1(tag: str) -> bool:
        return any("*" not in part and "small" not in part and "lcm" not in part
                   for part in tag.split(":", 1)[1].split(","))

    return sum(1 for _, tag in prefix_candidates(bounds, min_prefix, cap) if tier1(tag))


def plan(bounds: dict[str, int], n: int, rng: random.Random, min_prefix: int,
         cap: int = MAX_MULTIPLE_LEN) -> list[tuple]:
    """``n`` scenarios ``(prefix, tag, suffix_len, mode, chunks)``; the first ones take the
    candidates in priority order, each suffix long enough to cross the smallest boundary."""
    cands = prefix_candidates(bounds, min_prefix, cap)
    small = [b for b in bounds.values() if b < LINEAR_CHUNK] or [8]
    max_b = max(small)
    out = []
    for i in range(n):
        if i < len(cands):
            P, tag = cands[i]
        else:
            P = rng.randrange(min_prefix, 2 * max_b + 3)
            tag = next((t for m, t in cands if m == P), "random")
        mode = SUFFIX_MODES[i % 3]
        S = rng.randrange(max(2, min(small) + 1), max(4, min(max_b, 8)) + 2)
        chunks: list[int] = []
        if mode == "chunks":
            k = rng.randrange(2, min(3, S) + 1)
            cuts = sorted(rng.sample(range(1, S), k - 1))
            chunks = [b - a for a, b in zip([0] + cuts, cuts + [S])]
        out.append((P, tag, S, mode, chunks))
    return out


def calibrate(runner, length: int, gen) -> dict[str, Any]:
    """Float noise of the implementation when nothing but the GEMM shapes change.

    The same sequence runs alone and as row 1 of a batch of 3; the largest logit (per-layer
    hidden-state, per-cache-object) difference is the noise. A causality check appends 5 random
    tokens: earlier logits must not move (a recompute that depends on later tokens is reported).
    """
    torch = runner.torch
    noise = scale = 0.0
    n_layers = len(runner.layers)
    layer_noise = [0.0] * n_layers
    layer_scale = [0.0] * n_layers
    obj_noise: dict[tuple[int, str], float] = {}
    ext_runs = []
    for _ in range(2):
        ids = runner.tokens(gen, length)
        runner.rec.start()
        with torch.no_grad():
            out = runner._call("calibration", input_ids=ids, use_cache=True)
        out_cache = returned_cache(out, runner.cache_keyword)
        hs = runner.rec.stop()
        ref = out.logits[0].double()
        scale = max(scale, float(ref.abs().max()))
        batch = runner.tokens(gen, length, batch=3)
        batch[1] = ids[0]
        runner.rec.start()
        with torch.no_grad():
            outb = runner._call("calibration", input_ids=batch, use_cache=True)
        hsb = runner.rec.stop()
        noise = max(noise, float((outb.logits[1].double() - ref).abs().max()))
        row_cache = select_row(returned_cache(outb, runner.cache_keyword), 1)
        if row_cache is not None:
            for r in compare_caches(row_cache, out_cache):
                if math.isfinite(r["max_abs_diff"]):
                    key = (r["layer"], r["object"])
                    obj_noise[key] = max(obj_noise.get(key, 0.0), r["max_abs_diff"])
        for i, h in enumerate(hs):
            if h is None:
                continue
            hd = h[0].double()
            layer_scale[i] = max(layer_scale[i], float(hd.abs().max()))
            if hsb[i] is not None:
                layer_noise[i] = max(layer_noise[i], float((hsb[i][1].double() - hd).abs().max()))
        ext = torch.cat([ids, runner.tokens(gen, 5)], dim=1)
        lx, hsx = runner.full(ext, record=True)
        ext_runs.append((ref, hs, lx[:length], hsx))
    tol = max(NOISE_FACTOR * noise, EPS_FLOOR * runner.eps * max(scale, 1e-6))
    layer_tol = [max(NOISE_FACTOR * n, EPS_FLOOR * runner.eps * max(s, 1e-6))
                 for n, s in zip(layer_noise, layer_scale)]
    c_max, c_pos, c_layer = 0.0, None, None
    for ref, hs, lx, hsx in ext_runs:
        per_pos = (lx - ref).abs().max(dim=-1).values
        c_max = max(c_max, float(per_pos.max()))
        bad = (per_pos > tol).nonzero()
        if bad.numel():
            p = int(bad[0, 0])
            c_pos = p if c_pos is None else min(c_pos, p)
            for i in range(n_layers):
                if hs[i] is None or hsx[i] is None:
                    continue
                d = float((hsx[i][0, :length].double() - hs[i][0].double()).abs().max())
                if d > layer_tol[i]:
                    c_layer = i if c_layer is None else min(c_layer, i)
                    break
    causality = dict(causal=c_pos is None, max_abs_diff=c_max, first_position=c_pos,
                     first_layer=c_layer, sequence_len=length, appended_tokens=5)
    return dict(noise=noise, scale=scale, tolerance=tol, layer_tolerance=layer_tol, layer_scale=layer_scale,
                layer_noise=layer_noise,
                obj_noise=obj_noise, causality=causality)


def near_tie(logits, tol: float) -> bool:
    """A greedy flip the tolerance allows: the recompute's top two logits within 2 x tolerance
    (float noise alone can swap them)."""
    top2 = logits.topk(2).values
    return float(top2[0] - top2[1]) <= 2 * tol


def against_recompute(runner, ids, tokens: list[int], logits, tol: float, row: int = 0) -> dict[str, Any]:
    """A generation's greedy ``tokens`` (and its ``logits``, one per step, where given: batch row
    ``row``) against greedy decoding of ``ids`` (one unpadded row) by full recomputes, up to the
    first token that differs (a flip the tolerance allows is ``tie_flip``)."""
    import torch

    seq, without, max_abs, mismatch, tie_flip = ids, [], 0.0, None, False
    for step, tc in enumerate(tokens):
        lg_f = runner.full(seq)[0][-1]
        if logits is not None and step < len(logits):
            max_abs = max(max_abs, float((logits[step][row].double() - lg_f).abs().max()))
        tf = int(lg_f.argmax())
        without.append(tf)
        if tc != tf:
            mismatch, tie_flip = step, near_tie(lg_f, tol)
            break
        seq = torch.cat([seq, torch.tensor([[tc]], dtype=seq.dtype)], dim=1)
    return dict(tokens_with_cache=tokens, tokens_without_cache=without, match=mismatch is None,
                first_mismatch_step=mismatch, tie_flip=tie_flip, max_abs_diff=max_abs,
                logits_compared=logits is not None)


def generation_verdict(max_abs: float, match: bool, tie_flip: bool, tol: float) -> str:
    """exact / within-tolerance (a greedy flip only where the top two are within the tolerance) /
    divergent, for a generation compared token by token and logit by logit."""
    if max_abs == 0.0 and match:
        return "exact"
    return "within-tolerance" if max_abs <= tol and (match or tie_flip) else "divergent"


def compare_logits(got, ref, tol: float) -> dict[str, Any]:
    """Reuse logits against the recompute's, position by position (positions relative to ``ref``)."""
    per_pos = (got - ref).abs().max(dim=-1).values
    max_abs = float(per_pos.max())
    bad = (per_pos > tol).nonzero()
    flips = int((got.argmax(-1) != ref.argmax(-1)).sum())
    verdict = "exact" if max_abs == 0.0 and flips == 0 else "within-tolerance" if max_abs <= tol else "divergent"
    return dict(max_abs_diff=max_abs, first_bad=int(bad[0, 0]) if bad.numel() else None, argmax_flips=flips,
                verdict=verdict)


def layer_diffs(reuse_hs, full_hs, start: int, layer_tol: list[float]) -> tuple[list, int | None]:
    """Per decoder layer, the largest hidden-state difference of the reused positions against the
    recompute's from ``start`` on; and the first layer past its tolerance."""
    out, first = [], None
    for i, (rh, fh) in enumerate(zip(reuse_hs, full_hs)):
        if rh is None or fh is None or rh.shape[1] != fh.shape[1] - start:
            out.append(None)
            continue
        d = float((rh[0].double() - fh[0, start:].double()).abs().max())
        out.append(d)
        if first is None and d > layer_tol[i]:
            first = i
    return out, first


class Unsupported(Exception):
    """The release refuses this path for this model (the scenario's verdict ``unsupported``)."""


def guarded(body: Callable[[], dict[str, Any]], res: dict[str, Any], crash: Callable[[BaseException, str], str],
            where: str) -> None:
    """Run a scenario's ``body`` into ``res``: the release's refusal is ``unsupported``, a crash of
    the SUT is ``error`` (``crash`` names the path, layer and module), an exception on kvcheck's
    side of the boundary (interface.classify) is raised as CannotDrive, never a verdict."""
    try:
        res.update(body())
    except Unsupported as exc:
        res.update(verdict="unsupported", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - a crash of the SUT is a finding, not ours
        cd = classify(exc)
        if cd is not None:
            raise cd from exc
        res.update(verdict="error", error=crash(exc, where))


@contextlib.contextmanager
def quiet():
    """transformers' own generation warnings (pad/eos, attention mask) off while generate() runs."""
    try:
        from transformers.utils import logging as tlog
    except ImportError:  # pragma: no cover
        yield
        return
    level = tlog.get_verbosity()
    tlog.set_verbosity_error()
    try:
        yield
    finally:
        tlog.set_verbosity(level)
