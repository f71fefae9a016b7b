"""The reuse paths users take, as scenarios: one prompt cache shared by several requests,
``generate()`` continuing a cache, a left-padded batch (docs/adapters-transformers.md, "Reuse
paths: a shared prompt cache, generate() from a cache, left-padded batches").

Each is compared with full recomputes under the run's calibrated tolerance:

- ``shared_prefix``: one prefix cache, computed once, deep-copied per request (what transformers'
  docs teach for prompt reuse) and continued with 2-3 different suffixes (one chunk, token by
  token, chunks); each continuation against its own full forward, then the prompt cache itself
  against a second prefill of the prompt, object by object: a copy that shares state with the
  original changes it.
- ``generate_continue``: ``generate(prefix + suffix, <cache>=the prefix's cache)`` against greedy
  decoding by full recomputes (tokens; logits from ``output_logits``) and against ``generate()``
  from scratch on the same ids.
- ``batched_left_pad``: 2-3 prompts of different lengths left-padded (pad id from the config, else
  0; ``attention_mask`` 0 on the pads) through ``generate()``, which derives the positions from the
  mask itself; each row against that row decoded alone, unpadded, by full recomputes.

A path the release refuses before running any forward (``generate()`` raising on its arguments)
is ``unsupported`` with the reason; a crash afterwards is ``error`` naming path, layer and module.
"""
from __future__ import annotations

import contextlib
import copy
import random
from typing import Any

from . import plan as planlib
from .cache import GENERATE_STALE_PREFIX, PAD_ROWS_SWAPPED, PATH_FAULTS, SHARED_COPY_ALIASES, cache_layers, \
    compare_caches, objects, share_layer
from .interface import cache_keyword, classify, generate_with_cache, release, returned_cache
from .models import one_line

MODES = ("shared_prefix", "generate_continue", "batched_left_pad")
PER_KIND = 2        # at most this many of each kind
FIRST_AT = 13       # one of each from 13 scenarios, two from 26: runs of 4 and 10 are as they were
GEN_NEW = 3         # tokens each generate() makes
STEPS = ("one_chunk", "token_by_token", "chunks")     # how copy k of the prompt cache is continued




def count(n: int) -> int:
    """How many of the ``n`` scenarios of a run take a reuse path."""
    return len(MODES) * min(PER_KIND, n // FIRST_AT)


def plan(bounds: dict[str, int], n: int, seed: int, fault=None) -> list[dict[str, Any]]:
    """The reuse-path scenarios of a run of ``n`` (one of each at least when the planted fault is
    one of theirs), around the model's small boundaries; drawn from their own seeded stream, so
    the other scenarios stay as they were."""
    total = max(count(n), len(MODES) if fault is not None and fault.name in PATH_FAULTS else 0)
    if total == 0:
        return []
    small = sorted((b, k) for k, b in bounds.items() if 1 < b < planlib.LINEAR_CHUNK) or [(8, "none")]
    rng = random.Random(f"kvcheck-paths:{seed}")
    out = []
    for j in range(total // len(MODES)):
        b, name = small[j % len(small)]
        top = min(b, 8) + 2
        P = max(1, rng.choice([b - 1, b, b + 1]))
        k = rng.choice([2, 3])
        out.append(dict(mode="shared_prefix", P=P, suffixes=[rng.randrange(2, top) for _ in range(k)],
                        cut=rng.randrange(1, 2), b=(name, b)))
        P = max(1, rng.choice([b - 1, b, b + 1, 2 * b - 1]))
        out.append(dict(mode="generate_continue", P=P, S=rng.randrange(1, top), new=GEN_NEW, b=(name, b)))
        rows = rng.choice([2, 3])
        lengths = rng.sample(range(max(2, b - 2), b + 4), rows)
        out.append(dict(mode="batched_left_pad", P=max(lengths), lengths=lengths, new=GEN_NEW, b=(name, b)))
    return out


def run_all(runner, items: list[dict[str, Any]], first: int, gen, cal, fault) -> list[dict[str, Any]]:
    p = Paths(runner, cal, fault)
    return [p.scenario(first + i, it, gen) for i, it in enumerate(items)]


def pad_id(config, vocab: int) -> int:
    """The tokenizer-less pad convention: the config's pad token id where it names one, else 0."""
    pid = getattr(config.get_text_config(decoder=True), "pad_token_id", None)
    return pid if isinstance(pid, int) and 0 <= pid < vocab else 0


def shared_storage(a, b) -> list[str]:
    """``layer:object`` of every tensor of cache ``a`` whose storage is one of cache ``b``'s."""
    out = []
    for i, (la, lb) in enumerate(zip(cache_layers(a), cache_layers(b))):
        ptrs = {v.untyped_storage().data_ptr() for _, v in objects(lb).values() if hasattr(v, "untyped_storage")}
        out += [f"{i}:{name}" for name, (_, v) in objects(la).items()
                if hasattr(v, "untyped_storage") and v.untyped_storage().data_ptr() in ptrs]
    return out


class Paths:
    def __init__(self, runner, cal, fault):
        self.r, self.cal, self.torch = runner, cal, runner.torch
        self.fault = fault if fault is not None and fault.name in PATH_FAULTS else None
        self.hits = 0
        self.pad = pad_id(runner.config, runner.vocab)

    def scenario(self, idx: int, it: dict[str, Any], gen) -> dict[str, Any]:
        name, b = it["b"]
        mode, P = it["mode"], it["P"]
        tag = f"2*{name}-1" if P == 2 * b - 1 and b > 2 else f"{name}{P - b:+d}"
        res: dict[str, Any] = dict(index=idx, prefix_len=P, prefix_boundary=tag, suffix_mode=mode,
                                   chunks=None, max_abs_diff=None, first_divergent_position=None, argmax_flips=None,
                                   first_divergent_layer=None, generation=None)
        body = dict(shared_prefix=self._shared, generate_continue=self._continue, batched_left_pad=self._batch)[mode]
        self.hits = 0
        planlib.guarded(lambda: body(it, gen, res), res, self.r.crash, f"scenario {idx} (prefix {P}, {mode})")
        if self.fault is not None:
            res["fault"] = dict(name=self.fault.name, layer=self.fault.layer, applied=self.hits > 0)
            res["fault_layer"] = self.fault.layer
        return res

    def _planted(self, name: str) -> bool:
        return self.fault is not None and self.fault.name == name

    # -- one prompt cache, several requests ----------------------------------------------
    def _shared(self, it, gen, res) -> dict[str, Any]:
        torch, r, tol = self.torch, self.r, self.cal["tolerance"]
        P = it["P"]
        prefix = r.tokens(gen, P)
        suffixes = [r.tokens(gen, S) for S in it["suffixes"]]
        res.update(suffix_len=sum(it["suffixes"]), suffixes=it["suffixes"])
        _, prompt = r.prefill(prefix)
        _, pristine = r.prefill(prefix)         # the same prompt again: what the prompt cache must still hold
        copies = []
        for k, suf in enumerate(suffixes):
            S, how = suf.shape[1], STEPS[k % len(STEPS)]
            steps = [S] if how == "one_chunk" else [1] * S if how == "token_by_token" else [it["cut"], S - it["cut"]]
            c = copy.deepcopy(prompt)
            aliased = shared_storage(c, prompt)
            if self._planted(SHARED_COPY_ALIASES.name) and share_layer(c, prompt, self.fault.layer):
                self.hits += 1
            ids = torch.cat([prefix, suf], dim=1)
            full_logits, full_hs = r.full(ids, record=True)
            pieces, start = [], P
            r.rec.start()
            for n in steps:
                lg, c = r.step(ids[:, start:start + n], c, past=start)
                pieces.append(lg)
                start += n
            reuse_hs = r.rec.stop()
            cmp = planlib.compare_logits(torch.cat(pieces, dim=0), full_logits[P:], tol)
            layer_diff, first_layer = planlib.layer_diffs(reuse_hs, full_hs, P, self.cal["layer_tolerance"])
            copies.append(dict(suffix_len=S, how=how, steps=steps, max_abs_diff=cmp["max_abs_diff"],
                               first_divergent_position=None if cmp["first_bad"] is None else P + cmp["first_bad"],
                               argmax_flips=cmp["argmax_flips"], verdict=cmp["verdict"], shared_storage=aliased,
                               first_divergent_layer=first_layer if cmp["verdict"] == "divergent" else None,
                               layer_max_abs_diff=layer_diff))
        changed = r._explain([], compare_caches(prompt, pristine), self.cal)
        for row in changed:
            row["stage"] = "prompt_cache_after_copies"
        verdicts = [c["verdict"] for c in copies] + (["divergent"] if changed else [])
        bad = [c for c in copies if c["verdict"] == "divergent"]
        layers = [c["first_divergent_layer"] for c in bad if c["first_divergent_layer"] is not None]
        layers += [row["layer"] for row in changed]
        return dict(copies=copies, prompt_cache_changed=changed,
                    verdict=max(verdicts, key=order), max_abs_diff=max(c["max_abs_diff"] for c in copies),
                    argmax_flips=sum(c["argmax_flips"] for c in copies),
                    first_divergent_position=min((c["first_divergent_position"] for c in bad
                                                  if c["first_divergent_position"] is not None), default=None),
                    first_divergent_layer=min(layers, default=None))

    # -- generate() --------------------------------------------------------------------
    @contextlib.contextmanager
    def _generating(self, path: str):
        """generate() running: crashes name ``path`` and the module; a refusal before any forward
        is Unsupported with the release's reason."""
        r, calls = self.r, [0]
        hook = r.model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        r.path, r.in_model = path, True
        r.mods.stack.clear()
        try:
            with self.torch.no_grad(), planlib.quiet():
                yield
        except Exception as exc:  # noqa: BLE001
            if calls[0] == 0 and classify(exc) is None:
                raise planlib.Unsupported(f"{path}: generate() refused before any forward on transformers {release()}: "
                                  f"{type(exc).__name__}: {one_line(exc)}") from exc
            raise
        finally:
            hook.remove()
        r.in_model = False

    def _kw(self, ids, mask, new: int) -> dict[str, Any]:
        return dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                    return_dict_in_generate=True, output_logits=True, eos_token_id=None, pad_token_id=self.pad)

    def _continue(self, it, gen, res) -> dict[str, Any]:
        torch, r, tol = self.torch, self.r, self.cal["tolerance"]
        P, S, n = it["P"], it["S"], it["new"]
        ids = r.tokens(gen, P + S)
        res.update(suffix_len=S, new_tokens=n)
        _, cache = r.prefill(ids[:, :P])
        if self._planted(GENERATE_STALE_PREFIX.name):
            other = ids[:, :P].clone()
            other[0, P - 1] = (other[0, P - 1] + 1) % r.vocab
            _, stale = r.prefill(other)
            layers = cache_layers(cache)
            if self.fault.layer < len(layers):
                cache.layers[self.fault.layer] = cache_layers(stale)[self.fault.layer]
                self.hits += 1
        kw = self._kw(ids, torch.ones_like(ids), n)
        with self._generating("generate (from a cache)"):
            out = generate_with_cache(r.model, cache, P, **kw)
        with self._generating("generate (from scratch)"):
            scratch = r.model.generate(**kw)
        tokens = [int(t) for t in out.sequences[0, P + S:]]
        logits = getattr(out, "logits", None)
        g = planlib.against_recompute(r, ids, tokens, logits, tol)
        s_tokens = [int(t) for t in scratch.sequences[0, P + S:]]
        s_logits = getattr(scratch, "logits", None)
        s_diff, s_first = 0.0, next((k for k, (a, b) in enumerate(zip(tokens, s_tokens)) if a != b), None)
        if logits is not None and s_logits is not None:     # up to the first token where the two part
            s_diff = max(float((a[0].double() - b[0].double()).abs().max())
                         for a, b in list(zip(logits, s_logits))[:None if s_first is None else s_first + 1])
        s_tie = s_first is not None and s_logits is not None and planlib.near_tie(s_logits[s_first][0].double(), tol)
        g.update(scratch_tokens=s_tokens, scratch_match=s_tokens == tokens, scratch_max_abs_diff=s_diff,
                 scratch_tie_flip=s_tie, cache_keyword=cache_keyword(r.model))
        match = g["match"] and len(tokens) == n
        verdict = planlib.generation_verdict(g["max_abs_diff"], match, g["tie_flip"], tol)
        scratch = planlib.generation_verdict(s_diff, s_first is None and len(s_tokens) == n, s_tie, tol)
        verdict = max(verdict, scratch, key=order)
        first = None if g["first_mismatch_step"] is None else P + S + g["first_mismatch_step"]
        out_res = dict(generation=g, verdict=verdict, max_abs_diff=max(g["max_abs_diff"], s_diff or 0.0),
                       argmax_flips=0 if g["first_mismatch_step"] is None else 1, first_divergent_position=first)
        if verdict == "divergent" and logits is not None:
            out_res["refeed_probe"] = self._refeed_probe(ids, P, logits[0][0].double(), tol)
        return out_res

    def _refeed_probe(self, ids, P: int, got, tol: float) -> dict[str, Any]:
        """Whether generate()'s first logits from the prefix's cache equal a forward of the WHOLE
        prompt onto a fresh copy of that cache (the prefix fed twice), not of the suffix only:
        known.py's `generate_refeeds_cached_prefix` reads it (a cache whose length generate
        cannot read is treated as empty)."""
        r = self.r
        try:
            _, cache = r.prefill(ids[:, :P])
            twice, _ = r.step(ids, cache, past=P)
        except Exception as e:  # noqa: BLE001 - the probe is evidence only: a model that refuses it says so
            return {"agrees": False, "error": f"{type(e).__name__}: {one_line(e)}"}
        d = float((twice[-1] - got).abs().max())
        return {"agrees": d <= tol, "max_abs_diff": d}

    # -- a left-padded batch -----------------------------------------------------------
    def _swap_rows_after_prefill(self):
        """pad_rows_swapped: after generate's first forward, the fault layer's rows 0 and 1."""
        paths, torch, key = self, self.torch, cache_keyword(self.r.model)

        def hook(_m, _args, kwargs, out):
            if paths.hits:
                return
            cache = returned_cache(out, key)
            cache = kwargs.get(key) if cache is None else cache
            layers = cache_layers(cache) if cache is not None else []
            if paths.fault.layer < len(layers):
                layer = layers[paths.fault.layer]
                keys, values = layer.keys, layer.values
                perm = torch.tensor([1, 0] + list(range(2, keys.shape[0])))
                layer.keys = keys.index_select(0, perm)
                layer.values = layer.keys if values is keys else values.index_select(0, perm)
                paths.hits += 1
        return self.r.model.register_forward_hook(hook, with_kwargs=True)

    def _batch(self, it, gen, res) -> dict[str, Any]:
        torch, r, tol = self.torch, self.r, self.cal["tolerance"]
        lengths, n = it["lengths"], it["new"]
        rows = [r.tokens(gen, L) for L in lengths]
        width = max(lengths)
        ids = torch.full((len(rows), width), self.pad, dtype=rows[0].dtype)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, width - row.shape[1]:] = row[0]
            mask[i, width - row.shape[1]:] = 1
        res.update(suffix_len=n, lengths=lengths, pad_token_id=self.pad)
        hook = self._swap_rows_after_prefill() if self._planted(PAD_ROWS_SWAPPED.name) else None
        try:
            with self._generating("generate (left-padded batch)"):
                out = r.model.generate(**self._kw(ids, mask, n))
        finally:
            if hook is not None:
                hook.remove()
        logits = getattr(out, "logits", None)
        per_row = []
        for i, row in enumerate(rows):
            tokens = [int(t) for t in out.sequences[i, width:]]
            g = planlib.against_recompute(r, row, tokens, logits, tol, row=i)
            g["verdict"] = planlib.generation_verdict(g["max_abs_diff"], g["match"] and len(tokens) == n,
                                                      g["tie_flip"], tol)
            per_row.append(g)
        bad = [i for i, g in enumerate(per_row) if g["verdict"] == "divergent"]
        out_res = dict(rows=per_row, verdict=max((g["verdict"] for g in per_row), key=order),
                       max_abs_diff=max(g["max_abs_diff"] for g in per_row),
                       argmax_flips=sum(g["first_mismatch_step"] is not None for g in per_row),
                       divergent_rows=bad, generation=None)
        if bad and logits is not None and self.fault is None:
            out_res["without_cache"] = self._padded_without_cache(ids, mask, n, out, bad)
        return out_res

    def _padded_without_cache(self, ids, mask, n: int, cached, bad: list[int]) -> dict[str, Any]:
        """The same padded batch through generate(use_cache=False): when its divergent rows are
        the cached run's, the difference is the model's forward on left padding, not the reuse."""
        with self._generating("generate (left-padded batch, no cache)"):
            plain = self.r.model.generate(**self._kw(ids, mask, n), use_cache=False)
        same = all(bool((a == b).all()) for a, b in zip(plain.sequences[bad], cached.sequences[bad]))
        diff = max(float((a[bad].double() - b[bad].double()).abs().max()) for a, b in zip(plain.logits, cached.logits))
        padding = same and diff <= self.cal["tolerance"]
        return dict(max_abs_diff_to_cached=diff, same_tokens=same, explained_by="padding" if padding else None,
                    note=("the padded rows diverge as much without a cache: the model's forward on a left-padded "
                          "row, not the cache reuse" if padding else "the cache changes the padded rows' outputs"))


def order(verdict: str) -> int:
    """The worse of two verdicts is the later (scenarios.VERDICT_ORDER)."""
    return ("exact", "within-tolerance", "divergent", "error").index(verdict)
