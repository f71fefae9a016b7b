"""The hash-chain base class's state mapping: what a paged, full-attention manager reports as
the spec's state (docs/adapters.md, "State mapping"). The group's pages are the spec's
`swa_window` objects with an infinite window, one per logical block."""
from __future__ import annotations

from typing import Any

from kvcheck.spec.objects import FREE, POOL


def observe(a: Any) -> tuple[int, ...]:
    """The whole spec state, so that a diverged manager is followed and judged by the
    invariants. Observed from the manager: each logical block's page state (cached, evicted
    by `evict` or by an allocation that reused its block) and holders, each request's state,
    position and decision. Kept by this class: `hashed` (published; under the config's
    eviction = tombstone an evicted block's hash stays), the lineage each copy holds and its
    hash names (`bcid`, `bkey`), each request's prompt (`rp`); `dup` where duplicates are
    allowed (a second physical copy holds its content). Constant for a full-attention
    manager: versions, ABI, alignment, pool, graphs, tiers, the window step `rwin` (no finite
    window: always 0)."""
    lay, s = a.lay, list(a.lay.init())
    content = a.cfg.prompts > 1
    for j in range(a.cfg.blocks):
        s[lay.o(0, "swa_window", j, "st")] = a.state[j]
        s[lay.o(0, "swa_window", j, "ref")] = a._holders(j)
        s[lay.o(0, "swa_window", j, "pool")] = POOL["swa_window"] if a.state[j] != FREE else 0
        if a.cfg.duplicates == "allow":     # a second copy is cached (copies.py)
            s[lay.o(0, "swa_window", j, "dup")] = int(len(a.copies(j)) > 1)
        s[lay.b(j, "hashed")] = int(j in a.published)
        if content:
            s[lay.b(j, "bcid")] = s[lay.b(j, "bkey")] = a.lineage[j]
    for r, q in enumerate(a.req):
        for f, v in (("rst", q["st"]), ("rlen", q["n"]), ("rk", q["k"]), ("rpos", q["pos"]),
                     ("rdec", q["dec"])) + ((("rp", q["p"]),) if content else ()):
            s[lay.r(r, f)] = v
    return tuple(s)
