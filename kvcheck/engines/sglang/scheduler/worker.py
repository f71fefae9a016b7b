"""kvcheck's model worker for SGLang's scheduler: the forward, and what it reads and writes.

SGLang's scheduler hands each batch to `model_worker.forward_batch_generation(batch)` and gets
back the sampled token of every request (`GenerationBatchResult.next_token_ids`). This worker
answers from the step's seeded tokens, and does to a shadow of the KV pool what the GPU forward
does to the pool, from the batch's own fields (as SGLang's `ForwardBatch` is built from them):

* writes: the slots `out_cache_loc` names, in batch order: an extend request's positions
  `[prefix_len, prefix_len + extend_len)`, a decode request's position `seq_len - 1`; each slot
  then holds the fingerprint of the request's tokens up to and including that position;
* reads: every request's attention reads its row of `req_to_token` for positions `[0, seq_len)`
  (full attention); on a FULL+SWA model its sliding-window layers read positions
  `[seq_len - W, seq_len)` through the allocator's full -> SWA slot mapping; on an all-SWA model
  (no full layer) only that window, through its identity mapping; each slot read must hold the
  fingerprint of exactly that request's prefix.

Checks (a Violation on the first broken one, kept for the adapter's `extra_checks`):
* `hit_sound_full` / `hit_sound_swa_window`: a position below `prefix_len` (the prefix-cache hit
  the tree matched) reads a full (an SWA) slot that does not hold that prefix's KV: the hit was
  not usable;
* `kv_read_sound`: any other read of a slot that does not hold the request's own KV (its earlier
  chunk, its decode tokens): a slot freed and reused, or a row rewritten wrongly;
* `no_write_into_cached`: the forward writes a slot the radix tree holds for a cached prefix.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from ..violation import Violation

EOS = 1          # the stop token every request carries (stop_token_ids)


def kv_field(req: Any, name: str) -> int:
    """A length SGLang keeps on the request's `kv` record (0.5.19+) or on the request itself."""
    kv = getattr(req, "kv", None) or req
    return int(getattr(kv, name, getattr(req, name, 0)) or 0)


def fingerprints(tokens: list[int]) -> list[int]:
    """fp[p]: the identity of the prefix tokens[:p+1] (a chained hash: equal iff equal prefixes,
    up to collisions that a 64-bit chain makes negligible at these lengths)."""
    out, h = [], 1469598103934665603
    for t in tokens:
        h = hash((h, int(t)))
        out.append(h)
    return out


class _Forward:
    """What a forward reads: the batch the model worker is handed (a ScheduleBatch, or on 0.5.7-
    0.5.13 the `ModelWorkerBatch` `run_batch` derives from it), with the requests, prefix and
    extend lengths of the ScheduleBatch it came from where the worker batch carries none."""

    def __init__(self, batch: Any, launched: Any) -> None:
        self.batch = batch
        src = batch if hasattr(batch, "reqs") else launched
        if src is None or len(src.reqs) != len(batch.seq_lens):
            raise RuntimeError("kvcheck's worker: a forward of a batch the event loop did not launch")
        self.reqs = src.reqs
        self.prefix_lens = getattr(src, "prefix_lens", None) or getattr(batch, "extend_prefix_lens", None)
        self.extend_lens = getattr(src, "extend_lens", None) or getattr(batch, "extend_seq_lens", None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.batch, name)


class ModelWorker:
    """Answers the scheduler's forwards and checks them; `tokens` are this step's samples."""

    def __init__(self) -> None:
        self.written: dict[int, int] = {}
        self.written_swa: dict[int, int] = {}      # SWA slot -> fingerprint (FULL+SWA models)
        self.window: int | None = None
        self.all_swa = False                # no full-attention layer: the window is all a forward reads
        self.tree: Any = None
        self.tokens: list[int] = []
        self.broken: Violation | None = None
        self.coverage: Counter = Counter()
        self.cache: Any = None
        self.rows: Any = None
        self.forwards = 0
        # rid -> (the output index its last sample takes, the token): with SGLang's overlap scheduler
        # a forward runs before the previous one's result is processed, so a request's newest
        # token is known here before it is in `output_ids`
        self.pending: dict[str, tuple[int, int]] = {}
        self.pre_forward: Any = None        # the adapter's tree checks, run as the forward starts
        self.launched: Any = None           # the ScheduleBatch the event loop launched last
        self.disabled = False               # the radix cache disabled: a request's prefix is its own work only
        self.computed: dict[str, int] = {}  # rid -> positions its own extends wrote (a disabled cache's hits)

    def bind(self, cache: Any, rows: Any, tree: Any, window: int | None = None, all_swa: bool = False) -> None:
        self.cache, self.rows, self.tree, self.window, self.all_swa = cache, rows, tree, window, all_swa
        alloc = cache.token_to_kv_pool_allocator
        self.swa_map = getattr(alloc, "full_to_swa_index_mapping", None) if window else None

    # ---- the forward ---------------------------------------------------------------------
    def forward_batch_generation(self, batch: Any, **_: Any) -> Any:
        import torch
        from sglang.srt.managers.utils import GenerationBatchResult
        self.forwards += 1
        batch = _Forward(batch, self.launched)
        samples = [self.tokens[i % len(self.tokens)] if self.tokens else 2 for i in range(len(batch.reqs))]
        if self.broken is None and self.pre_forward is not None:
            self.broken = self.pre_forward(batch)
        if self.broken is None:
            self._run(batch, samples)
        # as the model runner returns it: the logits processor's output (0.5.7's overlap path reads
        # its hidden states), logits not computed (no request asks for logprobs)
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        return GenerationBatchResult(logits_output=LogitsProcessorOutput(next_token_logits=None),
                                     next_token_ids=torch.tensor(samples, dtype=torch.int64))

    def _known(self, req: Any, n: int) -> list[int]:
        """The request's tokens: its prompt, its processed outputs, and — when the forward's
        sequence of `n` tokens needs one more (overlap: SGLang has not processed the last result
        yet) — the sample of its last forward. A sample SGLang discarded (the request was retracted
        before that result was processed) is never needed again: SGLang's sequence does not count it."""
        out = list(req.output_ids)
        known = list(req.origin_input_ids) + out
        pend = self.pending.get(req.rid)
        if len(known) < n and pend is not None and pend[0] == len(out):
            known.append(pend[1])
        return known

    def _run(self, batch: Any, samples: list[int]) -> None:
        extend = batch.forward_mode.is_extend()
        seq_lens = [int(x) for x in batch.seq_lens.tolist()]
        rows = [int(x) for x in batch.req_pool_indices.tolist()]
        out = [int(x) for x in batch.out_cache_loc.tolist()]
        cached, cached_swa = self._tree_slots()
        m = self.swa_map.tolist() if self.swa_map is not None else None
        at = 0
        plan: list[tuple[Any, int, int, int, list[int]]] = []     # req, row, seq_len, first written, fps
        for i, req in enumerate(batch.reqs):
            n = seq_lens[i]
            full = self._known(req, n)
            if len(full) < n:
                raise RuntimeError(f"kvcheck's worker: request {req.rid} has {len(full)} tokens for a sequence "
                                   f"of {n}")
            fps = fingerprints(full[:n])
            if extend:
                pre, ext = int(batch.prefix_lens[i]), int(batch.extend_lens[i])
                self.coverage["forward:extend"] += 1
                if pre:
                    self.coverage["forward:extend_after_hit"] += 1
                if self.disabled and pre > self.computed.get(req.rid, 0) and self.broken is None:
                    self.broken = Violation(
                        "safety", "disabled_cache_no_hit",
                        f"{req.rid} resumes after {pre} prefix positions with the radix cache disabled, but only "
                        f"{self.computed.get(req.rid, 0)} are its own chunks: the cache answered with KV it keeps for nobody")
                self.computed[req.rid] = pre + ext
            else:
                pre, ext = n - 1, 1
                self.coverage["forward:decode"] += 1
                if n < len(full) and self.broken is None:     # a decode consumes the request's last token
                    self.broken = Violation(
                        "safety", "context_complete",
                        f"{req.rid} decodes over {n} positions but its sequence has {len(full)} tokens: tokens "
                        f"{n - 1}..{len(full) - 2} never got KV (the forward attends to a truncated context)")
            for k, p in enumerate(range(pre, pre + ext)):
                slot = out[at + k]
                swa = m[slot] if m is not None else 0
                if (slot in cached or (swa and swa in cached_swa)) and self.broken is None:
                    self.broken = Violation(
                        "safety", "no_write_into_cached",
                        f"the forward of {req.rid} writes position {p} into slot {slot}"
                        + (f" (SWA slot {swa})" if swa else "") + ", which the radix tree holds for a cached prefix")
                self.written[slot] = fps[p]
                if swa:
                    self.written_swa[swa] = fps[p]
            at += ext
            plan.append((req, rows[i], n, pre, fps))
            if not extend or pre + ext >= len(full):      # a middle chunk's sample is dropped
                self.pending[req.rid] = (len(full) - len(req.origin_input_ids), samples[i])
        if self.broken is not None:
            return
        for req, row, n, pre, fps in plan:          # attention reads after the batch's writes
            slots = [int(x) for x in self.rows.req_to_token[row, :n].tolist()]
            for p, slot in enumerate(slots if not self.all_swa else ()):    # (no full layer: the window only)
                if self.written.get(slot) != fps[p]:
                    self._read_fails(req, p, n, pre, extend, f"slot {slot}", slot in self.written, "full")
                    return
            if m is None:
                continue
            for p in self._window(req, n, extend):      # SWA layers: the window behind the token
                swa = m[slots[p]]
                if not swa or self.written_swa.get(swa) != fps[p]:
                    self._read_fails(req, p, n, pre, extend, f"SWA slot {swa} (full slot {slots[p]})",
                                     bool(swa) and swa in self.written_swa, "swa_window")
                    return

    def _window(self, req: Any, n: int, extend: bool) -> list[int]:
        """The positions an SWA layer reads for a sequence of `n`: the window behind its last token;
        on an all-SWA model served prefill-aware, a decode also reads the whole prefill it keeps
        (SGLang's `_build_pa_page_table`: `swa_evict_floor` on the request or its `kv` record)."""
        lo = max(0, n - self.window)
        if not self.all_swa or extend:
            return list(range(lo, n))
        return list(range(min(kv_field(req, "swa_evict_floor"), lo))) + list(range(lo, n))

    def _read_fails(self, req: Any, p: int, n: int, pre: int, extend: bool, where: str, known: bool,
                    part: str) -> None:
        check = f"hit_sound_{part}" if extend and p < pre else "kv_read_sound"
        why = "never written or freed" if not known else "holds another prefix's KV"
        self.broken = Violation(
            "safety", check, f"{req.rid} reads position {p} of {n} from {where}, which {why}"
            + (f" (the prefix-cache hit covers [0, {pre}))" if check.startswith("hit_sound") else ""))

    def _tree_slots(self) -> tuple[set[int], set[int]]:
        full: set[int] = set()
        swa: set[int] = set()
        for v in self.tree.views():
            full.update(v.full or ())
            swa.update(v.swa or ())
        return full, swa
