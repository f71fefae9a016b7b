"""Duplicate copies and late publishing on the hash-chain base class (config `duplicates =
"allow"`, `publish = "release"`; docs/adapters.md, "Copies: holders per physical block").

Which physical copy of a logical block the manager publishes matters once two exist: a lookup
finds that one only. The base class follows it (`a.pub`: logical block -> the block id its hash
names), from the manager's own answers where it can (a read-only lookup after each release), and
maps what the manager does with copies onto the spec's steps:
- a write of a block the spec has cached (a late publisher cannot see another running request's
  unpublished block) is `append_copy`;
- reusing the memory of one of two copies is `evict_copy` (an event of the allocation); of the
  published one while the other is held, `evict_copy` and `drop_hash` (its holder publishes it
  again at release); while nobody holds the other, `evict` of the block (the other is garbage);
- at a release (publish = release) the request's positions that still hold its content are
  published, and its own copy of a block whose hash names another copy is garbage (no lookup
  finds it, no request holds it): `evict_copy`, after the release.
"""
from __future__ import annotations

from typing import Any

from kvcheck.spec.content import chain as lineage
from kvcheck.spec.objects import READY
from kvcheck.spec.sut import ActionRejected


def copy_event(j: int) -> tuple[str, dict[str, Any]]:
    return ("evict_copy", {"g": 0, "kind": "swa_window", "j": j})


def reuse_events(a: Any, block: int, j: int) -> list[Any]:
    """The manager is filling `block` with logical block j: what that reuse of its memory evicts,
    as the spec's events (the state is updated here)."""
    out: list[Any] = []
    held = a._held()
    for lj in range(a.cfg.blocks):
        cs = a.copies(lj)
        if lj == j or block not in cs:
            continue
        rest = [b for b in cs if b != block]
        if not rest:                                 # its last copy
            a._gone(lj)
            out.append(("evict", lj))
        elif a.cfg.duplicates != "allow":            # the spec counts one copy: nothing it tracks
            continue
        elif a.pub.get(lj) != block:                 # a copy no lookup finds
            out.append(copy_event(lj))
        elif any(held.get(b) for b in rest):         # the published one: its hash goes with it
            a.pub.pop(lj)
            a.published.discard(lj)
            out += [copy_event(lj), ("drop_hash", lj)]
        else:                                        # and the other copy is garbage
            a.stale.update(rest)
            a._gone(lj)
            out.append(("evict", lj))
    return out


def written(a: Any, j: int, block: int, copied: bool) -> None:
    """Block j was written into `block` (a second copy when `copied`): who publishes it."""
    if not copied:
        a.pub.pop(j, None)
    if a.cfg.publish == "release":                   # at the release; a rewrite drops the old hash
        if not copied:
            a.published.discard(j)
        return
    a.published.add(j)
    if a.pub.get(j) not in a.copies(j):              # eager: the first copy written stays published
        a.pub[j] = block


def released(a: Any, r: int, blocks: list[int]) -> list[Any]:
    """Request r (no longer holding anything) released `blocks`, its block ids by position. With
    publish = release the manager published them: the positions still holding r's content are
    published (the spec's rule), the copy each hash names is read back from the manager, and r's
    own copies that no hash names are garbage. Returns the events (after the release)."""
    if a.cfg.publish != "release" or not blocks:
        return []
    p = a.req[r]["p"]
    for i, b in enumerate(blocks):
        if a.state[i] == READY and a.lineage[i] == lineage(a.cfg, p, i):
            a.published.add(i)
            if a.pub.get(i) not in a.copies(i) and b in a.copies(i):
                a.pub[i] = b
    tenant, toks = a._prompt(r)
    toks = toks[:len(blocks) * a.B]
    hits = a._check_hits(f"lookup after request {r} released its blocks", a._ask(tenant, toks),
                         len(blocks), tenant, toks)
    for i, b in enumerate(hits):
        if b in a.copies(i):
            a.pub[i] = b
    out, held = [], a._held()
    for i, b in enumerate(blocks):
        cs = a.copies(i)
        if len(cs) > 1 and b in cs and b != a.pub.get(i) and not held.get(b):
            a.stale.add(b)
            out.append(copy_event(i))
    return out


def dropped_copy(a: Any, j: int, done: list[int]) -> dict[str, Any]:
    """The evict callback dropped `done`, some copies of block j, and kept a held one: the
    spec's evict_copy; its hash goes too where `done` holds the copy it names (drop_hash)."""
    if a.pub.get(j) not in done:
        return {"instead": {"action": "evict_copy"}}
    a.pub.pop(j)
    a.published.discard(j)
    return {"instead": {"action": "evict_copy"}, "events": [("drop_hash", j)]}


class CopyActions:
    """The duplicate-copy actions of the spec, on the base class's write (`_write`)."""

    def _a_append_copy(self, r: int, j: int) -> dict[str, Any] | None:
        return self._write(r, j, "append_copy")  # type: ignore[attr-defined]

    def _a_append_evict_copy(self, r: int, j: int, v: int) -> dict[str, Any] | None:
        return self._write(r, j, "append_evict_copy", {"v": None})  # type: ignore[attr-defined]

    def _a_evict_copy(self, g: int, kind: str, j: int) -> dict[str, Any] | None:
        """The evict callback on an unreferenced copy (one no hash names first)."""
        a: Any = self
        held, cs = a._held(), a.copies(j)
        free = sorted((b for b in cs if not held.get(b)), key=lambda b: b == a.pub.get(j))
        if len(cs) < 2 or not free or not a.evict(free[0]):
            raise ActionRejected(f"block {j} has no unreferenced second copy the manager evicts")
        a.shadow.release(free[0])
        out = dropped_copy(a, j, free[:1])
        return {"events": out["events"]} if "events" in out else None
