"""The hash-chain base as a registered engine: not a system under test itself but the base class
user adapters of paged, hash-chain block managers build on (base.py, shadow.py; docs/adapters.md,
"Hash-chain managers"). Registered so that `kvcheck engines` lists it and old traces naming its
former modules resolve; a user's subclass runs as `--sut MODULE:CLASS`."""
from __future__ import annotations

from kvcheck.fuzz.engine import Engine


class HashChainEngine(Engine):
    name = "hashchain"
    summary = "base class for adapters of paged hash-chain block managers (vLLM-style prefix caches); use MODULE:CLASS"
    docs = "docs/adapters.md#hash-chain-managers-the-base-class"
    legacy_modules = {"kvcheck.fuzz.hashchain": "kvcheck.engines.hashchain.base",
                      "kvcheck.fuzz.hashchain_shadow": "kvcheck.engines.hashchain.shadow"}

    def release(self) -> str:
        from kvcheck import __version__        # part of kvcheck: no package of its own
        return __version__

    def checks(self) -> dict[str, str]:
        return {"hit_sound_content": "safety"}


ENGINE = HashChainEngine()
