"""The assisted-decoding path as scenarios: draft, roll back, continue (docs/adapters-transformers.md,
"Assisted decoding: draft, roll back, continue").

Three kinds, each compared with the Runner's full recompute (``full()``) under the run's tolerance:

- ``assist_burst``: prefill P tokens; turn on the release's past recording; verify k draft tokens
  in one forward; roll the cache back to the a < k accepted (``crop``); continue with the real
  continuation token by token, rolling back 0 after each forward as assisted decoding does.
  Compared: the accepted drafts' and the continuation's logits with the full recompute of
  prefix + accepted drafts + continuation.
- ``crop_continue``: prefill, extend by m tokens in several forwards with no crop in between,
  roll back r of them, continue with different tokens (chunks).
- ``generate_assistant``: greedy ``model.generate(ids, assistant_model=A)`` with A a second tiny
  model of the same config and other random weights (its drafts are mostly rejected), compared
  token by token (and logit by logit) with greedy generation by full recomputes.

How to roll back is the installed release's (interface.py: the crop convention read from
``crop``'s signature, ``activate_past_recording`` where the release has it). A model whose cache
the release documents as not croppable (``is_croppable`` False, or the model class's
``_is_stateful``), has no ``crop``, whose ``crop``
refuses before changing any state, or whose ``generate`` refuses assisted decoding before any
forward ran, gives the scenario verdict ``unsupported`` with the reason: not an error, not a
divergence, and the run's verdict ignores it.
"""
from __future__ import annotations

import contextlib
import copy
import random
from typing import Any

from .cache import CROP_KEEPS_STALE, compare_caches
from .interface import (classify, crop_argument, crop_convention, crop_to, not_croppable, past_recording,
                        release, seq_length)
from .models import WINDOW_FIELDS, one_line
from .plan import Unsupported, against_recompute, compare_logits, generation_verdict, guarded, layer_diffs, quiet

MODES = ("assist_burst", "crop_continue", "generate_assistant")
PER_KIND = 2            # at most this many of each kind (one of each from 10 scenarios, two from 20)
GEN_NEW = 5             # tokens generate() makes with the assistant
ASSISTANT_SEED = 1      # the assistant's weights: torch seed run seed + this




def rolls(name: str) -> bool:
    """A boundary of a layer whose cache a roll-back must restore more than a suffix of: a window,
    an attention chunk, a conv / linear-attention / recurrent state."""
    return (name in WINDOW_FIELDS or name.startswith("window[") or name in (
        "attention_chunk_size", "linear_chunk", "chunk_size", "mamba_chunk_size", "block_size") or "conv" in name)


def count(n: int) -> int:
    """How many of the ``n`` scenarios of a run are assisted-decoding ones."""
    return len(MODES) * min(PER_KIND, n // 10)


def plan(bounds: dict[str, int], n: int, seed: int, fault=None) -> list[dict[str, Any]]:
    """The assisted-decoding scenarios of a run of ``n`` (none for a model without a rolling
    boundary; one of each kind at least when the planted fault corrupts a crop); drawn from their
    own seeded stream, so the other scenarios stay as they were."""
    named = sorted(((b, k) for k, b in bounds.items() if rolls(k) and b > 1))
    total = max(count(n), len(MODES) if fault is not None and fault.name == CROP_KEEPS_STALE.name else 0)
    if not named or total == 0:
        return []
    b, name = named[0]
    rng = random.Random(f"kvcheck-assist:{seed}")
    out = []
    for j in range(total // len(MODES)):
        k = rng.randrange(2, 5)
        if j % 2 == 0:      # the crop crosses the window: P + a < b <= P + k
            P = max(1, b - rng.randrange(1, k + 1))
        else:               # well past the window
            P = b + rng.randrange(1, b + 1)
        a = 0 if j == 0 else rng.randrange(1, k)
        S = rng.randrange(2, min(b, 8) + 2)
        out.append(dict(mode="assist_burst", P=P, ext=[k], keep=a, cont=[1] * S, roll_each=True, b=(name, b)))
        P = max(1, rng.choice([b - 1, b, b + 1, 2 * b - 1]))
        m = rng.randrange(2, 5)
        r = rng.randrange(1, m + 1)
        ext = [1] * m if j % 2 == 0 else [1, m - 1]
        S = rng.randrange(2, min(b, 8) + 2)
        cut = rng.randrange(1, S)
        out.append(dict(mode="crop_continue", P=P, ext=ext, keep=m - r, cont=[cut, S - cut], roll_each=False,
                        b=(name, b)))
        P = max(1, rng.choice([b - 1, b, b + 1, 2 * b + 1]))
        out.append(dict(mode="generate_assistant", P=P, drafts=rng.randrange(2, 4), new=GEN_NEW, b=(name, b)))
    return out


def run_all(runner, items: list[dict[str, Any]], first: int, gen, cal, fault) -> list[dict[str, Any]]:
    a = Assist(runner, cal, fault)
    try:
        return [a.scenario(first + i, it, gen) for i, it in enumerate(items)]
    finally:
        a.close()


class Assist:
    def __init__(self, runner, cal, fault):
        self.r, self.cal, self.torch = runner, cal, runner.torch
        self.fault = fault if fault is not None and fault.name == CROP_KEEPS_STALE.name else None
        self.assistant = None
        self.fault_hits = 0
        self.refused = None

    def close(self):
        self.assistant = None

    # -- one scenario ----------------------------------------------------------------------
    def scenario(self, idx: int, it: dict[str, Any], gen) -> dict[str, Any]:
        name, b = it["b"]
        mode, P = it["mode"], it["P"]
        res: dict[str, Any] = dict(index=idx, prefix_len=P, prefix_boundary=f"{name}{P - b:+d}",
                                   suffix_mode=mode, chunks=None, max_abs_diff=None,
                                   first_divergent_position=None, argmax_flips=None, first_divergent_layer=None,
                                   generation=None)
        if mode == "generate_assistant":
            ids = self.r.tokens(gen, P)
            res.update(suffix_len=it["new"], assistant_drafts=it["drafts"])
            body = lambda: self._generate(ids, it)  # noqa: E731
        else:
            n_ext, S = sum(it["ext"]), sum(it["cont"])
            ids = self.r.tokens(gen, P + n_ext + S)
            res.update(suffix_len=S, extended=n_ext, kept=it["keep"], rolled_back=n_ext - it["keep"],
                       ext_steps=it["ext"], steps=it["cont"])
            body = lambda: self._roll(ids, it)  # noqa: E731
        self.fault_hits = 0
        guarded(body, res, self.r.crash, f"scenario {idx} (prefix {P}, {mode})")
        if self.fault is not None:
            res["fault"] = dict(name=self.fault.name, layer=self.fault.layer, applied=self.fault_hits > 0,
                                crops_changed=self.fault_hits)
            res["fault_layer"] = self.fault.layer
        return res

    def _check(self, cache) -> str:
        """The crop convention of this cache, or Unsupported with the release's reason."""
        why = not_croppable(cache, self.r.model)
        if why:
            raise Unsupported(why)
        conv = crop_convention(cache)
        if conv is None:
            raise Unsupported(f"{type(cache).__name__} has no crop on transformers {release()}")
        return conv

    def _crop(self, cache, length: int, keep: int, path: str = "crop") -> None:
        """The release's crop; a refusal that left the cache as it was is Unsupported."""
        before = copy.deepcopy(cache)
        self.r.path, self.r.in_model = path, False
        try:
            if self.fault is not None:
                if self.fault.on_crop(cache, lambda: crop_to(cache, length, keep)):
                    self.fault_hits += 1
            else:
                crop_to(cache, length, keep)
        except Exception as exc:  # noqa: BLE001 - the release's refusal, or its crash
            if classify(exc) is None and not any(r["max_abs_diff"] != 0 or r["shape_mismatch"]
                                                 for r in compare_caches(cache, before)):
                conv = crop_convention(cache)
                raise Unsupported(f"{type(cache).__name__}.crop({crop_argument(conv, length, keep)}) "
                                  f"({conv} convention, {length} -> {keep} tokens) refused on transformers "
                                  f"{release()} before changing any state: {type(exc).__name__}: {one_line(exc)}"
                                  ) from exc
            self.r.in_model = True      # a crash inside the release's crop: the scenario's error
            self.r.mods.stack.clear()
            raise

    def _roll(self, ids, it) -> dict[str, Any]:
        """assist_burst / crop_continue: prefill, extend (drafts), roll back, continue."""
        torch, r, tol = self.torch, self.r, self.cal["tolerance"]
        P, keep, ext, cont = it["P"], it["keep"], it["ext"], it["cont"]
        n_ext = sum(ext)
        real = torch.cat([ids[:, :P + keep], ids[:, P + n_ext:]], dim=1)     # prefix + kept + continuation
        full_logits, full_hs = r.full(real, record=True)
        _, cache = r.prefill(ids[:, :P])
        conv = self._check(cache)
        rec = past_recording(cache)
        if rec is not None:
            rec()
        ext_logits, start = [], P
        for n in ext:
            lg, cache = r.step(ids[:, start:start + n], cache, path="verify" if it["mode"] == "assist_burst" else "extend")
            ext_logits.append(lg)
            start += n
        self._crop(cache, P + n_ext, P + keep, path="roll back")
        after_crop = seq_length(cache)
        pieces, start, pos = [], P + n_ext, P + keep
        r.rec.start()
        for n in cont:
            lg, cache = r.step(ids[:, start:start + n], cache)
            pieces.append(lg)
            start += n
            pos += n
            if it["roll_each"] and rec is not None:     # assisted decoding crops after every forward
                self._crop(cache, pos, pos, path="roll back 0")
        reuse_hs = r.rec.stop()
        got = torch.cat([torch.cat(ext_logits, dim=0)[:keep]] + pieces, dim=0)
        cmp = compare_logits(got, full_logits[P:], tol)
        max_abs, flips, verdict = cmp["max_abs_diff"], cmp["argmax_flips"], cmp["verdict"]
        layer_diff, first_layer = layer_diffs(reuse_hs, full_hs, P + keep, self.cal["layer_tolerance"])
        first_pos = None if cmp["first_bad"] is None else P + cmp["first_bad"]
        res = dict(max_abs_diff=max_abs, first_divergent_position=first_pos,
                   argmax_flips=flips, verdict=verdict, crop_convention=conv, past_recording=rec is not None,
                   length_after_crop=after_crop, layer_max_abs_diff=layer_diff,
                   first_divergent_layer=first_layer if verdict == "divergent" else None)
        if verdict == "divergent":
            if rec is not None:
                self._crop(cache, pos, pos, path="roll back 0")     # the recorded past trimmed before comparing
            _, oneshot = r.prefill(real)
            res["cache_diff"] = r._explain([], compare_caches(cache, oneshot), self.cal)
        return res

    # -- generate() with an assistant model ------------------------------------------------
    def _assistant(self):
        if self.assistant is None:
            torch, m = self.torch, self.r.model
            from transformers import AutoModelForCausalLM

            from .build import keep_fp32
            dtype = next(m.parameters()).dtype
            with torch.random.fork_rng():
                torch.manual_seed(self.r.seed + ASSISTANT_SEED)
                a = AutoModelForCausalLM.from_config(m.config, attn_implementation=m.config._attn_implementation)
            self.assistant = keep_fp32(a.to(dtype), dtype).eval()
        return self.assistant

    @contextlib.contextmanager
    def _watched_crop(self, cls):
        """While generate() runs: ``cls.crop`` (the class of the model's own cache) through the
        planted crop_keeps_stale if any, and a crop that the release refuses before changing the
        cache it was called on is noted (``self.refused``: the exception and why)."""
        if not callable(getattr(cls, "crop", None)):
            yield
            return
        had, orig = "crop" in vars(cls), cls.crop
        assist = self

        def crop(cache, *a, **kw):
            before = copy.deepcopy(cache)
            try:
                if assist.fault is not None:
                    if assist.fault.on_crop(cache, lambda: orig(cache, *a, **kw)):
                        assist.fault_hits += 1
                else:
                    orig(cache, *a, **kw)
            except Exception as exc:  # noqa: BLE001 - noted, then raised on as it was
                if classify(exc) is None and not any(r["max_abs_diff"] != 0 or r["shape_mismatch"]
                                                     for r in compare_caches(cache, before)):
                    assist.refused = (exc, f"{type(cache).__name__}.crop{tuple(a)} refused before changing any "
                                           f"state: {type(exc).__name__}: {one_line(exc)}")
                raise
        cls.crop = crop
        try:
            yield
        finally:
            if had:
                cls.crop = orig
            else:
                del cls.crop

    def _generate(self, ids, it) -> dict[str, Any]:
        torch, r, tol = self.torch, self.r, self.cal["tolerance"]
        P, n_new = it["P"], it["new"]
        _, probe = r.prefill(ids)
        conv = self._check(probe)
        A = self._assistant()
        gc = A.generation_config
        for key, val in (("num_assistant_tokens", it["drafts"]), ("num_assistant_tokens_schedule", "constant")):
            if hasattr(gc, key):
                setattr(gc, key, val)
        calls = [0]
        hooks = [m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in (r.model, A)]
        r.path, r.in_model = "generate_assistant", True
        r.mods.stack.clear()
        self.refused = None
        try:
            with torch.no_grad(), self._watched_crop(type(probe)), quiet():
                out = r.model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=A,
                                       max_new_tokens=n_new, do_sample=False, return_dict_in_generate=True,
                                       output_logits=True, eos_token_id=None, pad_token_id=0)
        except Exception as exc:  # noqa: BLE001
            if calls[0] == 0 and classify(exc) is None:
                raise Unsupported(f"generate() refused assisted decoding before any forward on transformers "
                                  f"{release()}: {type(exc).__name__}: {one_line(exc)}") from exc
            if self.refused is not None and self.refused[0] is exc:
                raise Unsupported(f"generate() with an assistant rolled its cache back after {calls[0]} forwards and "
                                  f"transformers {release()} refused: {self.refused[1]}") from exc
            raise
        finally:
            for h in hooks:
                h.remove()
        r.in_model = False
        seqs = out.sequences if hasattr(out, "sequences") else out
        tokens = [int(t) for t in seqs[0, P:]]
        gen_res = against_recompute(r, ids, tokens, getattr(out, "logits", None), tol)
        compared = gen_res.pop("logits_compared")      # the keys in the order the JSON has always had
        gen_res.update(match=gen_res["match"] and len(tokens) == n_new, forwards=calls[0], logits_compared=compared)
        max_abs, mismatch = gen_res["max_abs_diff"], gen_res["first_mismatch_step"]
        verdict = generation_verdict(max_abs, gen_res["match"], gen_res["tie_flip"], tol)
        return dict(max_abs_diff=max_abs, argmax_flips=0 if mismatch is None else 1, generation=gen_res,
                    verdict=verdict, crop_convention=conv, first_divergent_position=None if mismatch is None
                    else P + mismatch)
