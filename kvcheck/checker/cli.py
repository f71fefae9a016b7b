"""The `kvcheck` command line.

Owns argument parsing, exit codes (brief §6), and turning every bad input into one clear line
on stderr with exit code 2. Every command has `--json`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .. import __version__
from ..spec import faults as faultlib
from ..spec.actions import ACTIONS
from ..spec.config import Config, ConfigError
from ..spec.invariants import INVARIANTS
from ..spec.objects import DECISION_KINDS, OBJECTS, REASONS
from ..spec.state import BLOCK_FIELDS, GLOBAL_FIELDS, OBJ_FIELDS, REQ_FIELDS
from ..spec.system import Spec
from ..spec.trace import Trace, TraceError
from ..fuzz.suts import SutError
from .gate import EXIT_DIFF, EXIT_USAGE, run_gate

FUNNEL = [
    {"layer": 1, "name": "lcm_alignment",
     "checks": "the hit is a whole number of LCM pages across all cache groups",
     "reasons": ["lcm_alignment"]},
    {"layer": 2, "name": "fingerprint",
     "checks": "kernel ABI / layout and version stamps (model, compressor, indexer) of every "
               "present object match the current ones", "reasons": ["abi_mismatch", "model_version", "indexer_version"]},
    {"layer": 3, "name": "group_intersection",
     "checks": "every cache group's recovery condition holds (intersection, not union): entries "
               "compressed, tail at the hit point, window pages present, indexer synced; on-disk "
               "copies in flight are not ready",
     "reasons": ["compressed_missing", "tail_missing", "window_incomplete", "indexer_lagging", "on_disk_not_ready"]},
    {"layer": 4, "name": "hardware_alignment",
     "checks": "every physical address the resume reads is hardware-aligned", "reasons": ["misaligned"]},
]

EXIT_CODES = """exit codes:
  0   holds            10  invariant violated      11  differential mismatch
  2   usage/bad input  12  Z3 counterexample       13  spec/SUT conformance mismatch
  3   could not decide (coverage below the profile minimum, solver unknown)"""


class UsageError(Exception):
    """Bad input: one line on stderr, exit 2."""


def _emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print(text())


def _config(args: argparse.Namespace) -> Config:
    return Config.load(getattr(args, "config", None))


# ---- commands ---------------------------------------------------------------------------

def cmd_spec(args: argparse.Namespace) -> int:
    cfg = _config(args)
    spec = Spec(cfg)
    data = {
        "objects": [{"name": o.name, "layers": o.layers, "states": list(o.states),
                     "recovery_condition": o.recovery_condition, "hit_validation": o.hit_validation,
                     "eviction": o.eviction, "cost_of_loss": o.cost_of_loss} for o in OBJECTS],
        "actions": [{"name": a.name, "doc": a.doc,
                     "instances": sum(1 for i in spec.instances if i.action == a.name),
                     "params": sorted({k for i in spec.instances if i.action == a.name for k in i.params})}
                    for a in ACTIONS.values()],
        "funnel": FUNNEL,
        "invariants": [{"name": i.name, "kind": i.kind, "doc": i.doc} for i in INVARIANTS.values()],
        "decisions": list(DECISION_KINDS),
        "degradation_reasons": [name for name, _ in REASONS],
        "state": {"per_object": OBJ_FIELDS, "per_block": BLOCK_FIELDS, "per_request": REQ_FIELDS,
                  "global": GLOBAL_FIELDS, "slots": spec.lay.size},
        "groups": [{"name": g.name, "layers": list(g.layers), "window": g.window, "m": g.m,
                    "topk": g.topk, "objects": list(g.objects)} for g in cfg.groups],
        "config": cfg.to_dict(),
    }

    def text() -> str:
        lines = [f"kvcheck spec: {len(cfg.layers)} layers in {len(cfg.groups)} cache groups, "
                 f"{cfg.blocks} blocks x {cfg.block_size} tokens, {cfg.requests} requests; "
                 f"{spec.lay.size} state slots, {len(spec.instances)} action instances", "", "objects:"]
        lines += [f"  {o.name:14} {o.layers}\n  {'':14} recovery: {o.recovery_condition}" for o in OBJECTS]
        lines += ["", "funnel:"] + [f"  {f['layer']}. {f['name']}: {f['checks']}" for f in FUNNEL]
        lines += ["", "decisions: " + " | ".join(DECISION_KINDS), "", "actions:"]
        lines += [f"  {a['name']:18} {a['doc']}" for a in data["actions"]]
        lines += ["", "invariants:"] + [f"  {i.name:26} [{i.kind}] {i.doc}" for i in INVARIANTS.values()]
        return "\n".join(lines)

    _emit(args, data, text)
    return 0


def cmd_faults(args: argparse.Namespace) -> int:
    try:
        import kvcheck.reference.faults  # noqa: F401  (registers the engine's faults)
    except ImportError:
        pass
    data = {"faults": [f.to_dict() for f in faultlib.FAULTS.values()]}

    def text() -> str:
        lines = [f"{len(faultlib.FAULTS)} faults (a fault counts as caught only by its expected check):", ""]
        for f in faultlib.FAULTS.values():
            lines.append(f"  {f.name:34} [{f.layer}] expected: {f.expected}")
            lines.append(f"  {'':34} {f.bug_class}; mirrors: {f.mirrors}")
        return "\n".join(lines)

    _emit(args, data, text)
    return 0


def _progress_enabled(args: argparse.Namespace) -> bool:
    return not args.json and sys.stderr.isatty() and not os.environ.get("CI")


@contextmanager
def _progress(args: argparse.Namespace, label: str) -> Iterator[Callable[..., None] | None]:
    """A transient progress bar on a terminal; None (quiet) in CI, in pipes and with --json.
    The callback takes (completed, total=None) or a description string."""
    if not _progress_enabled(args):
        yield None
        return
    from rich.progress import Progress
    bar = Progress(transient=True)
    bar.start()
    task = bar.add_task(label, total=None)

    def update(done: int | str, total: int | None = None) -> None:
        if isinstance(done, str):
            bar.update(task, description=done)
        else:
            bar.update(task, completed=done, total=total)
    try:
        yield update
    finally:
        bar.stop()


def cmd_gate(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if args.fault is not None:
        faultlib.get(args.fault)
    out = Path(args.out)
    _check_writable(out)
    with _progress(args, "random walks") as progress:
        code, rep = run_gate(cfg, out, args.config, args.fault, args.seed, args.steps, progress=progress)

    def text() -> str:
        w = rep["engines"]["walk"]
        cov = w["coverage"]
        lines = [f"kvcheck gate: {rep['verdict']} (exit {code})",
                 f"  walk: {w['steps']} steps, {w['episodes']} episodes, {w['seconds']} s, "
                 f"{w['steps_per_s']} steps/s, {w['invariants_checked']} invariants after every step",
                 "  decisions: " + ", ".join(f"{k} {v}" for k, v in cov["decisions"].items()),
                 f"  actions reached: {sum(1 for v in cov['actions'].values() if v)}/{len(cov['actions'])}",
                 f"  seed: {rep['seed']}   rerun: {rep['command']}"]
        if "violation" in rep:
            v = rep["violation"]
            lines.append(f"  violated: {', '.join(v['invariants'])} at `{v['action']}`")
            if "fault_result" in rep:
                fr = rep["fault_result"]
                lines.append(f"  fault {rep['fault']}: expected {fr['expected']} -> "
                             + ("caught" if fr["caught"] else f"MIS-ATTRIBUTED (caught by {', '.join(fr['caught_by'])})"))
            lines.append(f"  shrunk trace ({len(v['trace_steps'])} steps):")
            lines += [f"    {i:3}. {s}" for i, s in enumerate(v["trace_steps"])]
            lines.append(f"  replay: {v['replay']}")
        if rep.get("coverage_missing"):
            lines.append("  coverage below the minimum: " + "; ".join(rep["coverage_missing"]))
        if rep.get("fault_result") and not rep["fault_result"]["caught"] and "violation" not in rep:
            lines.append(f"  fault {rep['fault']} SURVIVED: no violation within the budget")
        lines.append(f"  report: {out / 'report.md'}")
        return "\n".join(lines)

    _emit(args, rep, text)
    return code


def cmd_replay(args: argparse.Namespace) -> int:
    from .replay import replay_trace, sut_by_name
    trace = Trace.load(args.trace)
    if args.sut == "sglang" or (args.sut is None and trace.sut == "sglang"):   # sglang hunk
        from ..fuzz.adapters import sglang as sg
        try:
            res = sg.replay(trace)
        except (sg.SglangUnavailable, sg.LayoutError) as e:
            raise UsageError(str(e)) from None
        _emit(args, res, lambda: f"kvcheck replay {args.trace} on SGLang {res['sglang_version']}: "
              + ("reproduced " + str(res["expected"]) if res["reproduced"] else "not reproduced")
              + f" (exit {res['exit_code']})")
        return res["exit_code"]
    if args.sut == "vllm" or (args.sut is None and trace.sut == "vllm"):
        from ..fuzz.adapters import vllm as v
        try:
            res = v.replay(trace)
        except v.VllmUnavailable as e:
            raise UsageError(str(e)) from None
        _emit(args, res, lambda: f"kvcheck replay {args.trace} on vLLM: "
              + ("reproduced: " + str(res.get("violation")) if res.get("reproduced") else "not reproduced")
              + f" (exit {res['exit_code']})")
        return res["exit_code"]
    try:
        sut = sut_by_name(args.sut, trace.meta.get("sut_fault", trace.fault)) if args.sut else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    code, out = replay_trace(trace, sut)

    def text() -> str:
        lines = [f"kvcheck replay {args.trace}: {out['steps']} steps on the spec"
                 + (f" and {out['sut']}" if out.get("sut") else "")
                 + (f" (fault {out['fault']})" if out.get("fault") else "")]
        if "divergence" in out:
            d = out["divergence"]
            lines.append(f"  diverged at step {d['step']} `{d['action']}`: {d['why']}")
        if "differential" in out:
            d = out["differential"]
            lines.append(f"  reuse != recompute at step {d['step']} `{d['action']}`: {d['why']}")
        if "violation" in out:
            v = out["violation"]
            lines.append(f"  reproduced: {', '.join(v['invariants'])} violated at step {v['step']} `{v['action']}`")
            lines += [f"    {w}" for w in v["where"][:5]]
        if not {"divergence", "differential", "violation"} & set(out):
            lines.append("  every step enabled, decisions as recorded, no invariant violated")
        lines.append(f"  exit {code}")
        return "\n".join(lines)

    out["exit_code"] = code
    _emit(args, out, text)
    return code


def cmd_diff(args: argparse.Namespace) -> int:
    """Reuse vs full recompute. `--sut transformers`: a Hugging Face model built from a config."""
    if args.scenarios is None:
        args.scenarios = 200 if args.sut == "reference" else 20
    if args.sut == "reference":
        return _diff_reference(args)
    if args.backend != "torch":
        raise UsageError("--backend applies to --sut reference only")
    from ..fuzz.adapters import transformers as hf
    if not args.model_type:
        raise UsageError("--sut transformers needs --model-type NAME (supported: "
                         + ", ".join(hf.SUPPORTED_MODEL_TYPES) + ")")
    try:
        res = hf.run_diff(args.model_type, config_json=args.config_json, dtype=args.dtype,
                          scenarios=args.scenarios, seed=args.seed, fault=args.fault)
    except hf.AdapterError as e:
        raise UsageError(str(e)) from None
    code = EXIT_DIFF if res["verdict"] == "divergent" else 0
    res["exit_code"] = code
    res["command"] = " ".join(["kvcheck", "diff", "--sut", "transformers", "--model-type", args.model_type,
                               "--dtype", args.dtype, "--scenarios", str(args.scenarios), "--seed", str(args.seed)]
                              + (["--config-json", args.config_json] if args.config_json else [])
                              + (["--fault", args.fault] if args.fault else []))

    def text() -> str:
        lines = [f"kvcheck diff --sut transformers: {res['model_type']} ({res['dtype']}, transformers "
                 f"{res['transformers_version']}): {res['verdict']} (exit {code})",
                 f"  tolerance {res['tolerance']:.3g} ({res.get('tolerance_method', 'calibrated')})",
                 "  " + ", ".join(f"{k} {v}" for k, v in res["counts"].items()),
                 f"  {'prefix':>6} {'boundary':16} {'suffix':14} {'max|dlogit|':>12} {'first pos':>9} "
                 f"{'flips':>5} verdict"]
        for sc in res["scenarios"]:
            lines.append(f"  {sc['prefix_len']:>6} {str(sc.get('prefix_boundary', '')):16} "
                         f"{sc['suffix_mode']:14} {sc['max_abs_diff']:12.3g} "
                         f"{str(sc.get('first_divergent_position')):>9} {sc.get('argmax_flips', 0):>5} "
                         f"{sc['verdict']}" + (f"  layer {sc.get('first_divergent_layer')}"
                                               if sc["verdict"] == "divergent" else ""))
        lines.append(f"  seed {args.seed}; rerun: {res['command']}")
        return "\n".join(lines)

    _emit(args, res, text)
    return code


def _diff_reference(args: argparse.Namespace) -> int:
    """Reuse vs recompute on the reference engine, bitwise, over generated workloads."""
    from ..fuzz import diff as refdiff
    from ..reference import engine as refengine
    import kvcheck.reference.faults  # noqa: F401  (registers the engine's faults)
    cfg = Config.load(args.config)
    if args.fault is not None and faultlib.get(args.fault).layer != "engine":
        raise UsageError(f"fault {args.fault!r} is a {faultlib.get(args.fault).layer} fault; "
                         "`kvcheck diff --sut reference` plants engine faults")
    if args.model_type or args.config_json:
        raise UsageError("--model-type/--config-json apply to --sut transformers only")
    out = Path(args.out)
    _check_writable(out)
    from ..reference import adapter as refadapter
    if args.cache_dir:
        _check_writable(Path(args.cache_dir), "cache directory")
        refadapter.CACHE_ROOT = args.cache_dir
    refengine.use_backend(args.backend)
    try:
        res = refdiff.run_reference_diff(args.scenarios, args.seed, args.fault, out, cfg)
        if args.backend != "torch":
            res["cross_backend"] = _cross_backend(cfg, args.backend, args.seed)
    finally:
        refengine.use_backend("torch")
        refadapter.CACHE_ROOT = None
    res["backend"] = args.backend
    code = res["exit_code"]
    if args.backend != "torch" and code == 0 and not res["cross_backend"]["within_1e-5"]:
        code = res["exit_code"] = EXIT_DIFF
    cmd = ["kvcheck", "diff", "--sut", "reference", "--scenarios", str(args.scenarios), "--seed", str(args.seed)]
    cmd += (["--backend", args.backend] if args.backend != "torch" else []) + \
        (["--config", args.config] if args.config else []) + (["--fault", args.fault] if args.fault else [])
    res["command"] = " ".join(cmd)

    def text() -> str:
        lines = [f"kvcheck diff --sut reference ({args.backend}): "
                 f"{'bitwise equal' if res.get('bitwise_equal') else 'MISMATCH'} (exit {code})",
                 f"  {res['scenarios']} scenarios; decisions: "
                 + ", ".join(f"{k} {v}" for k, v in res["decisions"].items()),
                 "  objects exercised: " + ", ".join(f"{k} {v}" for k, v in res["objects_exercised"].items()),
                 f"  logical hit rate {res['logical_hit_rate']}, usable hit rate {res['usable_hit_rate']}",
                 "  degradations: " + (", ".join(f"{k} {v}" for k, v in res["degradations"].items()) or "none")]
        if "cross_backend" in res:
            cb = res["cross_backend"]
            lines.append(f"  {args.backend} vs torch: max relative difference {cb['max_rel_diff']:.2e} "
                         f"over {cb['sequences']} sequences ({'within' if cb['within_1e-5'] else 'NOT within'} 1e-5)")
        for m in res.get("mismatches", []):
            lines.append(f"  FINDING [{m.get('kind', 'mismatch')}] {', '.join(m.get('checks', []))}: {m.get('message', '')}")
            if m.get("replay"):
                lines.append(f"    replay: {m['replay']}")
        lines.append(f"  seed {args.seed}; rerun: {res['command']}")
        return "\n".join(lines)

    _emit(args, res, text)
    return code


def _cross_backend(cfg: Config, backend: str, seed: int, sequences: int = 3) -> dict[str, Any]:
    """The other backend's logits agree with the torch backend's (reduction orders differ)."""
    import random as _random

    from ..reference.model import HybridLM
    rng = _random.Random(seed)
    ref, other = HybridLM(cfg, seed=cfg.seed), HybridLM(cfg, seed=cfg.seed, backend=backend)
    worst = 0.0
    for _ in range(sequences):
        toks = [rng.randrange(256) for _ in range(rng.randrange(8, 3 * cfg.block_size * cfg.blocks))]
        a, b = ref.prefill(toks)[0], other.prefill(toks)[0]
        worst = max(worst, float((a - b).abs().max() / a.abs().max().clamp_min(1e-12)))
    return {"sequences": sequences, "max_rel_diff": worst, "within_1e-5": worst <= 1e-5}


def _fuzz_vllm(args: argparse.Namespace) -> int:
    """vLLM's KV cache manager: its own driver per layout (kvcheck/fuzz/adapters/vllm.py)."""
    from ..fuzz.adapters import vllm as v
    from ..fuzz.campaign import Budget
    if args.list_layouts:
        _emit(args, {"layouts": v.LAYOUTS},
              lambda: "\n".join(f"  {k:22} {d}" for k, d in v.LAYOUTS.items()))
        return 0
    if not args.layout:
        raise UsageError("--sut vllm needs --layout NAME (see --list-layouts)")
    try:
        budget = Budget.parse(args.budget)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.fault is not None and args.fault not in v.FAULTS:
        raise UsageError(f"unknown fault {args.fault!r} for --sut vllm; known: {', '.join(v.FAULTS)}")
    out = Path(args.out)
    _check_writable(out)
    try:
        res = v.run_campaign(args.layout, budget_s=budget.seconds, steps=budget.steps, seed=args.seed,
                             strict_reuse=args.strict_reuse, fault=args.fault, out_dir=str(out))
    except v.VllmUnavailable as e:
        raise UsageError(str(e)) from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    code = res["exit_code"]
    cmd = ["kvcheck", "fuzz", "--sut", "vllm", "--layout", args.layout, "--budget", args.budget,
           "--seed", str(args.seed)] + (["--strict-reuse"] if args.strict_reuse else []) \
        + (["--fault", args.fault] if args.fault else [])
    res["command"] = " ".join(cmd)

    def text() -> str:
        lines = [f"kvcheck fuzz --sut vllm --layout {args.layout}: exit {code} (vLLM {res.get('vllm_version')})",
                 f"  {res.get('steps')} steps, seed {args.seed}; rerun: {res['command']}",
                 "  actions: " + ", ".join(f"{k} {n}" for k, n in sorted(res.get("coverage", {}).items())
                                           if isinstance(n, int))]
        for f in res.get("findings", []):
            lines.append(f"  FINDING [{f['kind']}] {f.get('check', '')}: {f['message']}")
            if f.get("replay"):
                lines.append(f"    replay: {f['replay']}")
        return "\n".join(lines)

    _emit(args, res, text)
    return code


def cmd_fuzz(args: argparse.Namespace) -> int:
    """Hypothesis stateful campaign against a system under test, in lockstep with the spec."""
    if args.sut == "sglang":                                                   # sglang hunk
        from ..fuzz.adapters import sglang as sg
        from ..fuzz.campaign import Budget
        try:
            b = Budget.parse(args.budget)
            _check_writable(Path(args.out))
            res, text = sg.cli_fuzz(args.layout, args.layout_file, args.list_layouts, b.seconds, b.steps,
                                    args.seed, args.fault, args.out)
        except (sg.SglangUnavailable, ValueError) as e:
            raise UsageError(str(e)) from None
        _emit(args, res, lambda: text)
        return 0 if args.list_layouts else res["exit_code"]
    if args.sut == "vllm":
        if args.observability:
            raise UsageError("--observability applies to the Hypothesis machines (not --sut vllm)")
        return _fuzz_vllm(args)
    if args.list_layouts or args.layout or args.strict_reuse:
        raise UsageError("--list-layouts/--layout/--strict-reuse apply to --sut vllm only")
    from ..fuzz.campaign import Budget, run_campaign, run_workers
    cfg = _config(args)
    try:
        budget = Budget.parse(args.budget)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.fault is not None:
        _check_sut_fault(args.sut, args.fault)
    out = Path(args.out)
    _check_writable(out)
    obs = Path(args.observability) if args.observability else None
    if obs is not None:
        if obs.is_dir():
            raise UsageError(f"--observability wants a file, {obs} is a directory")
        _check_writable(obs.parent, "observability directory")
    if args.workers > 1:
        res = run_workers(cfg, args.sut, budget, args.seed, args.fault, args.db, out, args.workers, obs)
    else:
        with _progress(args, f"fuzz {args.sut} ({budget.describe()})") as progress:
            res = run_campaign(cfg, args.sut, budget, args.seed, args.fault, args.db, out,
                               progress=progress, observability=obs)
    cmd = ["kvcheck", "fuzz", "--sut", args.sut, "--budget", args.budget, "--seed", str(args.seed)]
    if args.config:
        cmd += ["--config", args.config]
    if args.fault:
        cmd += ["--fault", args.fault]
    res["command"] = " ".join(cmd)
    code = res["exit_code"]
    if code == 0 and res["coverage"]["actions_missing"] and not res.get("interrupted"):
        res["verdict"] = "undecided: actions never exercised"
        code = res["exit_code"] = 3
    else:
        res.setdefault("verdict", "holds" if code == 0 else "failed")

    def text() -> str:
        lines = [f"kvcheck fuzz --sut {args.sut}: {res['verdict']} (exit {code})",
                 f"  {res['steps']} steps in {res['seconds']} s ({res['steps_per_s']} steps/s), "
                 f"budget {budget.describe()}" + (", interrupted" if res.get("interrupted") else ""),
                 "  decisions: " + ", ".join(f"{k} {v}" for k, v in res["coverage"]["decisions"].items()),
                 f"  actions exercised: {len(res['coverage']['actions'])}"
                 + (f"; never: {', '.join(res['coverage']['actions_missing'])}" if res["coverage"]["actions_missing"] else ""),
                 f"  seed {args.seed}; rerun: {res['command']}"]
        for f in res["findings"]:
            lines.append(f"  FINDING [{f['kind']}] {', '.join(f['checks'])}: {f['message']}")
            lines += [f"    {i:3}. {s}" for i, s in enumerate(f["trace_steps"])]
            lines.append(f"  trace: {f['trace']}\n  reproducer: {f['reproducer']}\n  replay: {f['replay']}")
        return "\n".join(lines)

    _emit(args, res, text)
    return code


def cmd_mutants(args: argparse.Namespace) -> int:
    """The fault matrix: every fault, every engine that applies, caught by the expected check?"""
    from ..fuzz.campaign import Budget
    from .mutants import run_mutants
    cfg = _config(args)
    try:
        budget = Budget.parse(args.budget_per_fault)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if budget.seconds is None:
        raise UsageError("--budget-per-fault must be a duration such as 30s")
    try:
        import kvcheck.reference.faults  # noqa: F401  (registers the engine faults)
    except ImportError:
        pass
    for name in args.fault or []:
        faultlib.get(name)
    def row_done(r: dict) -> None:      # each fault's verdict as it lands, on stderr
        cells = ", ".join(f"{e} {'OK' if x['expected_caught'] else 'other' if x['detected'] else 'miss'} "
                          f"{x['seconds']}s" for e, x in r["engines"].items())
        print(f"kvcheck mutants: {r['fault']}: {r['status']} ({cells})", file=sys.stderr, flush=True)

    with _progress(args, "mutants") as progress:
        res = run_mutants(cfg, budget.seconds, args.seed, args.fault, progress=progress, on_row=row_done,
                          workers=args.workers)
    code = res["exit_code"]

    def text() -> str:
        lines = [f"kvcheck mutants: score {res['mutation_score']:.0%} ({res['killed']}/{res['scored']} "
                 f"killed by their expected check), negative control "
                 + ("clean" if res["negative_control_clean"] else "NOT CLEAN") + f" (exit {code})", ""]
        engines = sorted({e for r in res["faults"] for e in r["engines"]})
        lines.append(f"  {'fault':34} {'expected':26} " + " ".join(f"{e:>14}" for e in engines))
        for r in res["faults"]:
            cells = []
            for e in engines:
                x = r["engines"].get(e)
                cells.append(f"{'-':>14}" if x is None else
                             f"{('OK ' if x['expected_caught'] else 'other ' if x['detected'] else 'miss ') + str(x['seconds']) + 's':>14}")
            lines.append(f"  {r['fault']:34} {r['expected']:26} " + " ".join(cells))
        for s in res["survivors"]:
            lines.append(f"  SURVIVOR {s['fault']}: {s['why']}")
        for m in res["misattributed"]:
            lines.append(f"  MIS-ATTRIBUTED {m['fault']}: expected {m['expected']}, got {m['caught_by']}")
        return "\n".join(lines)

    _emit(args, res, text)
    return code


def _check_sut_fault(sut: str, fault: str) -> None:
    """Spec faults for --sut spec; a user SUT declares its own in a `faults` dict."""
    if sut == "reference":
        import kvcheck.reference.faults  # noqa: F401  (registers the engine's faults)
        if faultlib.get(fault).layer != "engine":
            raise UsageError(f"fault {fault!r} is a {faultlib.get(fault).layer} fault; "
                             "--sut reference plants engine faults")
        return
    if ":" not in sut:
        faultlib.get(fault)
        return
    from ..fuzz.suts import resolve_sut
    cls = resolve_sut(sut)
    known = getattr(cls, "faults", {}) or {}
    if fault not in known:
        raise UsageError(f"unknown fault {fault!r} for --sut {sut}; it declares: "
                         + (", ".join(sorted(known)) or "none"))


def _check_writable(out: Path, what: str = "output directory") -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".kvcheck-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"cannot write to {what} {out}: {e.strerror or e}") from None


# ---- parser ----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcheck",
        description="Verify prefix-cache reuse in hybrid-attention LLM serving: a prefix-cache "
                    "hit must be usable (every per-layer cache object complete, current and "
                    "readable) and reuse must equal a full recompute.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"kvcheck {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str, config: bool = True):
        sp = sub.add_parser(name, help=help, description=help, epilog=EXIT_CODES,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        if config:
            sp.add_argument("--config", metavar="FILE", help="JSON config (default: the embedded default)")
        sp.set_defaults(fn=fn)
        return sp

    add("spec", cmd_spec, "describe the executable spec: objects, actions, funnel, invariants, decisions")
    add("faults", cmd_faults, "list every planted fault and the check expected to catch it", config=False)
    g = add("gate", cmd_gate, "the CI profile: run every engine at CI bounds, one verdict, a report")
    g.add_argument("--out", metavar="DIR", default="kvcheck-report", help="report directory (default: %(default)s)")
    g.add_argument("--fault", metavar="NAME", help="plant a fault; the run must fail with its expected invariant")
    g.add_argument("--seed", type=int, default=0, help="seed of every random choice (default: %(default)s)")
    g.add_argument("--steps", type=_positive_int, default=None,
                   help="walk steps (default: 10000 clean, up to 400000 with --fault)")
    r = add("replay", cmd_replay, "replay a trace on the spec (and a system under test)", config=False)
    r.add_argument("trace", metavar="TRACE", help="trace file (JSON, kvcheck-trace/1)")
    r.add_argument("--sut", metavar="NAME", help="also replay on this system under test: spec, reference, "
                   "vllm or MODULE:CLASS (vllm traces replay on vLLM by default)")
    z = add("fuzz", cmd_fuzz, "Hypothesis stateful campaign: drive a system under test in lockstep with the spec")
    z.add_argument("--sut", default="spec", metavar="NAME",
                   help="spec (default), reference, vllm, or MODULE:CLASS implementing "
                        "kvcheck.spec.sut.SystemUnderTest")
    z.add_argument("--budget", default="60s", help="time (60s, 5m) or steps (20000) (default: %(default)s)")
    z.add_argument("--seed", type=int, default=0, help="campaign seed (default: %(default)s)")
    z.add_argument("--workers", type=_positive_int, default=1, help="processes sharing the example database")
    z.add_argument("--fault", metavar="NAME", help="plant a fault in the SUT")
    z.add_argument("--db", metavar="DIR", help="Hypothesis example database directory (replayed first)")
    z.add_argument("--out", metavar="DIR", default="kvcheck-report", help="where traces go (default: %(default)s)")
    z.add_argument("--observability", metavar="FILE",
                   help="append Hypothesis observability records (JSON lines: one per test case, "
                        "with its status, features and timing) to FILE; with --workers N, one file "
                        "per worker (FILE.wK.jsonl)")
    z.add_argument("--layout", metavar="NAME", help="--sut vllm: the hybrid layout to drive")
    z.add_argument("--list-layouts", action="store_true", help="--sut vllm|sglang: list the layouts")
    z.add_argument("--layout-file", metavar="FILE", help="--sut sglang: a layout of your own (JSON)")
    z.add_argument("--strict-reuse", action="store_true",
                   help="--sut vllm: lost reuse (spec-usable hit > vLLM hit) fails the run (exit 13)")
    m = add("mutants", cmd_mutants, "fault matrix: which engine catches each planted fault, with which check")
    m.add_argument("--budget-per-fault", default="30s", help="per fault and engine (default: %(default)s)")
    m.add_argument("--fault", nargs="*", metavar="NAME", help="only these faults (default: all)")
    m.add_argument("--seed", type=int, default=0, help="seed (default: %(default)s)")
    m.add_argument("--workers", type=_positive_int, default=1,
                   help="faults run in this many processes, one core each (default: %(default)s)")
    d = add("diff", cmd_diff, "differential oracle: output with cache reuse vs a full recompute")
    d.add_argument("--sut", default="reference", choices=["reference", "transformers"],
                   help="system under test (default: %(default)s)")
    d.add_argument("--backend", default="torch", choices=["torch", "triton"],
                   help="kernel backend of the reference model (default: %(default)s; triton runs in "
                        "interpreter mode without a GPU)")
    d.add_argument("--out", metavar="DIR", default="kvcheck-report", help="where reproducers go (default: %(default)s)")
    d.add_argument("--cache-dir", metavar="DIR", help="reference engine: put the disk tier here "
                   "(default: a fresh temporary directory per engine)")
    d.add_argument("--model-type", metavar="NAME", help="transformers model_type (e.g. mistral, gemma3_text)")
    d.add_argument("--config-json", metavar="FILE", help="JSON overrides of the tiny default model config")
    d.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"],
                   help="model dtype (default: %(default)s)")
    d.add_argument("--scenarios", type=_positive_int, default=None,
                   help="scenarios (default: 200 for the reference engine, 20 for transformers)")
    d.add_argument("--seed", type=int, default=0, help="seed of every random choice (default: %(default)s)")
    d.add_argument("--fault", metavar="NAME", help="plant a fault: an engine fault (`kvcheck faults`) for the "
                   "reference engine; drop_window_position or perturb_key[@LAYER] for transformers")
    pr = add("prove", _lazy("prove", "cmd_prove"), "Z3: inductive proofs of every invariant, BMC, hit soundness")
    pr.add_argument("--blocks", type=_positive_int, default=None, help="override config.blocks")
    pr.add_argument("--depth", type=int, default=None, help="BMC depth (default: 4 clean, 14 when induction fails)")
    pr.add_argument("--fault", metavar="NAME", help="plant a spec fault; BMC must find it")
    pr.add_argument("--out", metavar="DIR", default=None, help="write prove.json and traces here")
    ex = add("explore", _lazy("explore", "cmd_explore"), "exhaustive explicit-state exploration of the spec (BFS)")
    ex.add_argument("--max-states", type=_positive_int, default=2_000_000, help="state budget (default: %(default)s)")
    ex.add_argument("--fault", metavar="NAME", help="plant a spec fault; BFS finds the shortest violation")
    ex.add_argument("--graph", metavar="FILE", default=None, help="export the state graph (.graphml, or .dot)")
    ex.add_argument("--out", metavar="DIR", default=None, help="write explore.json, diagrams and traces here")
    rp = add("report", _lazy("report", "cmd_report"), "render the report directory as Markdown (and HTML)", config=False)
    rp.add_argument("--in", dest="in_dir", metavar="DIR", default="kvcheck-report", help="report directory (default: %(default)s)")
    rp.add_argument("--html", action="store_true", help="also write one self-contained report.html")
    return p


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import importlib
        return getattr(importlib.import_module(f"kvcheck.checker.{module}"), name)(args)
    return run


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.fn(args)
    except (ConfigError, TraceError, faultlib.UnknownFault, UsageError, SutError) as e:
        print(f"kvcheck {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"kvcheck {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
