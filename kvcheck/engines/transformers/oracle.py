"""Differential reuse-vs-recompute oracle for Hugging Face ``transformers`` causal LMs.

The entry points: :func:`list_models` (every hybrid model type of the installed transformers,
with the verdict of its last run), :func:`run_diff` (one model type: tiny derived config,
scenarios across every boundary, divergence traced to the operation), :func:`render_text`.
The parts: transformers_models (discovery, tiny configs), transformers_plan (boundaries,
scenarios, tolerance), transformers_scenarios (the runs), transformers_cache (cache objects in
kvcheck's kinds, faults), transformers_trace (operation-level tracing). ``transformers`` is
imported lazily: importing this module works without it.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from .cache import (FAULTS, KINDS, RECURRENT, cache_layers, objects)
from .interface import CannotDrive, classify
from .models import (AdapterError, import_transformers, jsonable, one_line)
from .models import derive_config as default_config
from .pattern_runs import run_patterns
from .plan import EPS_FLOOR, NOISE_FACTOR

__all__ = ["AdapterError", "run_diff", "list_models", "render_text", "FAULTS", "KINDS", "default_config",
           "VERDICTS", "verdicts_path"]

VERDICTS = ("exact", "within-tolerance", "divergent", "error", "unsupported")
VERDICTS_FILE = "transformers-verdicts.json"
TRACE_MARGIN = 4.0  # an operation differs beyond this many times the layer's relative noise (floor 2 eps)
RECURRENT_NOTE = (f"{RECURRENT}: outside kvcheck's five kinds: a fixed-size summary of every token "
                  "before L, usable at exactly L (no partial reuse); checked like a one-position window")


def verdicts_path(out_dir: str) -> str:
    """Where the last verdict of each model type and dtype is kept: ``<out_dir>/transformers-verdicts.json``."""
    return os.path.join(out_dir, VERDICTS_FILE)


def load_verdicts(out_dir: str | None) -> dict[str, Any]:
    if not out_dir:
        return {}
    try:
        with open(verdicts_path(out_dir), encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def record_verdict(out_dir: str, res: dict[str, Any]) -> None:
    """Keep ``res``'s verdict for ``--list-models`` (written atomically)."""
    os.makedirs(out_dir, exist_ok=True)
    data = load_verdicts(out_dir)
    data[f"{res['model_type']}|{res['dtype']}"] = {k: res.get(k) for k in (
        "verdict", "reason", "max_abs_diff", "first_divergent_layer", "first_divergent_operation",
        "transformers_version", "seed", "scenarios_run")}
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".verdicts-")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
    os.chmod(tmp, 0o644)
    os.replace(tmp, verdicts_path(out_dir))


def list_models(out_dir: str | None = None) -> list[dict[str, Any]]:
    """Every model type of the installed transformers whose cache is not uniform full attention,
    found from the library (config classes, layer types, cache layer classes), with last verdicts
    and, per layer kind, the cache layer class and objects it needs (``layer_caches``)."""
    from .models import list_model_types
    from .patterns import layer_caches

    last = load_verdicts(out_dir)
    out = []
    for info in list_model_types():
        try:
            info["layer_caches"] = layer_caches(info["model_type"])
        except Exception as exc:  # noqa: BLE001 - description only
            info["layer_caches"] = {}
            info["layer_caches_note"] = f"not read: {one_line(exc)}"
        info["last_verdicts"] = {k.split("|", 1)[1]: v for k, v in last.items()
                                 if k.split("|", 1)[0] == info["model_type"]}
        out.append(info)
    return out


def _cache_objects(runner) -> list[dict[str, Any]]:
    """Per cache layer: its class and each cached object with its kvcheck kind."""
    import torch

    _, cache = runner.prefill(torch.zeros((1, 3), dtype=torch.long))
    return [dict(layer=i, cls=type(layer).__name__,
                 objects={name: kind for name, (kind, _) in objects(layer).items() if kind != "counter"})
            for i, layer in enumerate(cache_layers(cache))]


def run_diff(model_type: str, config_json: str | None = None, dtype: str = "float32", scenarios: int = 20,
             seed: int = 0, fault: str | None = None, out_dir: str | None = None, trace: bool = True,
             model_hook=None, cover: bool = False, pattern: list[str] | None = None, sizes: str = "fixed") -> dict:
    """Reuse vs recompute for a tiny random-weight model of ``model_type`` (see docs/adapters-transformers.md).

    A model that cannot be built from its derived config gives ``verdict: unsupported`` with a
    one-line ``reason``; usage errors (unknown model type or dtype or fault, bad config file,
    transformers missing) raise :class:`AdapterError`. With ``out_dir``, the verdict is kept there.
    ``model_hook(model)`` runs on the built model first (to plant a bug in one operation).
    ``cover``: run at least one scenario on, one before and one after every boundary (more than
    ``scenarios`` if the model has many boundaries; the CLI and the sweep do).
    Raises :class:`kvcheck.fuzz.boundary.CannotDrive` (no verdict, nothing recorded) when the run
    fails on kvcheck's side of the boundary with transformers: the installed release ignored the
    cache kvcheck passed (interface.py), or kvcheck's own code failed on it (``boundary.blame``).
    An exception of transformers' own code stays the scenario's verdict ``error``.
    ``pattern``: run with these layer kinds instead of the derived ones (patterns.py; ``unsupported``
    when the class cannot express them). ``sizes``: ``fixed`` (models.GRANULARITY) or ``ratios`` (the
    default config's own granularities scaled together; ratios.py; adds ``sizes``, ``scale``, ``size_fields``).
    """
    try:
        return _run_diff(model_type, config_json, dtype, scenarios, seed, fault, out_dir, trace, model_hook, cover,
                         pattern, sizes)
    except (AdapterError, CannotDrive):
        raise
    except Exception as exc:  # noqa: BLE001 - classified: kvcheck's side is CannotDrive, else as it was
        cd = classify(exc)
        if cd is None:
            raise
        raise cd from exc


def _run_diff(model_type: str, config_json: str | None, dtype: str, scenarios: int, seed: int,
              fault: str | None, out_dir: str | None, trace: bool, model_hook, cover: bool,
              pattern: list[str] | None = None, sizes: str = "fixed") -> dict:
    """run_diff's body (see its docstring)."""
    from .build import build_model, torch_dtype
    from .models import decoder_type, derive_config
    from .scenarios import Runner

    if not isinstance(scenarios, int) or scenarios < 1:
        raise AdapterError(f"scenarios must be a positive integer, got {scenarios!r}")
    transformers = import_transformers()
    import torch

    torch_dtype(dtype)
    if fault is not None and fault.partition("@")[0] not in FAULTS:
        raise AdapterError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)} (optionally NAME@LAYER)")
    base = dict(transformers_version=transformers.__version__, torch_version=torch.__version__,
                model_type=model_type, runs_as=None, dtype=dtype, seed=seed, fault=fault)
    if pattern is not None:
        from .patterns import label
        base.update(pattern=list(pattern), pattern_label=label(pattern))
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from .models import ALIASES
    if ALIASES.get(model_type, model_type) not in CONFIG_MAPPING:
        raise AdapterError(f"unknown model_type {model_type!r} for transformers {transformers.__version__}; "
                           "see `kvcheck diff --sut transformers --list-models`")
    try:
        base["runs_as"] = decoder_type(model_type)
        base["derived_config"] = derive_config(model_type)
        if sizes == "ratios":
            from . import ratios
            rep = ratios.report_for(model_type, base["derived_config"])
            base.update(sizes="ratios", scale=rep["scale"], scale_rule=rep["rule"], size_fields=rep["fields"])
            base["derived_config"] = ratios.apply(base["derived_config"], rep)
        model, config, mt, params = build_model(model_type, config_json, dtype, seed, pattern=pattern, sizes=sizes)
    except AdapterError as exc:
        if "config file" in str(exc):
            raise
        res = dict(base, verdict="unsupported", reason=str(exc), scenarios=[], scenarios_run=0)
        if out_dir:
            record_verdict(out_dir, res)
        return jsonable(res)
    if model_hook is not None:
        model_hook(model)
    runner = Runner(model, config, mt, dtype, seed)
    runner.sizes = sizes
    try:
        try:
            run = runner.run(scenarios, fault, cover)
        except AdapterError:
            raise
        except Exception as exc:  # noqa: BLE001 - the SUT crashed outside a scenario (e.g. probing its cache)
            cd = classify(exc)
            if cd is not None:
                raise cd from exc
            run = dict(verdict="error", error=runner.crash(exc, "setup"), scenarios=[],
                       counts={v: 0 for v in VERDICTS[:4]}, boundaries={})
        cal = run.pop("cal", None)
        res = dict(base, model_class=type(model).__name__, derived_config=params,
                   attn_implementation=getattr(config, "_attn_implementation", None),
                   layer_types=list(getattr(config.get_text_config(decoder=True), "layer_types", None) or [])
                   or None, cache_layer_classes=runner.cache_layer_classes, **run)
        try:
            res["cache_objects"] = _cache_objects(runner)
        except Exception as exc:  # noqa: BLE001 - description only
            res["cache_objects"] = f"not read: {one_line(exc)}"
        res["tolerance_method"] = (f"max({NOISE_FACTOR:g} x observed float noise, {EPS_FLOOR:g} x eps(dtype) x "
                                   "max|logit|); noise = max |logit difference| of the full forward of the same "
                                   "sequence run alone vs. as one row of a batch of 3")
        res["scenarios_run"] = len(run["scenarios"])
        res["first_divergent_operation"] = None
        if trace and runner.kept and cal is not None:
            idx, ids, restored = runner.kept["index"], runner.kept["ids"], runner.kept["cache"]
            sc = run["scenarios"][idx]
            L = sc["first_divergent_layer"]
            if L is not None:
                scale = max(cal["layer_scale"][L], 1e-30)
                # floor: 16 eps like the layer tolerance, but 2 eps in 16-bit types (16 eps is 12% there)
                floor = (EPS_FLOOR if runner.eps < 1e-4 else 2.0) * runner.eps
                rel = TRACE_MARGIN * max(NOISE_FACTOR * cal["layer_noise"][L] / scale, floor)
                from .trace import trace as trace_op
                try:
                    tr = trace_op(runner, ids, sc["prefix_len"], sc["steps"], restored, L, rel)
                except CannotDrive:
                    raise
                except Exception as exc:  # noqa: BLE001 - tracing must not hide the verdict
                    tr = dict(operation=None, how=f"tracing failed: {type(exc).__name__}: {one_line(exc)}")
                tr.update(scenario=idx, layer=L)
                sc["operation_trace"] = tr
                res["operation_trace"] = tr
                res["first_divergent_operation"] = tr.get("operation")
    finally:
        runner.close()
    res = jsonable(res)
    if out_dir:
        record_verdict(out_dir, res)
    return res


def sweep(model_types: list[str] | None = None, dtypes=("float32", "bfloat16"), scenarios: int = 10,
          seed: int = 0, out_dir: str | None = None, progress=None, listed=None,
          shared: dict | None = None, patterns: str = "default") -> list[dict[str, Any]]:
    """Run every listed model type (or ``model_types``) in each dtype; a composite type whose
    decoder is itself listed shares that run. Returns one summary row per (model type, dtype);
    with ``patterns`` (pattern_runs.py) each row also has its patterns' verdicts per reuse path."""
    import time

    listed = list_models(out_dir) if listed is None else listed
    if model_types is not None:
        listed = [m for m in listed if m["model_type"] in model_types]
    rows, done = [], ({} if shared is None else shared)
    for m in listed:
        for dt in dtypes:
            key = (m.get("runs_as") or m["model_type"], dt)
            t0 = time.monotonic()
            if key in done:
                res = dict(done[key], model_type=m["model_type"])
                if out_dir:
                    record_verdict(out_dir, res)
            else:
                res, _ = run_patterns(m["model_type"], patterns, run_diff, dtype=dt, scenarios=scenarios,
                                      seed=seed, out_dir=out_dir, cover=True)
                done[key] = res
            row = summary_row(res)
            row["seconds"] = round(time.monotonic() - t0, 2)
            row["layer_kinds"] = m["layer_kinds"]
            rows.append(row)
            if progress:
                progress(row)
    return rows


def summary_row(res: dict[str, Any]) -> dict[str, Any]:
    """One line of the findings table (no scenario detail)."""
    tr = res.get("operation_trace") or {}
    return dict(model_type=res["model_type"], runs_as=res.get("runs_as"), dtype=res["dtype"],
                verdict=res["verdict"], counts=res.get("counts"), max_abs_diff=res.get("max_abs_diff"),
                tolerance=res.get("tolerance"), boundaries=res.get("boundaries"),
                first_divergent_layer=res.get("first_divergent_layer"),
                first_divergent_operation=tr.get("operation"), how=tr.get("how"), recompute=tr.get("recompute"),
                in_recompute=tr.get("in_recompute"), reason=res.get("reason"), relative=tr.get("relative"),
                errors=(res.get("errors") or ([res["error"]] if res.get("error") else []))[:3],
                causal=(res.get("recompute_causality") or {}).get("causal"),
                divergent_suffix_modes=sorted(m for m, v in (res.get("suffix_modes") or {}).items()
                                              if "divergent" in v),
                clean_suffix_modes=sorted(m for m, v in (res.get("suffix_modes") or {}).items()
                                          if v and set(v) <= {"exact", "within-tolerance"}),
                kinds=sorted({k for layer in res.get("cache_objects") or [] if isinstance(layer, dict)
                              for k in layer["objects"].values()}),
                **({"patterns": res["patterns"], "default_verdict": res.get("default_verdict")}
                   if res.get("patterns") else {}))


def render_text(res: dict[str, Any], code: int) -> str:
    """The human summary of one run: derived config, boundaries, scenarios, the traced operation."""
    head = (f"kvcheck diff --sut transformers: {res['model_type']}"
            + (f" (run as {res['runs_as']})" if res.get("runs_as") not in (None, res["model_type"]) else "")
            + f" ({res['dtype']}, transformers {res['transformers_version']}): {res['verdict']} (exit {code})")
    lines = [head]
    if res["verdict"] == "unsupported":
        return "\n".join(lines + [f"  unsupported: {res['reason']}"])
    cfg = res.get("derived_config") or {}
    lines.append("  derived config: " + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(cfg.items())))
    if res.get("sizes") == "ratios":   # --sizes ratios: the model's own granularities, scaled together
        fields = [f"{k} {f['default']}->{f['scaled']}" + (" (capped)" if f.get("capped") else "")
                  for k, f in (res.get("size_fields") or {}).items()]
        lines.append(f"  sizes: ratios, scale {res.get('scale')} ({res.get('scale_rule')}): "
                     + (', '.join(fields) or 'none'))
    lines.append("  boundaries: " + (", ".join(f"{k}={v}" for k, v in res.get("boundaries", {}).items())
                                     or "none declared"))
    if isinstance(res.get("cache_objects"), list):
        kinds = sorted({k for layer in res["cache_objects"] for k in layer["objects"].values()})
        lines.append("  cache objects: " + (", ".join(kinds) or "none"))
        if RECURRENT in kinds:
            lines.append(f"    {RECURRENT_NOTE}")
    if "tolerance" in res:
        lines.append(f"  tolerance {res['tolerance']:.3g}; " + ", ".join(f"{k} {v}" for k, v in res["counts"].items()))
    if res.get("error") and not res.get("scenarios"):
        lines.append(f"  error: {res['error']}")
    lines.append(f"  {'prefix':>6} {'boundary':22} {'suffix':14} {'max|dlogit|':>12} verdict")
    for sc in res.get("scenarios", []):
        d = sc.get("max_abs_diff")
        tag = str(sc.get("prefix_boundary", ""))
        tag = tag if len(tag) <= 22 else tag[:21] + "…"
        lines.append(f"  {sc['prefix_len']:>6} {tag:22} {sc['suffix_mode']:14} "
                     f"{(f'{d:12.3g}' if isinstance(d, (int, float)) else str(d)):>12} {sc['verdict']}"
                     + (f"  layer {sc.get('first_divergent_layer')}" if sc["verdict"] == "divergent" else "")
                     + (f"  {sc['error']}" if sc["verdict"] == "error" else "")
                     + (f"  {sc['reason']}" if sc["verdict"] == "unsupported" else ""))
    tr = res.get("operation_trace")
    if tr:
        lines.append(f"  first divergent operation (scenario {tr.get('scenario')}, layer {tr.get('layer')}): "
                     f"{tr.get('operation')}: {tr.get('how')}")
        if tr.get("recompute"):
            lines.append(f"    {tr['recompute']}")
    return "\n".join(lines)
