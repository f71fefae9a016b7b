"""How serious a finding is: the one order every place that picks "the" finding uses.

A run can raise several checks (a campaign raises the same unsafe hit hundreds of times and a
consequence of it elsewhere); the finding it reports, shrinks towards, gates on and writes
first is the most serious one by this order (`rank`), never the first or the shortest alone:

1. the kind of check (`SEVERITY`): wrong content served — an unsafe hit, an adapter's
   `safety` check or a `hit_sound_*` / `hit_content_sound` invariant — leads; then what the
   SUT's own state breaks (invariants), reuse differing from recompute, accounting, a lost
   reuse, a divergence from the spec, an acknowledgement the release cannot have;
2. within a kind, the leading check (`LEADS`): what a reuse read, before a lease broken under
   a bound request, a graph's pages moved, accounting, routing.

Used by kvcheck.fuzz.lockstep.Finding.rank (the campaign, the Hypothesis machine, the
shrinker's target, adapter-check) and by reports that sort findings.
"""
from __future__ import annotations

from typing import Iterable

# Kinds of finding, most serious first (spec.verdict.FOR_FINDING gives each its exit code).
SEVERITY = ("safety", "invariant", "differential", "bookkeeping", "lost_reuse", "conformance",
            "divergence", "stale_acknowledgement")

# Checks, most telling first (a prefix matches a family: hit_sound_swa_window, hit_sound_tail...).
LEADS = ("hit_sound_", "hit_content_sound", "hit_full_blocks", "toctou_bound_stable", "graph_topology",
         "refcount_equals_holders", "admission_cap", "five_state_routing")
UNSAFE_HIT = ("hit_sound_", "hit_content_sound")     # a hit that reads wrong or missing content


def _at(check: str) -> int:
    return next((n for n, p in enumerate(LEADS) if check.startswith(p)), len(LEADS))


def lead(checks: Iterable[str]) -> str:
    """The check a finding leads with (and a shrunk finding must keep)."""
    return min(checks, key=lambda c: (_at(c), c))


def severity(kind: str, checks: Iterable[str] = ()) -> int:
    """0 is the most serious: an unsafe hit, whichever kind of check raised it."""
    if any(c.startswith(UNSAFE_HIT) for c in checks):
        return 0
    return SEVERITY.index(kind) if kind in SEVERITY else len(SEVERITY)


def rank(kind: str, checks: list[str]) -> tuple[int, int]:
    """Sort key of a finding (smaller is more serious): its severity, then its leading check."""
    return severity(kind, checks), (_at(lead(checks)) if checks else len(LEADS))
