"""The checks of UnifiedRadixCache FULL+MAMBA (unified_mamba.py) on top of UnifiedRadixCache
FULL's (unified_checks.py): the recurrent state a resume at a hit reads (spec:
RECURRENT_STATE.needed), the mamba lock references, every state slot of the tree live and holding
its node's state, the mamba sizes and the state pool's accounting; on the Rust core, what its
interface exposes (the flattened state slots)."""
from __future__ import annotations

from typing import Any

from kvcheck.spec.objects import RECURRENT_STATE

from .checks import Violation
from .layouts import layout_config


class UnifiedMambaChecks:
    """Mixed into UnifiedMambaAdapter (before UnifiedAdapter, whose checks it extends)."""

    def check_hit(self, req: Any, hit: int, path: list[int]) -> None:
        """Full KV for all of [0, hit) (UnifiedChecks), and the recurrent state the resume reads
        (spec: RECURRENT_STATE.needed): a live state slot at the hit node holding exactly it."""
        super().check_hit(req, hit, path)
        for j in RECURRENT_STATE.needed(layout_config(self.lay), 0, hit):
            want = tuple(req.tokens[:j + 1])
            s = self.state_slot_at(self._last_node)
            if s is None:
                raise Violation("safety", "hit_sound_mamba_state", f"{req.rid}: hit {hit} ends at a node with no "
                                "Mamba state (a tombstone): the resume has no recurrent state")
            if s in self.mamba_free() or not self._state_holds(s, want):
                raise Violation("safety", "hit_sound_mamba_state", f"{req.rid}: hit {hit} resumes from state slot "
                                f"{s}, which holds {self.mwritten.get(s)!r:.60} (free: {s in self.mamba_free()})")

    def check_all(self) -> None:
        if self.core == "python":
            self._m_checks(self.views())
        else:
            self._m_rust_checks()
        super().check_all()

    def _m_checks(self, views: list) -> None:
        """Mamba lock refs = holders locked at the node; every state slot in the tree live and
        holding its node's state; per-component sizes; the state pool's accounting."""
        want: dict[int, int] = {}
        for node in self.mlocked.values():
            if node is not None:
                want[id(node)] = want.get(id(node), 0) + 1
        free, rows = self.mamba_free(), self._state_rows()
        states, prot = [], 0
        for v in views:
            cd = v.node.component_data[self.CT.MAMBA]
            if cd.lock_ref != want.get(id(v.node), 0):
                raise Violation("bookkeeping", "lock_ref_equals_holders", f"node at depth {len(v.path)}: mamba "
                                f"lock_ref {cd.lock_ref}, holders {want.get(id(v.node), 0)}")
            s = self.state_of(v.node)
            if s is None:
                continue
            states.append(s)
            prot += cd.lock_ref > 0
            if not self._state_holds(s, v.path + v.key, rows):
                raise Violation("bookkeeping", "tree_content_matches", f"node at depth {len(v.path)}: state slot "
                                f"{s} holds the state after {self.mwritten.get(s)!r:.60}, not after its prefix")
            if s in free:
                raise Violation("bookkeeping", "tree_slots_live", f"node at depth {len(v.path)} keeps state "
                                f"slot {s}, which the Mamba pool has free")
        c = self.cache
        if (c.mamba_evictable_size(), c.mamba_protected_size()) != (len(states) - prot, prot):
            raise Violation("bookkeeping", "size_accounting", f"mamba evictable {c.mamba_evictable_size()} / "
                            f"protected {c.mamba_protected_size()}, the tree has {len(states) - prot} / {prot}")
        self._pool("mamba", states + list(self.mslot.values()), free, self.m_all)

    def _m_rust_checks(self) -> None:
        """What the Rust core exposes of the Mamba side: the flattened state slots (live, each
        holding some inserted prefix's state), their count against the sizes, the state pool."""
        c = self.cache
        vals = [int(x) for x in c.all_mamba_values_flatten().reshape(-1).tolist()]
        free, rows = self.mamba_free(), self._state_rows()
        if c.mamba_evictable_size() + c.mamba_protected_size() != len(vals):
            raise Violation("bookkeeping", "size_accounting", f"mamba evictable {c.mamba_evictable_size()} + "
                            f"protected {c.mamba_protected_size()}, the tree's states {len(vals)}")
        for s in vals:
            if s in free:
                raise Violation("bookkeeping", "tree_slots_live", f"the tree keeps state slot {s}, which is free")
            if self.mwritten.get(s) not in self.keys or not self._state_holds(s, self.mwritten[s], rows):
                raise Violation("bookkeeping", "tree_content_matches", f"the tree's state slot {s} holds "
                                f"{self.mwritten.get(s)!r:.60}, no inserted key's state")
        self._pool("mamba", vals + list(self.mslot.values()), free, self.m_all)
