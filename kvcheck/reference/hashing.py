"""Chained block hashes for the prefix table.

Owns the identity of a cached block: hash(parent hash, the block's token bytes, extra keys).
Extra keys are the model *architecture* id (config + dimensions: a cache of another model never
matches), the cache salt (tenant isolation) and the adapter (LoRA) id. Weight, compressor,
indexer and ABI *versions* are deliberately not in the key: they are checked per object by the
funnel's layer 2, which is what lets a hit degrade with a reason (`model_version`, ...) instead
of silently disappearing — and what lets a stale object be detected at all.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

ROOT = b"kvcheck-root"


@dataclass(frozen=True)
class ExtraKeys:
    model_id: str = ""
    cache_salt: str = ""
    adapter_id: str = ""

    def encode(self, with_salt: bool = True) -> bytes:
        salt = self.cache_salt if with_salt else ""
        return f"{self.model_id}|{salt}|{self.adapter_id}".encode()


def block_hashes(tokens: list[int] | bytes, block_size: int, n_blocks: int, extra: ExtraKeys,
                 with_salt: bool = True, chained: bool = True) -> list[str]:
    """Hashes of the first `n_blocks` full blocks; each chains its parent's. `chained` False
    only for a planted fault: each block hashed from its position and own tokens, as if it
    were a first block (blocks of two prefixes that differ earlier collide)."""
    data = bytes(tokens)
    out: list[str] = []
    parent = hashlib.sha256(ROOT + extra.encode(with_salt)).hexdigest()
    for j in range(n_blocks):
        chunk = data[j * block_size:(j + 1) * block_size]
        if len(chunk) < block_size:
            break
        h = hashlib.sha256()
        h.update(parent.encode() if chained else f"{ROOT.decode()}|{j}".encode())
        h.update(chunk)
        h.update(extra.encode(with_salt))
        parent = h.hexdigest()
        out.append(parent)
    return out
