"""What the SGLang adapter relies on in the installed release, checked before a campaign
(fuzz/boundary.py's pre-flight): a release that changed it is "cannot drive" (exit 3, one line)
before the first step, never a finding about SGLang.

On releases without a request KV record (before 0.5.23) SGLang's caches read kvcheck's
`FlatReq` (sched_req.py) in `cache_unfinished_req` / `cache_finished_req`: every attribute
they (and the methods of their class they hand the request to) read off it must exist there.
"""
from __future__ import annotations

from kvcheck.fuzz.boundary import Needs

from .layouts import Layout


def _flat_req() -> object:
    from .sched_req import FlatReq
    return FlatReq("kvcheck-preflight", [])


def _keeps_kv_record(req_cls: type) -> bool:
    """Whether the release's Req keeps its KV bookkeeping in a record (`self.kv = ...`)."""
    import inspect
    import re
    try:
        return re.search(r"self\.kv\s*[:=]", inspect.getsource(req_cls.__init__)) is not None
    except (OSError, TypeError):
        return False


def needs(lay: Layout) -> list[Needs]:
    """The interface `lay`'s adapter drives at the installed release."""
    from .compat import kv_record_api
    from .install import load
    cls = load()["classes"].get(lay.cls)
    if not isinstance(cls, type):
        return []                    # the layout cannot be expressed: said elsewhere (exit 2)
    out: list[Needs] = []
    if lay.cls == "ChunkCache":
        from .chunk import sglang_req
        if sglang_req() is not None:     # SGLang's own Req is driven there (FlatReq only where it does not import)
            if _keeps_kv_record(sglang_req()[0]) and not kv_record_api():
                # a Req with a KV record (req.kv) that kvcheck drives only in 0.5.23's form
                out.append(Needs("sglang.srt.mem_cache.common:release_kv_cache", keywords=("checkpoint",),
                                 where="kvcheck/engines/sglang/sched.py (a request's KV record, as 0.5.23 keeps it)"))
            return out
    if not kv_record_api():
        target = f"{cls.__module__}:{cls.__qualname__}"
        for method in ("cache_unfinished_req", "cache_finished_req"):
            if hasattr(cls, method):
                out.append(Needs(f"{target}.{method}", reads=("req", _flat_req),
                                 where="kvcheck/engines/sglang/sched_req.py (FlatReq, SGLang's Req on its scheduler path)"))
    return out
