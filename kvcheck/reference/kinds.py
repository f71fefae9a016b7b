"""One manager class per object kind, as vLLM has one per attention type: which blocks a resume
reads, what a holder keeps pinned, which version stamps it, whether it is written in two steps,
and how its tensors sit in a page.

Written as the engine's own implementation (not derived from the spec's recovery predicates):
checking this engine against the spec in lockstep is then a real conformance check. Adding an
object kind means adding one class here and registering it in `MANAGERS`.
"""
from __future__ import annotations

from typing import Callable

from kvcheck.spec.config import Config, Group
from kvcheck.spec.objects import DEVICE_KINDS

Field = tuple[int, str, tuple[int, ...]]       # (layer, tensor name, shape) of a stored tensor


class KindManager:
    name = ""
    stamp = "ver"             # which current version it is written with (engine's `cur` key)
    staged = False            # written in two steps: allocated WRITING, finished later
    stale_reason = "model_version"

    def recovery(self, cfg: Config, g: Group, k: int, window_lo: Callable[[int | None, int], int]) -> list[int]:
        """Blocks whose object of this kind group g reads to resume at k."""
        raise NotImplementedError

    def holds(self, j: int, win: int, pos: int, finite_window: bool) -> bool:
        """Does a holder at `pos` with SWA pins from `win` keep block j's object pinned?"""
        return j < pos

    def fields(self, grp: Group, layer: int, j: int, dims: dict[str, int]) -> list[Field]:
        raise NotImplementedError

    def format_shift(self, abi: int, cmp: int, ix: int) -> int:
        """Rotation of a page's flat data for its layout (ABI) and format versions."""
        return 7 * abi


def _entry_count(grp: Group, j: int, B: int) -> int:
    return (j + 1) * B // grp.m - j * B // grp.m


class CompressedKVManager(KindManager):
    name, stamp, staged = "compressed_kv", "cmp", True

    def recovery(self, cfg, g, k, window_lo):
        return [j for j in range(k) if cfg.has_compressed(g, j)]

    def fields(self, grp, layer, j, dims):
        return [(layer, "comp", (_entry_count(grp, j, dims["B"]), 2 * dims["HD"]))]

    def format_shift(self, abi, cmp, ix):
        return 7 * abi + 3 * cmp


class IndexerManager(CompressedKVManager):
    name, stamp, staged, stale_reason = "indexer", "ix", True, "indexer_version"

    def fields(self, grp, layer, j, dims):
        return [(layer, "idx_keys", (_entry_count(grp, j, dims["B"]), dims["Di"]))]

    def format_shift(self, abi, cmp, ix):
        return 7 * abi + 5 * ix


class TailManager(KindManager):
    name = "tail"

    def recovery(self, cfg, g, k, window_lo):
        return [k - 1] if k >= 1 and cfg.needs_tail(g, k - 1) else []

    def holds(self, j, win, pos, finite_window):
        return pos == j + 1                  # only the snapshot at the holder's position

    def fields(self, grp, layer, j, dims):
        B = dims["B"]
        t = (j + 1) * B - grp.m * ((j + 1) * B // grp.m)
        out = [(layer, "tail_kv", (t, 2 * dims["HD"])), (layer, "tail_gate", (t, 2 * dims["HD"]))]
        if grp.kind == "csa":                # the indexer's own tail rides with the KV tail
            out += [(layer, "idx_tail_kv", (t, dims["Di"])), (layer, "idx_tail_gate", (t, dims["Di"]))]
        return out


class SWAWindowManager(KindManager):
    name = "swa_window"

    def recovery(self, cfg, g, k, window_lo):
        return list(range(window_lo(g.window, k), k))

    def holds(self, j, win, pos, finite_window):
        return (win <= j < pos) if finite_window else j < pos

    def fields(self, grp, layer, j, dims):
        B = dims["B"]
        c = B if grp.window is None else min(B, grp.window - 1)
        shape = (c, dims["H"], dims["D"])
        return [(layer, "win_k", shape), (layer, "win_v", shape)]


MANAGERS: dict[str, KindManager] = {m.name: m for m in (
    CompressedKVManager(), TailManager(), SWAWindowManager(), IndexerManager())}


def manager_for(kind: str) -> KindManager:
    return MANAGERS[kind]
assert tuple(MANAGERS) == DEVICE_KINDS, "one reference-engine manager per device object kind, in pool order"
