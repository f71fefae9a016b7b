"""The catalogue of known vLLM defects (docs/findings-vllm.md): each with its check, the releases
whose code has it, its upstream record, its standalone reproducer, where it can act and how it is
recognised (a counterfactual fix, or the finding's message). The machinery that recognises them:
known.py."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from .fixes import (drop_once, full_at_candidate, full_spec, margin_to_hashed, no_mamba_margin, realign,
                    truncate_all, unitary_margin)


@dataclass(frozen=True)
class Known:
    name: str
    check: str                    # the check the defect makes fire
    first: str                    # releases whose code has the defect (inclusive)
    last: str
    upstream: str                 # public issue / PR, or "none found"
    repro: str                    # standalone reproducer under docs/repro/
    applies: Callable[[Any], bool]              # does the layout reach the defect's code?
    fixed: Callable[[Any, Callable, Any, int], tuple] | None = None   # (ad, find, hashes, max) -> (blocks, hit)
    message: str = ""             # no `fixed`: the finding's message must match this regex
    also: tuple[str, ...] = ()    # other checks the same defect fires through (same message rule)


def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


# ---- where each defect can act -------------------------------------------------------------
def _hybrid(ad: Any) -> bool:
    return hasattr(ad.coord, "attention_groups")


def _two_full(ad: Any) -> bool:
    return _hybrid(ad) and sum(isinstance(g[0], full_spec()) for g in ad.coord.attention_groups) >= 2


def _swa_eagle_mixed(ad: Any) -> bool:
    return _hybrid(ad) and any(k in ("swa", "swa_mla") and g in ad.eagle_groups and bs != ad.align
                               for g, (k, bs, _) in enumerate(ad.groups))


def _fine_wide_full(ad: Any) -> bool:
    """Fine-grained hits and a full-attention group whose block holds several hash blocks."""
    return _hybrid(ad) and len(ad.coord.attention_groups) > 1 and bool(getattr(ad.coord, "enable_partial_hash_hits", False)) \
        and any(isinstance(g.spec, full_spec()) and g.spec.block_size > ad.hb for g in ad.coord.attention_groups)


def _mamba_drafter(ad: Any, fine: bool = False) -> bool:
    return ad.drafter and any(k == "mamba" and (bs > ad.hb or not fine) for k, bs, _ in ad.groups)


# (vLLM 0.34.0, 2026-12-05: the reproducers of swa_eagle_realign, unitary_eagle_margin,
# fine_block_past_candidate, fine_cow_same_step and priority_preempt_unwritten exit 1 there: still present)
# A defect outside the lookup (a chunk split, a step's copies, the scheduler's preemption) has
# no lookup to rerun: it is matched by its signature (check, layout, release range and the
# finding's message), each signature checked against the defect's standalone reproducer.
KNOWN: tuple[Known, ...] = (
    Known("second_full_group_truncation", "hit_length_equal", "0.15.0", "0.28.0", "none found (fixed in 0.33.0)",   # reproducer: 1 on 0.15.1-0.18.1, 0 on 0.14.1
          "docs/repro/vllm_second_full_group_truncation.py", _two_full, truncate_all),
    Known("swa_eagle_realign", "lost_reuse", "0.23.0", "0.34.0", "none found",
          "docs/repro/vllm_swa_eagle_realign.py", _swa_eagle_mixed, realign),
    Known("unitary_eagle_margin", "lost_reuse", "0.14.1", "0.34.0", "none found",
          "docs/repro/vllm_unitary_eagle_margin.py", lambda ad: ad.drafter and not _hybrid(ad), unitary_margin),
    Known("eagle_redrop_32802", "lost_reuse", "0.14.1", "0.18.1", "vllm-project/vllm#32802",
          "docs/repro/vllm_eagle_redrop_32802.py", lambda ad: ad.drafter and _hybrid(ad), drop_once),
    # (0.29.0-0.31.0 added by the scheduler drive: its counterfactual fix explains every lost reuse of
    # `gemma3+eagle` there, 3-5 per 20 s campaign; none seen on 0.32.0 in the same campaign)
    Known("eagle_margin_capped", "lost_reuse", "0.14.1", "0.31.0", "none found (not seen on 0.32.0)",
          "docs/repro/vllm_eagle_margin_capped.py", lambda ad: ad.drafter and _hybrid(ad), margin_to_hashed),
    Known("fine_block_past_candidate", "lost_reuse", "0.33.0", "0.34.0", "none found (new)",
          "docs/repro/vllm_fine_block_past_candidate.py", _fine_wide_full, full_at_candidate),
    # (the stale entry found by the map check, or met by a hit in the step that published it)
    Known("mamba_eagle_unaligned_chunk", "hash_map_sound", "0.15.0", "0.26.0",   # reproducer: 1 on 0.15.1-0.26.0, 0 on 0.27.1+
          "vllm-project/vllm#43559, fixed by PR #51113", "docs/repro/vllm_mamba_eagle_unaligned_chunk.py",
          _mamba_drafter, message=r"stale prefix-cache entry", also=("hit_sound_recurrent_state",)),
    # found by the release matrix (kvcheck matrix --sut vllm), each reproducer exits 1 on 0.15.1
    # and 0.16.0 and 0 on 0.17.1: a resumed request's chunk is not block-aligned, so a Mamba
    # state is published under the hash of a block it does not end (#33706 aligns resumed ones
    # too); and no same-step guard, so a request resumes from a Mamba state the step's other
    # request publishes but has not written yet (#29387's guard, absent in these releases)
    Known("mamba_resume_unaligned_split", "hash_map_sound", "0.15.0", "0.16.0",
          "vllm-project/vllm PR #33706 (merged; fixed in 0.17)", "docs/repro/vllm_mamba_resume_unaligned_split.py",
          lambda ad: not ad.drafter and any(k == "mamba" for k, _, _ in ad.groups), message=r"stale prefix-cache entry",
          also=("hit_sound_recurrent_state",)),     # (a hit on the stale entry before the step ends)
    Known("mamba_same_step_hit", "state_copy_sound", "0.15.0", "0.16.0",
          "vllm-project/vllm PR #29387 (the same-step guard, back in 0.17)", "docs/repro/vllm_mamba_same_step_hit.py",
          lambda ad: any(k == "mamba" for k, _, _ in ad.groups),
          # (the scheduler drive: the block already holds its writer's older state, in place)
          message=r"whose bytes are not written yet( \(published in this step[^)]*\))? when the step's copies run|"
                  r"whose bytes are another state \(published in this step"),
    Known("fine_cow_same_step", "state_copy_sound", "0.26.0", "0.34.0", "none found (new)",   # reproducer: 1 on 0.26.0-0.34.0, 0 on 0.25.1 (no fine-grained Mamba hits)
          "docs/repro/vllm_fine_cow_same_step.py", lambda ad: _mamba_drafter(ad, fine=True),
          message=r"source's bytes are not (written yet|what the copy claims) \(published in this step"),
    # found through vLLM's own scheduler on generated layouts (2026-12-05): replays on 0.20.0-0.25.1, not
    # 0.17.1, 0.19.1, 0.26.0+; the coordinator's hit-length variant of #43559 (PR #46281's analysis).
    # Its second symptom (the 30 s release matrix, 0.20.2 `generated`): the Mamba group's margin grows
    # the hit back past a candidate an earlier EAGLE group dropped, and that group, marked verified,
    # keeps a hit whose peek block is not cached: hit_exceeds_spec, recognised by 0.26.0's fix (no
    # margin for Mamba) giving the spec-usable hit (trace: docs/repro/traces/
    # vllm_eagle_mamba_hit_regrows.trace.json, replays on 0.20.2, 0.21.0, 0.22.1, 0.24.0, not 0.26.0)
    Known("eagle_mamba_hit_mismatch", "hit_length_equal", "0.20.0", "0.25.1",
          "vllm-project/vllm#43559 (hit-length variant; PR #46281, regression of PR #40860)",
          "docs/repro/traces/vllm-gen_1000055-hit_length_equal-seed1000055.json",
          lambda ad: ad.drafter and any(k == "mamba" for k, _, _ in ad.groups), no_mamba_margin,
          message=r"the EAGLE group dropped its last block while the Mamba groups kept the hit",
          also=("hit_exceeds_spec",)),
    # (the unwritten block met by a read, or by the copy-on-write of a later partial hit on it)
    Known("priority_preempt_unwritten", "read_before_write", "0.14.1", "0.34.0",
          "vllm-project/vllm PR #43569 (open)", "docs/repro/vllm_priority_preempt_unwritten.py",
          lambda ad: getattr(ad, "sched_policy", "fcfs") == "priority",
          message=r"was preempted in the step whose allocation published it", also=("state_copy_sound",)),
    # (a KV connector on a hybrid layout, found by kvcheck's SupportsHMA connector on 0.18.1: each group's
    # hit blocks touched and its external blocks allocated group by group, so group 0's allocation pops
    # a hit block of a later group, still free: one block in two groups' tables. Reproducer: 1 on 0.18.1,
    # 0.23.0; 0 on 0.24.0, 0.26.0, 0.28.0, 0.32.0, 0.34.0)
    Known("hybrid_external_evicts_hit", "no_alias", "0.18.0", "0.23.0",
          "vllm-project/vllm PR #33775 (the report), fixed by PR #44409 (two-phase allocation, in 0.24.0)",
          "docs/repro/vllm_connector_hybrid_external_evicts_hit.py",
          lambda ad: bool(getattr(getattr(ad, "knobs", None), "connector", False)) and len(ad.groups) > 1,
          message=r"is in several tables \[\('([^']+)', (\d+), \d+\), \('\1', (?!\2,)\d+, \d+\)"),
    # (a KV connector's failed synchronous load under kv_load_failure_policy="recompute": the failed block
    # and what the discarded forward wrote stay cached; met by a hit before the owner recomputes them.
    # Reproducer: 1 on 0.14.1, 0.16.0, 0.19.1, 0.34.0, and 0 with --policy fail; only with sync failures on)
    Known("connector_recompute_stale_block", "read_before_write", "0.14.1", "0.34.0",
          "vllm-project/vllm#49250 (open: the sharer path), the design in PR #26813",
          "docs/repro/vllm_connector_recompute_stale_block.py",
          lambda ad: bool(getattr(getattr(ad, "knobs", None), "sync_fail", False)),
          message=r"a KV connector load into it failed|a forward whose output vLLM discarded after a failed "
                  r"KV connector load"),
    # (async scheduling, found by kvcheck's AsyncScheduler drive on 0.14.1: a forced reset marks each running
    # request to drop its next output frame; when the frame in flight was a prefill chunk, the flag outlives
    # it and drops a real token whose KV the next forward computed. The trace replays on 0.14.1-0.21.0, not on
    # 0.22.1+, whose reset counts the placeholders in flight instead: async_tokens_to_discard)
    Known("async_reset_drops_token", "toctou_bound_stable", "0.14.1", "0.21.0",
          "vllm-project/vllm#42043, fixed by PR #42117", "docs/repro/vllm_async_reset_drops_token.py",
          lambda ad: bool(getattr(getattr(ad, "knobs", None), "async_sched", False)),
          message=r"sampled by a forward scheduled after its (forced )?preemption"),
    # (async scheduling + an EAGLE drafter, found by kvcheck's AsyncScheduler drive once it ran drafters
    # (2026-12-07, 0.26.0 gemma3+eagle, gpt-oss+eagle, llama4+eagle): the forced reset sets
    # async_tokens_to_discard = num_output_placeholders, placeholder TOKENS (1 + drafts per frame), which
    # _update_request_with_output drains by one per FRAME: with k drafts in flight, k real outputs of
    # post-reset forwards are dropped. 0.22.1 introduced the counter (PR #42117), 0.27 marks each in-flight
    # frame stale instead (PR #48245); the unit mismatch is the one PR #49620 names. Script: 1 on
    # 0.22.1-0.26.0, 0 with --no-drafts, 0 on 0.14.1-0.21.0 (a one-frame flag) and 0.27.1+)
    Known("async_reset_spec_overdiscard", "toctou_bound_stable", "0.22.1", "0.26.0",
          "none found for the over-discard itself; introduced with PR #42117's counter, gone with PR #48245's "
          "stale frames (0.27); the unit mismatch: PR #49620", "docs/repro/vllm_async_reset_spec_overdiscard.py",
          lambda ad: bool(getattr(getattr(ad, "knobs", None), "async_sched", False)) and ad.drafter,
          message=r"sampled by a forward scheduled after its (forced )?preemption"),
    # (async scheduling + an EAGLE drafter, the same first campaigns, 0.18.1 deepseek-v3+mtp@ratios and 0.24.0
    # gpt-oss+eagle: a frame with drafts in flight at a forced reset returns after the request was
    # rescheduled; update_from_output takes that stale frame's rejected drafts back from the resumed
    # request's num_computed_tokens (and num_output_placeholders, which goes negative) before it discards
    # the output. PR #46066 skips the adjustment for a frame pending discard (0.25). Script: 1 on
    # 0.14.1-0.24.0, 0 on 0.25.1, 0.27.1, 0.34.0)
    Known("async_stale_rejection_rollback", "toctou_bound_stable", "0.14.1", "0.24.0",
          "vllm-project/vllm PR #46066 (merged; fixed in 0.25.0)", "docs/repro/vllm_async_stale_rejection_rollback.py",
          lambda ad: bool(getattr(getattr(ad, "knobs", None), "async_sched", False)) and ad.drafter,
          message=r"vLLM applied the output of frame \d+, scheduled before \S+'s preemption, to its resumed state"),
    # (async scheduling + a KV connector, found by the release matrix on 0.14.1 and 0.15.1: a request aborted
    # while its frame is in flight keeps its blocks for the connector's send (delay_free_blocks), so it is
    # still in vLLM's requests when that frame's output arrives; update_from_output appends the token,
    # check_stop finishes it again and request_finished is called a second time: a connector that answers
    # it by releasing the blocks has them freed under its own transfer, and its finished_sending then
    # trips `assert req_id in self.requests` (the crash of vllm#43226). 0.16.0 skips a finished request's
    # output: `if request is None or request.is_finished()`, commented for exactly this case)
    Known("async_abort_double_finish", "vllm_internal_error", "0.14.1", "0.15.1",
          "fixed in 0.16.0 (update_from_output skips finished requests); the crash's symptom: vllm#43226",
          "docs/repro/vllm_async_abort_double_finish.py",       # (1 on 0.14.1, 0.15.1; 0 on 0.16.0, 0.24.0, 0.34.0)
          lambda ad: bool(getattr(getattr(ad, "knobs", None), "async_sched", False))
          and bool(getattr(getattr(ad, "knobs", None), "connector", False)),
          message=r"AssertionError in _update_from_kv_xfer_finished"),
    # (async scheduling + a KV connector, found once the drive let an in-flight forward land after the next
    # frame's connector loads (engine_async._land_late): a request finished at frame N's output has its
    # blocks freed at once while frame N+1, still running, writes them; N+2 hands one to a request whose
    # connector load fills it, and N+1's write lands on top. PR #45357 defers such frees behind the
    # in-flight frame. Trace: replays on 0.14.1, 0.16.0, 0.18.1, 0.21.0, 0.22.1, 0.23.0; not 0.24.0, 0.26.0,
    # 0.30.0, 0.34.0)
    Known("async_free_under_inflight_write", "read_before_write", "0.14.1", "0.23.0",
          "vllm-project/vllm PR #45357 (merged; deferred frees from 0.24.0)",
          "docs/repro/vllm_async_free_under_inflight_write.py",      # (1 on 0.14.1-0.23.0, 0 on 0.24.0+)
          lambda ad: bool(getattr(getattr(ad, "knobs", None), "async_sched", False))
          and bool(getattr(getattr(ad, "knobs", None), "connector", False)),
          message=r"KV connector load: vLLM freed \S+'s blocks when it (finished|was preempted)"),
    # (the same drive on 0.25.1's sliding-window layouts, the 30 s matrix: a running request's block leaves
    # its window at a schedule that counts the in-flight frame's tokens as computed, and is freed while
    # that frame still writes (and reads) it; a connector load fills it for another request. PR #47728
    # frees on the processed-token basis from 0.26.0 (`total_computed_tokens - num_in_flight_tokens`);
    # the P/D report: vllm-project/vllm-ascend#13501. With an EAGLE drafter (async + drafts, 2026-12-07)
    # no connector is needed: the count includes the in-flight drafts, the sampler rejects them, and the
    # request's own next forward reads the freed block -- toctou_bound_stable; the trace replays on
    # 0.20.2-0.25.1, not on 0.26.0+. The fix is the coordinator's call, so chunked-local groups too:
    # llama4+eagle, named on 0.20.2-0.25.1, not 0.26.0/0.28.0)
    Known("async_swa_free_in_flight", "read_before_write", "0.14.1", "0.25.1",
          "vllm-project/vllm PR #47728 (merged; fixed in 0.26.0); vllm-project/vllm-ascend#13501",
          "docs/repro/vllm_async_swa_free_in_flight.py",     # (1 on 0.14.1-0.25.1, 0 on 0.26.0+)
          lambda ad: bool(getattr(getattr(ad, "knobs", None), "async_sched", False))
          and (bool(getattr(getattr(ad, "knobs", None), "connector", False)) or ad.drafter)
          and any(k in ("swa", "swa_mla", "chunked_local") for k, _, _ in ad.groups),
          message=r"as out of its (sliding window|local-attention chunk) at a schedule that counted (that forward's|"
                  r"the in-flight frame's) tokens as computed", also=("toctou_bound_stable",)),
    # (the 30 s matrix, 0.26.0 `generated`: fine-grained hits are enabled by any align-mode Mamba group
    # wider than the hash block, and a sliding-window group whose block is wider too then asserts in its
    # finder on the first lookup -- vLLM's engine dies. 0.28.0 turns fine-grained hits off when a
    # manager cannot look up at hash granularity, "Disabling fine-grained prefix-cache hits because these
    # KV cache managers require block-aligned lookups"). The chunked-local manager asserts the same way
    # (0.27.1 `generated`, the 30 s matrix: gen:1000007, two chunked-local groups and Mamba, block 16,
    # hash block 8): same gate, same fix)
    Known("fine_swa_partial_assert", "vllm_internal_error", "0.26.0", "0.27.1",
          "the assertion: vllm-project/vllm PR #46384; the gate in 0.28.0 (issue #53786 describes it)",
          "docs/repro/traces/vllm_fine_swa_partial_assert.trace.json",
          lambda ad: any(k == "mamba" and bs > ad.hb for k, bs, _ in ad.groups)
          and any(k in ("swa", "swa_mla", "chunked_local") and bs > ad.hb for k, bs, _ in ad.groups),
          message=r"AssertionError in find_longest_cache_hit: (SlidingWindowManager does not support fine-grained"
                  r"|KV cache groups with different block sizes are not compatible with chunked local attention)"),
    # (async scheduling + fine-grained Mamba hits, found by kvcheck's AsyncScheduler drive on 0.26.0: a
    # prompt ending on a hash boundary inside a Mamba block gets a partial entry on the running state
    # block; the next frame's allocate_slots moves it to a copy, then caches min(computed + new,
    # num_tokens) = the prompt again (the sampled token is not known yet) and re-registers it on the
    # running block, which that frame's forward advances. Reproducer: 1 on 0.26.0-0.31.0 (0 with
    # --sync); 0 on 0.32.0, 0.33.0, 0.34.0, whose entry stops at prompt_len - 1)
    Known("async_fine_tail_republish", "hash_map_sound", "0.26.0", "0.31.0", "none found (new)",
          "docs/repro/vllm_async_fine_tail_republish.py",
          lambda ad: bool(getattr(getattr(ad, "knobs", None), "async_sched", False))
          and any(k == "mamba" and bs > ad.hb for k, bs, _ in ad.groups),
          message=r"stale prefix-cache entry", also=("hit_sound_recurrent_state",)),
)
