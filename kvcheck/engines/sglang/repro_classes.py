"""Standalone reproducers for the classes whose scripts live outside repro_template.py:
ChunkCache (repro_chunk.py) and UnifiedRadixCache FULL+MAMBA (repro_mamba.py,
repro_mamba_sched.py, then repro_mamba_run.py).
Each is the template's shared prelude (the @NAME@ fields and the CPU stand-ins, taken from
sglang_repro_template.TEMPLATE up to its end-of-stand-ins marker) followed by the class's body."""
from __future__ import annotations

from typing import Any

from .layouts import ACTIONS
from .repro_template import TEMPLATE

MARKER = "# ---- end of CPU stand-ins"
PRELUDE = TEMPLATE[:TEMPLATE.index(MARKER) + len(MARKER)] + "\n"

# the faults each class's script can inline (the adapter's fault table names them all)
CHUNK_FAULTS = ("lock_ref_leak", "evict_locked", "chunk_reports_hit", "chunk_frees_unfinished", "chunk_double_free",
                "chunk_finish_leaks")
MAMBA_FAULTS = ("lock_ref_leak", "match_overreach", "evict_locked", "drop_insert", "insert_shifted_values",
                "evict_no_free", "core_drops_insert", "mamba_hit_without_state", "mamba_state_freed_on_insert",
                "mamba_state_dropped_on_insert", "mamba_lock_leak", "mamba_evict_locked_state",
                "mamba_state_leaked_on_abort", "unfinished_lock_not_moved")


def class_template(lay: dict[str, Any], fault: str | None) -> tuple[str, dict[str, str]] | None:
    """(the script's text with its class-specific @NAME@ fields, their values), or None when the
    layout is not one of these classes or its fault cannot be inlined."""
    if lay.get("class") == "ChunkCache":
        if fault and fault not in CHUNK_FAULTS:
            return None
        from .chunk import CHUNK_TOKENS, ROWS
        from .repro_chunk import BODY
        return PRELUDE + BODY, {"@CHUNK@": repr(CHUNK_TOKENS), "@ROWS@": repr(ROWS)}
    if lay.get("class") == "UnifiedRadixCache" and "mamba" in (lay.get("components") or ()):
        if fault and fault not in MAMBA_FAULTS:
            return None
        from .repro_mamba import BODY
        from .repro_mamba_run import BODY as RUN
        from .repro_mamba_sched import BODY as SCHED
        core = lay.get("tree_core") or "python"
        return PRELUDE + BODY + SCHED + RUN, {"@CORES@": repr(["python", "rust"] if core == "lockstep" else [core])}
    return None


def script_gap(lay: dict[str, Any], actions: set[str]) -> str | None:
    """Why a trace on this layout gets no script although its class has one, or None: a script that
    skipped a step it cannot play could report the bug fixed, so such a trace gets none (every
    script plays every action the adapter drives now, `chunk` on FULL+MAMBA included)."""
    if lay.get("drive") == "sched":
        return "a trace of SGLang's own scheduler (NAME@sched) has no standalone script yet"
    extra = sorted(actions - set(ACTIONS))
    return f"the {lay.get('class')} script does not play {', '.join(extra)}" if extra else None
