"""One model type run over several layer patterns (``kvcheck diff --patterns``): the default run's
result unchanged, each other pattern's verdict beside it, the overall verdict the worst.

The default pattern keeps everything the release matrix reads (engine.py ``matrix_cell``); the
others run ``--scenarios`` scenarios each (no boundary cover), record no verdict in ``--out``, and
are summarised in ``patterns`` (docs/adapters-transformers.md, "Layer patterns").
"""

from __future__ import annotations

from typing import Any

from . import patterns as pat
from .models import AdapterError, decoder_type, derive_config, one_line

RAN = ("exact", "within-tolerance", "divergent", "error")
SUMMARY = ("verdict", "counts", "max_abs_diff", "tolerance", "first_divergent_layer", "first_divergent_operation",
           "reason", "error", "errors", "scenarios_run", "cache_layer_classes", "suffix_modes")


def default_pattern(model_type: str, res: dict[str, Any]) -> list[str] | None:
    """The default run's pattern: as its built config reads, else as the derived config reads."""
    got = res.get("layer_types")
    if isinstance(got, list) and got:
        return list(got)
    mt = decoder_type(model_type)
    try:
        return pat.effective(pat.make_config(mt, derive_config(mt)))
    except Exception:  # noqa: BLE001 - then only the class's own kinds are known
        return None


def summary(res: dict[str, Any], which: str, pattern: list[str] | None, lab: str, how: str) -> dict[str, Any]:
    row = dict(set=which, pattern=pattern, label=lab, how=how)
    row.update({k: res.get(k) for k in SUMMARY if res.get(k) is not None})
    tr = res.get("operation_trace") or {}
    if tr.get("how"):
        row["operation_how"] = tr["how"]
    return row


def worst(rows: list[dict[str, Any]], default_verdict: str) -> str:
    ran = [r["verdict"] for r in rows if r.get("verdict") in RAN]
    return max(ran, key=RAN.index) if ran else default_verdict


def run_patterns(model_type: str, which: str, run_diff, **kw) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the default run's result with ``patterns``, the pattern, its label and the worst verdict added;
    the other patterns' full results, for known-defect recognition)."""
    if which not in pat.SETS:
        raise AdapterError(f"unknown --patterns {which!r}; use one of {', '.join(pat.SETS)}")
    res = run_diff(model_type, **kw)
    if which == "default":
        return res, []
    default = default_pattern(model_type, res)
    kinds = pat.kinds_of(model_type, default)
    lab = pat.label(default, kinds) if default else "?"
    res["pattern"], res["pattern_label"] = default, lab
    rows = [summary(res, "default", default, lab, "the derived tiny config's own pattern")]
    full: list[dict[str, Any]] = []
    other = dict(kw, cover=False, out_dir=None)
    for r in pat.plan(model_type, which, default):
        if "pattern" not in r:
            rows.append(dict(set=r["set"], verdict="skipped", reason=r["skipped"]))
            continue
        try:
            pres = run_diff(model_type, pattern=r["pattern"], **other)
        except AdapterError as exc:      # e.g. a fault this pattern has no layer for
            pres = dict(verdict="unsupported", reason=one_line(exc))
        rows.append(summary(pres, r["set"], r["pattern"], r["label"], r["how"]))
        full.append(pres)
    res["patterns"] = rows
    res["default_verdict"] = res["verdict"]
    res["verdict"] = worst(rows, res["verdict"])
    return res, full


def render(res: dict[str, Any]) -> list[str]:
    """Console lines: one per pattern, its verdict named by the pattern."""
    rows = res.get("patterns")
    if not rows:
        return []
    lines = [f"  layer patterns ({len([r for r in rows if r.get('pattern')])}; overall verdict {res['verdict']}):"]
    for r in rows:
        if r["verdict"] == "skipped":
            lines.append(f"    {r['set']:10} skipped: {r['reason']}")
            continue
        counts = ", ".join(f"{k} {v}" for k, v in (r.get("counts") or {}).items() if v)
        d = r.get("max_abs_diff")
        tail = (f"  {counts}" if counts else "") + (f"  max|dlogit| {d:.3g}" if isinstance(d, (int, float)) else "")
        if r["verdict"] == "divergent":
            tail += f"  layer {r.get('first_divergent_layer')}, {r.get('first_divergent_operation')}"
        if r["verdict"] in ("unsupported", "error"):
            tail += f"  {r.get('reason') or r.get('error') or '; '.join(r.get('errors') or [])}"[:240]
        lines.append(f"    {r['set']:10} {r['label']:24} {r['verdict']}{tail}")
    return lines
