"""What the SGLang adapter relies on in the installed release, checked before a campaign
(fuzz/boundary.py's pre-flight): a release that changed it is "cannot drive" (exit 3, one line)
before the first step, never a finding about SGLang.

On releases without a request KV record (before 0.5.16) SGLang's caches read kvcheck's
`FlatReq` (sched_req.py) in `cache_unfinished_req` / `cache_finished_req`: every attribute
they (and the methods of their class they hand the request to) read off it must exist there.
"""
from __future__ import annotations

from kvcheck.fuzz.boundary import Needs

from .layouts import Layout


def _flat_req() -> object:
    from .sched_req import FlatReq
    return FlatReq("kvcheck-preflight", [])


def needs(lay: Layout) -> list[Needs]:
    """The interface `lay`'s adapter drives at the installed release."""
    from .compat import own_req_cls, sglang_req
    from .install import load
    cls = load()["classes"].get(lay.cls)
    if not isinstance(cls, type):
        return []                    # the layout cannot be expressed: said elsewhere (exit 2)
    out: list[Needs] = []
    if lay.cls == "ChunkCache" and sglang_req() is not None:
        return out                   # SGLang's own Req is driven there (FlatReq only where it does not import)
    if own_req_cls() is None:       # the flat stand-in: every field SGLang reads off it must exist
        target = f"{cls.__module__}:{cls.__qualname__}"
        for method in ("cache_unfinished_req", "cache_finished_req"):
            if hasattr(cls, method):
                out.append(Needs(f"{target}.{method}", reads=("req", _flat_req),
                                 where="kvcheck/engines/sglang/sched_req.py (FlatReq, SGLang's Req on its scheduler path)"))
    return out
