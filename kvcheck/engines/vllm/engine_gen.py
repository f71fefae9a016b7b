"""The scheduler drive's workload and configuration: the seeded arrivals kvcheck submits (the
scheduler decides the rest) and the knobs each episode's Scheduler is built with (swarm testing),
kept in a trace's meta and read back for its replay."""
from __future__ import annotations

import dataclasses
import random
from typing import Any

from .connector import supported, sync_failures_on
from .engine_async import async_on
from .sched_build import SchedKnobs, async_by_default


class EngineGen:
    """Seeded workload for the scheduler drive: arrivals (fresh prompts with shared prefixes,
    identical resends, multi-turn continuations of finished requests), steps, rare aborts,
    prefix-cache resets and connector evictions. The scheduler decides everything else."""

    def __init__(self, base: Any) -> None:
        self.base, self.rng = base, base.rng
        self.bases = getattr(base, "bases", None)
        # priorities (PRIORITY policy): random, or later arrivals more urgent (each preempts the ones
        # admitted before it, which the running loop may already have scheduled in the step)
        self.prio_mode = self.rng.choice(["random", "urgent_later"])

    def next(self, ad: Any) -> tuple[str, dict]:
        rng = self.rng
        live = len(ad.reqs)
        x = rng.random()
        if live < ad.knobs.max_num_seqs + 2 and x < (0.6 if live == 0 else 0.25):
            return "submit", self._arrival(ad)
        # (a finished request whose blocks a KV store still holds is not abortable: the action is refused)
        alive = [r for r, q in ad.reqs.items() if q.state != "finished"]
        if alive and x < 0.28:
            return "abort", {"r": rng.choice(alive)}
        if x < 0.285:
            # (not preempting while a connector transfer holds blocks: vLLM raises "Failed to reset
            # KV cache ... requests waiting for remote KV transfer, which is not supported yet")
            loading = ad.store is not None and ad.store.busy()
            return "reset_prefix_cache", {"running": rng.random() < 0.5 and not loading}
        if x < 0.295:
            return "evict_blocks", {"block_ids": [rng.randrange(1, ad.num_blocks) for _ in range(rng.randint(1, 3))]}
        return "step", {}

    def _arrival(self, ad: Any) -> dict:
        rng, cap = self.rng, ad.max_tokens - 1
        y = rng.random()
        if ad.done and y < 0.3:         # the next turn of a finished chat: its whole text + a new message
            prev = rng.choice(ad.done)
            toks = prev + self.base.prompt(max(2, cap - len(prev)))[: rng.randint(1, 8)]
        elif ad.done and y < 0.4:       # an identical resend
            toks = list(rng.choice(ad.done))
        else:
            toks = self.base.prompt(self.base.max_prompt)
        toks = toks[:cap] or [1]
        return {"r": f"r{ad.next_id}", "tokens": toks, "salt": rng.choice([None, None, None, "s1"]),
                "prio": rng.randint(0, 3) if self.prio_mode == "random" else -ad.next_id,
                "max_tokens": rng.choice([1, 2, 4, 8, 16])}


def draw_knobs(rng: Any, layout: str, policy: str | None = None) -> SchedKnobs:
    """An episode's scheduler configuration (swarm testing: each episode its own)."""
    from .layouts import LAYOUT_DATA, layout_scale
    groups = LAYOUT_DATA[layout][1]
    max_len = layout_scale(layout)[1]
    scale = max(1, max_len // 64)
    per_req = max(4, max_len // min(bs for _, bs, _ in groups))
    mamba_block = max((bs for k, bs, _ in groups if k == "mamba"), default=0)
    knobs = SchedKnobs(policy=policy or rng.choice(["fcfs", "priority"]),
                      # (not below the Mamba block: VllmConfig asserts it in align mode, 0.16-0.17;
                      # the release matrix met it on 0.17.1's real-size Qwen3-Next / Nemotron-H)
                      max_num_batched_tokens=max(rng.choice([8, 16, 32, 1 << 12]) * scale, mamba_block),
                      max_num_seqs=rng.choice([1, 2, 3, 4, 8]),
                      # (0, or not below a block: VllmConfig asserts it in Mamba align mode, 0.16-0.17)
                      long_prefill_token_threshold=_floor(rng.choice([0, 0, 4, 12]) * scale,
                                                          max(bs for _, bs, _ in groups)),
                      num_blocks=1 + rng.choice([1, 2, 3, 5]) * per_req * len(groups) // 2 + per_req,
                      spec_tokens=_spec_tokens(layout, rng.choice([1, 2])), eagle_drop=rng.random() < 0.5,
                      connector=supported(groups) is None and rng.random() < 0.5,
                      sync_fail=sync_failures_on())
    # async scheduling (vLLM's default; off with engine_async.ASYNC_ENV=0): half the episodes, a drafter's
    # too (EAGLE / MTP keep it on: VllmConfig), not a drafter's with Mamba groups (the worker's async
    # correction of their draft states: not modelled), the connector's too unless its sync loads fail
    # (opt-in; their async timing: not modelled). Drawn from a stream of its own (a stable function of
    # the episode's state), so the episode's own draws are unchanged; only where the release's own
    # VllmConfig turns it on by default (sched_build.async_by_default: 0.16.0 not with Mamba groups).
    from .layouts import EAGLE, LAYOUT_DATA
    from .mamba import MAMBA
    mamba_drafts = EAGLE.get(layout) is not None and any(k == MAMBA for k, _, _ in LAYOUT_DATA[layout][1])
    if async_on() and not mamba_drafts and not (knobs.connector and knobs.sync_fail) \
            and random.Random(_state_key(rng)).random() < 0.5 and async_by_default(layout, knobs):
        knobs = dataclasses.replace(knobs, async_sched=True)
    return knobs


def _state_key(rng: random.Random) -> str:
    """A stable function of the generator's state (its 625 words as text: Random seeds a str by its
    SHA-512). Not hash(): Python 3.11 hashes the state's None by address, different every process."""
    return ",".join(map(str, rng.getstate()[1]))


def _spec_tokens(layout: str, drawn: int) -> int:
    """Draft tokens per step: a Mamba layout's are its MambaSpec's speculative state blocks (vLLM
    sizes them to num_speculative_tokens: mamba.SPEC_TOKENS)."""
    from .layouts import LAYOUT_DATA
    from .mamba import MAMBA, SPEC_TOKENS
    return SPEC_TOKENS if any(k == MAMBA for k, _, _ in LAYOUT_DATA[layout][1]) else drawn


def _floor(threshold: int, block: int) -> int:
    """A long-prefill threshold: 0 (off), else at least one block."""
    return threshold and max(threshold, block)


LATER_KNOBS = {"connector", "sync_fail", "async_sched"}      # knobs added after traces were kept: absent means their default


def knobs_of(meta: dict) -> SchedKnobs | None:
    """A trace's scheduler knobs (None: a manager-drive trace); ValueError names a bad field. A
    trace names the drive that ran it: engine, or a manager drive (or none); never auto."""
    drive = meta.get("drive")
    if drive in (None, "mixed", "single", "scheduler"):
        return None
    if drive != "engine":
        raise ValueError(f"trace meta.drive: expected engine or a manager drive (mixed, single, scheduler), "
                         f"not {str(drive)[:40]!r} (a campaign resolves auto before it runs)")
    got = meta.get("scheduler")
    fields = SchedKnobs().as_dict()
    if isinstance(got, dict) and set(fields) - set(got) <= LATER_KNOBS:
        got = dict({k: fields[k] for k in LATER_KNOBS}, **got)     # (a trace from before they existed)
    if not isinstance(got, dict) or set(got) != set(fields) or any(
            type(got[k]) is not type(v) for k, v in fields.items()):
        raise ValueError(f"trace meta.scheduler: expected {{{', '.join(f'{k}: {type(v).__name__}' for k, v in fields.items())}}}")
    return SchedKnobs(**got)


def describe(seen: dict) -> dict[str, Any]:
    """What ran, for the campaign's JSON: vLLM's scheduler, the knobs drawn, the worker model."""
    return {"driver": "vllm.v1.core.sched.scheduler.Scheduler, or its AsyncScheduler under async scheduling (the "
                      "release's own: schedule, update_from_output)",
            "knobs": {k: dict(sorted(c.items())) for k, c in seen.items()},
            "worker_model": "vLLM's model runner rebuilt: per-request block tables from each SchedulerOutput "
                            "alone (worker.py; checked against the manager's before each forward), the queued "
                            "copies run first, then the forward writes each scheduled token's KV and Mamba state "
                            "(timeline.py); one greedy token per request whose prompt is done, drafts accepted "
                            "while they match it (their KV kept, the rest recomputed)",
            "kv_connector": "an external prefix store behind vLLM's KV connector interface (knob `connector`) on "
                            "one-group layouts and, where the release serves them (SupportsHMA, 0.18+), on hybrids "
                            "of full and sliding-window groups (per-group loads into the non-null external blocks): "
                            "sync loads written before the forward, async loads reported in finished_recving steps "
                            "later; one async load in four fails (one block in invalid_block_ids; a hybrid's whole "
                            "load in failed_recving, 0.32+); stores immediate or held until finished_sending "
                            "(connector.py, connector_store.py)",
            "async_scheduling": "vLLM's default, drawn in half the episodes (with an EAGLE/MTP drafter too, its "
                                "drafts kept on the GPU: placeholders in the scheduler; not a drafter with Mamba "
                                "groups; with the connector too, not with failed sync loads) "
                                "(knob `async_sched`; KVCHECK_VLLM_ASYNC_SCHEDULING=0: off): the release's "
                                "AsyncScheduler under the engine core's two-deep batch queue: step N+1 scheduled "
                                "before step N's output is taken (engine_async.py)",
            "not_yet": ["the dense retention twin", "async scheduling with a drafter on Mamba groups, or with failed "
                        "sync loads",
                        "a KV connector on layouts with Mamba or compressed groups (state transfers)",
                        "failed sync loads by default (opt-in: KVCHECK_VLLM_SYNC_LOAD_FAILURES=1)"]}
