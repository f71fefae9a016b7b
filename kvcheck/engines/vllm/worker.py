"""The GPU worker's block tables, kept as vLLM's model runner keeps them: from each
``SchedulerOutput`` alone.

The worker never reads the KV cache manager. It learns a request's blocks from the scheduler's
output of each step (``GPUModelRunner._update_states``, cited in docs/adapters-vllm.md): a new
request's ``block_ids`` (one list per KV cache group), a running request's ``new_block_ids``
appended per group (None: no new block), a request resumed from preemption whose lists
*replace* the old ones, and ``finished_req_ids`` dropping a request. A preempted request keeps
its (stale) table in the worker until it resumes. Every slot a forward writes and every block it
reads is looked up in this table, so a scheduler that sends the wrong ids (a block left out of
``new_block_ids``, a resumed request appended to instead of replaced) makes the forward write
into, or read, a block the manager gave to no one or to another request.

The check (``worker_table_sound``, safety), before each forward: for every scheduled request and
every group, the worker's table holds exactly the manager's blocks (``req_to_blocks``) at every
position the manager has not nulled. A nulled position (a sliding-window block out of the window,
a retired Mamba state) is one the forward neither reads nor writes; the worker's entry there may
be stale, as it is in vLLM. Since the tables agree wherever the forward goes, the timeline
(timeline.py) reads the manager's blocks for the forward's slots.
"""
from __future__ import annotations

from typing import Any

from .violation import Violation


def _lists(ids: Any) -> list[list[int]]:
    return [list(x) for x in ids]


class Worker:
    """Per-request block tables, one list of block ids per KV cache group."""

    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}

    def update(self, so: Any) -> None:
        """Apply one step's SchedulerOutput, in the model runner's order."""
        for rid in so.finished_req_ids:
            self.tables.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.tables[nr.req_id] = _lists(nr.block_ids)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if resumed(cached, i, rid):
                if new is None:            # (vLLM asserts it: a resumed request carries its table)
                    raise Violation("safety", "worker_table_sound",
                                    f"request {rid} resumes from preemption without its block table "
                                    "(new_block_ids is None)")
                self.tables[rid] = _lists(new)
            elif new is not None:
                for table, ids in zip(self.tables.setdefault(rid, [[] for _ in new]), new):
                    table.extend(ids)

    def check(self, ad: Any, so: Any) -> None:
        """Every scheduled request's worker table equals the manager's wherever it is not null."""
        for rid in so.num_scheduled_tokens:
            have = self.tables.get(rid, [])
            for g, (kind, _, _) in enumerate(ad.groups):
                want = ad._table(g, rid)
                got = have[g] if g < len(have) else []
                bad = [i for i, b in enumerate(want) if not b.is_null and (i >= len(got) or got[i] != b.block_id)]
                if bad or len(got) > len(want):
                    i = bad[0] if bad else len(want)
                    w = want[i].block_id if i < len(want) else "none"
                    raise Violation("safety", "worker_table_sound",
                                    f"{ad.layout} group {g} ({kind}): the worker's block table of {rid}, built "
                                    f"from the scheduler's outputs, holds {got[i] if i < len(got) else 'nothing'} "
                                    f"at position {i} where the KV cache manager holds {w}: the forward "
                                    "writes and reads a block the request does not own (or misses one it does)")


def resumed(cached: Any, i: int, rid: str) -> bool:
    """Is the i-th cached request resumed from preemption (``resumed_req_ids``, 0.14.1-0.33)? From
    0.34 a resumed request is re-sent in full among the new ones (its worker state was dropped at
    preemption): no cached request is resumed."""
    return rid in getattr(cached, "resumed_req_ids", ())


def plant_stale(so: Any) -> bool:
    """The planted fault ``worker_table_stale``: the scheduler leaves the first new block of a
    running request out of the step's ``new_block_ids`` (the worker never learns it)."""
    cached = so.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        new = cached.new_block_ids[i]
        if new is not None and not resumed(cached, i, rid) and any(new):
            g = next(g for g, ids in enumerate(new) if ids)
            cached.new_block_ids[i] = tuple(ids[1:] if k == g else ids for k, ids in enumerate(new))
            return True
    return False
