"""Upstream-ready reproducers: a standalone Python script per SGLang finding, next to its trace.

A maintainer should not need kvcheck to see a bug. `<trace>.repro.py` imports only SGLang (and
torch): it builds the trace's cache on its CPU token-to-KV pool allocators, plays the trace's
operations as the adapter plays SGLang's scheduler (match = `match_prefix` + `inc_lock_ref` +
allocation with eviction when short; decode; finish = `insert` + the caller's frees +
`dec_lock_ref`; abort; evict; chunk = the scheduler path: a prompt prefilled in chunks, each
published by SGLang's own `cache_unfinished_req` / `checkpoint_kv_cache`, such a request released by
SGLang's own `cache_finished_req` / `release_kv_cache`), keeps a plain shadow of what each slot was written for, checks
the conditions below after every step, prints each hit, the tree (keys, slots, lock refs,
tombstones) and the pool, and exits 1 while the bug is present, 0 when it is fixed. A planted
fault (a kvcheck negative control) is inlined as the thin wrapper kvcheck uses, clearly marked;
`--clean` leaves it out. On a machine without SGLang's GPU packages it installs the same
named CPU stand-ins as kvcheck (marked; never used where the real modules exist).

Scheduler-drive layouts (`NAME@sched`): every finding, by scheduler/repro.py (SGLang's own
Scheduler, with kvcheck's drive frozen into the script). Cache-level classes: RadixCache and SWARadixCache (this module's template), ChunkCache and UnifiedRadixCache
FULL+MAMBA (repro_classes.py: the template's prelude and their own bodies), any release the
adapter drives; PureSWARadixCache and UnifiedRadixCache FULL / FULL+SWA findings get the replay
command only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .layouts import MAX_TOKENS

CLASSES = ("RadixCache", "SWARadixCache")
FAULTS = ("lock_ref_leak", "match_overreach", "match_ignores_tombstones", "evict_locked", "drop_insert",
          "insert_shifted_values", "evict_no_free", "unfinished_lock_not_moved")


def reproducer_source(trace: Any, trace_path: str) -> str | None:
    """The script's text, or None when the layout's class has no standalone reproducer."""
    lay = trace.meta.get("layout") or {}
    if lay.get("drive") == "sched":          # every scheduler-drive finding: one template (scheduler/repro.py)
        from .scheduler.repro import sched_reproducer_source
        return sched_reproducer_source(trace, trace_path)
    if script_gap(lay, {s.action for s in trace.steps}):
        return None
    other = class_template(lay, trace.fault)         # ChunkCache, UnifiedRadixCache FULL+MAMBA
    if other is None and (lay.get("class") not in CLASSES or (trace.fault and trace.fault not in FAULTS)):
        return None
    text, fields = other or (_TEMPLATE, {})
    for name, value in fields.items():
        text = text.replace(name, value)
    v = trace.violation or {}
    steps = [[s.action, s.params] for s in trace.steps]
    header = (f"# Standalone reproducer of a kvcheck finding on SGLang {trace.meta.get('sglang_version')}\n"
              f"# layout {lay.get('name')!r}: {lay.get('doc') or lay.get('class')}\n"
              f"# check {v.get('check')}: {v.get('message', '')}\n"
              f"# trace: {trace_path} (kvcheck replay {trace_path} --sut sglang)\n"
              + (f"# PLANTED FAULT {trace.fault!r} (a kvcheck negative control, not SGLang's code): the marked\n"
                 f"# wrappers below; run with --clean to leave them out.\n" if trace.fault else ""))
    return (header + text
            .replace("@RELEASE@", repr(trace.meta.get("sglang_version")))
            .replace("@CLASS@", repr(lay["class"])).replace("@PAGE@", repr(int(lay.get("page_size", 1))))
            .replace("@WINDOW@", repr(lay.get("window"))).replace("@CAPACITY@", repr(int(trace.meta.get("capacity", 64))))
            .replace("@MAX_TOKENS@", repr(MAX_TOKENS)).replace("@FAULT@", repr(trace.fault))
            .replace("@CHECK@", repr(v.get("check"))).replace("@STEPS@", repr(steps)))


def write_reproducer(trace: Any, trace_path: str) -> dict:
    """Write `<trace>.repro.py` next to the trace; the finding's fields that say where."""
    src = reproducer_source(trace, trace_path)
    if src is None:
        lay = trace.meta.get("layout") or {}
        why = script_gap(lay, {s.action for s in trace.steps}) or f"no standalone reproducer for {lay.get('class')}"
        return {"reproducer": None, "reproducer_note": f"{why}: replay with `kvcheck replay {trace_path} --sut sglang`"}
    out = Path(trace_path).with_suffix(".repro.py")
    out.write_text(src)
    return {"reproducer": str(out), "reproducer_run": f"python {out}"}


from .repro_classes import class_template, script_gap  # noqa: E402
from .repro_sched import SCHED as _SCHED  # noqa: E402
from .repro_template import TEMPLATE as _BASE  # noqa: E402

_TEMPLATE = _BASE.replace("@SCHED@", _SCHED)
