"""`--layout-file FILE`: a user's own vLLM KV cache layout as JSON, validated in one place.

    {"description": "my model",                      (optional)
     "groups": [{"kind": "full", "block_size": 16},
                {"kind": "swa", "block_size": 8, "window": 20},
                {"kind": "chunked_local", "block_size": 8, "chunk": 16}],
     "retention_interval": null,                     (optional: null | 0 | N, sparse SWA retention)
     "hash_block_size": 4, "max_model_len": 64,      (optional: the scale; defaults 4 and 64)
     "use_eagle": false, "eagle_groups": [0]}         (optional: an EAGLE/MTP drafter; the groups
                                                      holding its layers, default none flagged)

Kinds: full, swa, chunked_local, mla, swa_mla, mamba (MambaSpec in align mode: its block is the
scheduler block, a multiple of the hash block — larger: hits inside it, vLLM 0.33; one Mamba block
size; no retention interval with it; a drafter's layers never in it) (the compressed/indexer/compressor-ring groups of
DeepSeek-V4 have a fixed spec ground truth and come only with the `dsv4` preset). The scheduler
block is the LCM of the block sizes. Any bad value is
one line naming the file and the field (ValueError; the CLI exits 2).
"""
from __future__ import annotations

import json
import math
from typing import Any

from kvcheck.spec.config import read_json

KINDS = {"full": (), "mla": (), "mla_indexer": (), "swa": ("window",), "swa_mla": ("window",), "chunked_local": ("chunk",),
         "mamba": ()}
PRESET_ONLY = ("compressed", "indexer", "tail_ring")
MAX_GROUPS = 6
_KEYS = ("description", "groups", "retention_interval", "hash_block_size", "max_model_len",
         "use_eagle", "eagle_groups")


# Real sizes fit (NAME@real: Nemotron-H's 1040-token Mamba block, Llama 4's 24,576 tokens).
MAX_HASH_BLOCK, MAX_LEN = 2048, 1 << 16


def parse_layout(d: Any, where: str, hash_block: int, max_len: int
                 ) -> tuple[str, list[tuple[str, int, int | None]], int, int | None]:
    """(description, groups, scheduler block size, retention interval) from a JSON object."""
    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"{where}: {field}: {why}")

    if not isinstance(d, dict):
        raise ValueError(f"{where}: must be a JSON object with a 'groups' list")
    for k in d:
        if k not in _KEYS:
            raise bad(_name(k), f"unknown key (known: {', '.join(_KEYS)})")
    hash_block = d.get("hash_block_size", hash_block)
    if not _int(hash_block) or not 1 <= hash_block <= MAX_HASH_BLOCK:
        raise bad("hash_block_size", f"must be an integer in 1..{MAX_HASH_BLOCK}, got {hash_block!r}")
    max_len = d.get("max_model_len", max_len)
    if not _int(max_len) or not 16 <= max_len <= MAX_LEN or max_len < 4 * hash_block:
        raise bad("max_model_len", f"must be an integer in 16..{MAX_LEN} and >= 4 hash blocks, got {max_len!r}")
    gs = d.get("groups")
    if not isinstance(gs, list) or not 1 <= len(gs) <= MAX_GROUPS:
        raise bad("groups", f"must be a list of 1..{MAX_GROUPS} groups")
    groups: list[tuple[str, int, int | None]] = []
    for i, g in enumerate(gs):
        at = f"groups[{i}]"
        if not isinstance(g, dict):
            raise bad(at, "must be an object with kind and block_size")
        kind = g.get("kind")
        if kind in PRESET_ONLY:
            raise bad(f"{at}.kind", f"{kind!r} groups come only with the dsv4 preset (their spec ground truth is fixed there)")
        if kind not in KINDS:
            raise bad(f"{at}.kind", f"unknown kind {json.dumps(kind)[:40]} (known: {', '.join(KINDS)})")
        allowed = {"kind", "block_size", *KINDS[kind]}
        for k in g:
            if k not in allowed:
                raise bad(f"{at}.{_name(k)}", f"not a field of a {kind} group (fields: {', '.join(sorted(allowed))})")
        bs = g.get("block_size")
        if not _int(bs) or bs < hash_block or bs % hash_block or bs > max_len // 2:
            raise bad(f"{at}.block_size", f"must be a multiple of the hash block {hash_block} in "
                      f"{hash_block}..{max_len // 2} (prompts stay under {max_len} tokens), got {bs!r}")
        p = None
        for k in KINDS[kind]:
            p = g.get(k)
            if not _int(p) or not 1 <= p <= max_len:
                raise bad(f"{at}.{k}", f"must be an integer in 1..{max_len}, got {p!r}")
            if k == "chunk" and p % bs:
                raise bad(f"{at}.chunk", f"must be a multiple of its block_size {bs}, got {p}")
        groups.append((kind, bs, p))
    sched = math.lcm(*(bs for _, bs, _ in groups))
    if len(groups) == 1 and groups[0][1] != hash_block:
        raise bad("groups[0].block_size", f"a single group's block must be the hash block "
                  f"{hash_block} (vLLM's unitary coordinator), got {groups[0][1]}")
    for i, (k, bs, _) in enumerate(groups):
        if k == "chunked_local" and bs != sched:
            raise bad(f"groups[{i}].block_size", f"vLLM's chunked local attention needs the scheduler "
                      f"block (LCM of the block sizes, {sched}), got {bs}")
    for i, (k, bs, _) in enumerate(groups):
        if k == "mamba" and bs != sched:
            raise bad(f"groups[{i}].block_size", f"a mamba group's block must be the scheduler block {sched} "
                      f"(the LCM of the block sizes: vLLM aligns every group to the Mamba block), got {bs}")
    if sched > max_len // 2:
        raise bad("groups", f"the scheduler block (LCM of the block sizes) is {sched}, over {max_len // 2}")
    ret = d.get("retention_interval")
    if ret is not None:
        if not _int(ret) or ret < 0:
            raise bad("retention_interval", f"must be null or an integer >= 0, got {ret!r}")
        if ret % sched:
            raise bad("retention_interval", f"must be a multiple of the scheduler block {sched}, got {ret}")
        if not any(k in ("swa", "swa_mla") for k, _, _ in groups):
            raise bad("retention_interval", "applies to sliding-window groups; the layout has none")
    mamba = any(k == "mamba" for k, _, _ in groups)
    if mamba and ret is not None:
        raise bad("retention_interval", "sparse retention of Mamba state is not modelled by the dense "
                  "twin yet; drop it with a mamba group")
    eagle = d.get("use_eagle", False)
    if not isinstance(eagle, bool):
        raise bad("use_eagle", f"must be true or false, got {eagle!r}")
    eg = d.get("eagle_groups", [])
    if not isinstance(eg, list) or any(not _int(i) or not 0 <= i < len(groups) for i in eg) \
            or len(set(eg)) != len(eg):
        raise bad("eagle_groups", f"must be a list of distinct group indices in 0..{len(groups) - 1}")
    if eagle and any(groups[i][0] == "mamba" for i in eg):
        raise bad("eagle_groups", "a mamba group cannot hold a drafter's layers (vLLM's draft models have "
                  "no Mamba layers)")
    if eg and not eagle:
        raise bad("eagle_groups", "needs use_eagle: true")
    if eagle and any(k == "chunked_local" and (not eg or i in eg) for i, (k, _, _) in enumerate(groups)):
        raise bad("eagle_groups", "vLLM does not support an EAGLE drafter on a chunked local group "
                  "(none listed means every group)")
    desc = d.get("description", "")
    if not isinstance(desc, str):
        raise bad("description", "must be a string")
    return desc or f"{where}: " + " + ".join(f"{k} b{bs}" + (f" {p}" if p else "") for k, bs, p in groups), \
        groups, sched, ret


def parse_scale(d: dict, hash_block: int, max_len: int) -> tuple[int, int, tuple[int, ...] | None]:
    """(hash block, max_model_len, drafter groups or None) of a layout parse_layout accepted."""
    eagle = tuple(d.get("eagle_groups", [])) if d.get("use_eagle") else None
    return d.get("hash_block_size", hash_block), d.get("max_model_len", max_len), eagle


def read_layout_file(path: str) -> Any:
    """The file's JSON (bounded, regular files only, depth-bounded: spec.config.read_json)."""
    return read_json(path, "--layout-file", ValueError)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _name(key: str) -> str:
    """A key as written in an error line: bare when plain, else JSON-quoted (one line)."""
    return key if key.isidentifier() else json.dumps(key)
