"""Driving vLLM's KV cache manager the way its scheduler does, step by step.

``vllm/v1/core/sched/scheduler.py`` (``Scheduler.schedule``) builds a step in two loops: the
running requests in order, each given ``min(remaining, long_prefill_token_threshold, token
budget)`` new tokens by ``allocate_slots`` (with ``num_lookahead_tokens`` for speculative
decoding); when an allocation fails it preempts the lowest-priority running request (FCFS: the
last one, never already scheduled; PRIORITY: the max by (priority, arrival), which may be one
it already scheduled in this step) and retries; then, only if nothing was preempted, the
waiting requests (preempted ones first) get ``get_computed_blocks`` + ``allocate_slots`` while
seats and budget last, the first refused admission ending the loop. The step's forward then
runs, and requests that finished their prompt sample a token. `SchedGen` emits exactly those
adapter actions (``begin_step``, ``prefill``/``decode``/``preempt``/``lookup`` …, ``forward``),
so several requests are admitted per step, prompts are prefilled in chunks, and a preempted
request's re-admission takes a hit; between steps it submits, finishes, resets and evicts.
Every draw comes from the episode's seeded rng.
"""
from __future__ import annotations

from typing import Any

from . import mamba

POLICIES = ("fcfs", "priority")


class SchedGen:
    """A scheduler over the adapter, one action per call (the lockstep core takes them)."""

    def __init__(self, base: Any, policy: str = "fcfs") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; known: {', '.join(POLICIES)}")
        self.base, self.rng, self.policy = base, base.rng, policy
        self.bases = base.bases             # ChatGen (workloads.py) wraps this one too
        rng = self.rng
        scale = max(1, base.max_prompt // 44)
        self.budget_max = rng.choice([8, 16, 32, 1 << 20]) * scale     # max_num_batched_tokens
        self.long_prefill = rng.choice([0, 0, 4, 12]) * scale          # long_prefill_token_threshold
        self.max_seqs = rng.choice([2, 3, 4, 8])
        self.spec_tokens = rng.choice([0, 1, 2])                       # num_lookahead_tokens (EAGLE)
        self.running: list[str] = []       # the scheduler's running list (admission order)
        self.waiting: list[str] = []       # its waiting queue
        self.prio: dict[str, tuple[int, int]] = {}
        self.step: dict | None = None      # the step being built
        self.last: tuple | None = None     # (action, r, alloc_refused count before it)
        self.arrivals = 0
        self.burst: list[list[int]] = []   # siblings arriving together (n > 1 sampling, a shared system prompt)

    # ---- what the last action did ---------------------------------------------------
    def _sync(self, ad: Any) -> None:
        self.running = [r for r in self.running if r in ad.reqs and ad.reqs[r].state == "running"]
        self.waiting = [r for r in self.waiting if r in ad.reqs and ad.reqs[r].state != "running"]
        for r, req in ad.reqs.items():
            if r not in self.running and r not in self.waiting:
                (self.running if req.state == "running" else self.waiting).append(r)
            if r not in self.prio:
                self.prio[r] = (self.rng.randint(0, 3), self._arrive())

    def _arrive(self) -> int:
        self.arrivals += 1
        return self.arrivals

    def next(self, ad: Any) -> tuple[str, dict]:
        last, self.last = self.last, None
        if self.step is not None and last is not None:
            self._outcome(ad, self.step, last)
        self._sync(ad)
        if self.step is None:
            act = self._between(ad)
            if act is not None:
                return act
            self.step = {"phase": "running", "idx": 0, "budget": self.budget_max, "preempted": False}
            return "begin_step", {}
        st = self.step
        return (self._running(ad, st) if st["phase"] == "running" else None) or self._waiting(ad, st) \
            or self._end()

    def _outcome(self, ad: Any, st: dict, last: tuple) -> None:
        action, r, refused_before = last
        sched = ad.timeline.sched
        if action in ("prefill", "decode"):
            if r in sched:
                st["budget"] -= sched[r][1] - sched[r][0]
                st["idx"] += 1
            elif ad.coverage["state:alloc_refused"] > refused_before:
                st["victim_for"] = r            # preempt, then retry r
            else:
                st["idx"] += 1                  # not schedulable (rejected): skip it
        elif action == "preempt":
            st["preempted"] = True
            if r in self.running:
                if self.running.index(r) < st["idx"]:
                    st["idx"] -= 1
                self.running.remove(r)
            if r in self.waiting:
                self.waiting.remove(r)
            self.waiting.insert(0, r)
            if st.pop("retry", None) == r and self.policy == "fcfs":
                st["idx"] = len(self.running)   # it preempted itself: the running loop ends
        elif action == "lookup":
            if r in sched:
                st["budget"] -= sched[r][1] - sched[r][0]
                if r in self.waiting:
                    self.waiting.remove(r)
                self.running.append(r)
            else:
                st["phase"] = "done"            # the first refused admission ends the loop

    # ---- the running loop -------------------------------------------------------------
    def _running(self, ad: Any, st: dict) -> tuple[str, dict] | None:
        if "victim_for" in st:
            victim = self._victim(st["victim_for"])
            if victim is None:
                st.pop("victim_for")
                st["idx"] += 1
            else:
                st["retry"] = st.pop("victim_for")
                self.last = ("preempt", victim, ad.coverage["state:alloc_refused"])
                return "preempt", {"r": victim}
        while st["idx"] < len(self.running) and st["budget"] > 0:
            r = self.running[st["idx"]]
            o = ad.reqs[r].obj
            rem = o.num_tokens - o.num_computed_tokens
            if r in ad.timeline.sched or rem <= 0 or (rem == 1 and o.num_tokens >= ad.max_tokens):
                st["idx"] += 1
                continue
            n = min(rem, st["budget"], self.long_prefill or rem)
            la = self._la(ad)
            mp = self._mp(ad)
            if mp and rem > 1:
                n = mamba.split(ad, o, 0, n, mp)  # the Mamba chunk split; none fits: skip it
                if n == 0:
                    st["idx"] += 1
                    continue
            self.last = ("decode" if rem == 1 else "prefill", r, ad.coverage["state:alloc_refused"])
            if rem == 1:
                return "decode", {"r": r, "tok": self.rng.randrange(self.base.vocab), **({"la": la} if la else {})}
            return "prefill", {"r": r, "chunk": n, **({"la": la} if la else {}), **({"mp": mp} if mp else {})}
        st["phase"] = "done" if st["preempted"] else "waiting"
        return None

    def _victim(self, r: str) -> str | None:
        """FCFS: the last running request; PRIORITY: the max by (priority, arrival)."""
        if not self.running:
            return None
        if self.policy == "priority":
            return max(self.running, key=lambda x: self.prio.get(x, (0, 0)))
        return self.running[-1]

    # ---- the waiting loop -------------------------------------------------------------
    def _waiting(self, ad: Any, st: dict) -> tuple[str, dict] | None:
        if st["phase"] != "waiting":
            return None
        queue = sorted(self.waiting, key=lambda x: self.prio[x]) if self.policy == "priority" else self.waiting
        for r in queue:
            if len(self.running) >= self.max_seqs or st["budget"] <= 0:
                break
            if r in ad.timeline.sched:
                continue
            la, mp = self._la(ad), self._mp(ad)
            self.last = ("lookup", r, ad.coverage["state:alloc_refused"])
            return "lookup", {"r": r, "chunk": min(st["budget"], self.long_prefill or st["budget"]),
                              **({"la": la} if la else {}), **({"mp": mp} if mp else {})}
        st["phase"] = "done"
        return None

    def _la(self, ad: Any) -> int:
        """num_lookahead_tokens: the drafter's speculative tokens (a Mamba layout's are fixed:
        its MambaSpec reserves as many speculative state blocks)."""
        if not ad.eagle_groups:
            return 0
        return mamba.SPEC_TOKENS if ad.has_mamba else self.spec_tokens

    def _mp(self, ad: Any) -> int:
        """The most tokens the scheduler gives one prefill chunk (what the Mamba split aligns
        against: min(max_num_batched_tokens, long_prefill_token_threshold)); 0 without Mamba."""
        return min(self.budget_max, self.long_prefill or self.budget_max) if ad.has_mamba else 0

    def _end(self) -> tuple[str, dict]:
        self.step = None
        return "forward", {}

    # ---- between steps ----------------------------------------------------------------
    def _between(self, ad: Any) -> tuple[str, dict] | None:
        rng, base = self.rng, self.base
        done = [r for r in self.running if ad.reqs[r].obj.num_tokens >= ad.max_tokens]
        if done:                                      # max_tokens reached: the request finishes
            return "finish", {"r": done[0]}
        if self.burst and len(ad.reqs) < 6:
            return "submit", {"r": f"r{ad.next_id}", "tokens": self.burst.pop()[: self.base.max_prompt], "salt": None}
        cands = {"step": 4.0}
        if len(ad.reqs) < 6:
            cands["submit"] = 3.0 if not ad.reqs else 1.0
        out = [r for r in self.running if ad.reqs[r].obj.num_tokens > ad.reqs[r].obj.num_prompt_tokens]
        if out:
            cands["finish"] = 0.6                     # a stop token
        cands["reset_prefix_cache"], cands["evict_blocks"] = 0.03, 0.05
        a = base.choose(cands)
        if a == "step":
            return None
        if a == "submit":
            toks = base.prompt(base.max_prompt)
            if ad.reqs and rng.random() < 0.4:       # a sibling of a queued or running prompt
                sib = list(ad.reqs[rng.choice(list(ad.reqs))].obj.all_token_ids)
                cut = rng.randint(1, len(sib))
                toks = (sib[:cut] + toks[: max(1, base.max_prompt - cut)])[: base.max_prompt]
            elif rng.random() < 0.3:                 # a burst of siblings sharing this prompt's prefix
                self.burst = [toks[: rng.randint(1, len(toks))] + [rng.randrange(base.vocab)
                                                                   for _ in range(rng.randint(1, 6))]
                              for _ in range(rng.randint(1, 2))]
                return a, {"r": f"r{ad.next_id}", "tokens": toks, "salt": None}
            return a, {"r": f"r{ad.next_id}", "tokens": toks, "salt": rng.choice([None, None, None, "s1"])}
        if a == "finish":
            return a, {"r": rng.choice(out)}
        if a == "evict_blocks":
            return a, {"block_ids": [rng.randrange(1, ad.num_blocks) for _ in range(rng.randint(1, 3))]}
        return a, {}
