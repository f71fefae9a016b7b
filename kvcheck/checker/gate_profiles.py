"""The default gate's profiles of the other engines (clean runs, fixed seeds): the Hypothesis
campaigns of the spec and the reference engine, an exhaustive small scope of the reference
engine, the reuse-vs-recompute diff and the smoke mutants; each must hold.

Why an exhaustive pass: the campaigns sample, so their "holds" says nothing of any one short
program; the exhaustive pass runs every program of the reference engine up to a few steps
(fuzz/exhaustive.py), so the gate also says "no finding within depth K", and a bug reachable
that early is found with a shortest trace. Its budget is a count of steps, not seconds: the
verdict does not depend on the machine's speed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..spec.config import Config
from ..spec.verdict import ExitCode


@dataclass(frozen=True)
class CiProfiles:
    """Fixed-seed profiles of the other engines, sized so the whole gate stays within minutes."""

    fuzz_spec_steps: int = 8000          # both meet the coverage floor (fuzz/floor.py) on seeds 0-9 (spec: 0-11)
    fuzz_reference_steps: int = 3000
    diff_scenarios: int = 30
    mutants_smoke: tuple[str, ...] = ("shared_free_list", "engine_refcount_double_decrement")
    mutants_budget_s: float = 10.0
    # every reference-engine program up to 4 steps: 2,265 programs, 1,136 states, 8,296 steps on
    # the default config (about 5 s); the step budget leaves room for configs a little larger
    exhaustive_depth: int = 4
    exhaustive_steps: int = 40_000


def run_exhaustive_pass(cfg: Config, out: Path, seed: int, depth: int, steps: int | None,
                        fault: str | None = None, sut: str = "reference",
                        seconds: float | None = None) -> dict[str, Any]:
    """Every program of `sut` up to `depth` steps. Complete: "holds to depth K"; a finding fails
    the gate (its shortest trace saved); the budget spent first: undecided (exit 3), raise it or
    lower the depth, the gate claims nothing it did not run."""
    from ..fuzz.budget import Budget
    from ..fuzz.exhaustive import run_exhaustive, summary
    r = run_exhaustive(cfg, sut, depth, Budget(steps=steps, seconds=seconds), fault=fault, out=out, seed=seed)
    if r.get("interrupted"):
        raise KeyboardInterrupt
    keep = ("verdict", "exit_code", "exhaustive", "findings", "seconds")
    return {**{k: r[k] for k in keep}, "summary": summary(r)}


def run_profiles(cfg: Config, out: Path, seed: int, report: dict[str, Any], code: int,
                 prof: CiProfiles = CiProfiles()) -> int:
    """The fuzz, diff and mutants profiles (clean runs): each must hold, the smoke mutants must
    be killed by their expected checks, and the negative control must stay clean."""
    from ..fuzz.campaign import Budget, run_campaign
    from ..fuzz.floor import shortfall as floor_shortfall
    from ..fuzz import registry
    from .mutants import run_mutants
    eng = report["engines"]
    verdicts: list[tuple[str, int]] = []
    for sut, steps in (("spec", prof.fuzz_spec_steps), ("reference", prof.fuzz_reference_steps)):
        r = run_campaign(cfg, sut, Budget(steps=steps), seed=seed, out=out)
        if r.get("interrupted"):
            raise KeyboardInterrupt        # the campaign kept its Ctrl-C: the gate stops too
        why = floor_shortfall({"steps": r["steps"], "examples": r["examples"], **r["coverage"]["decisions"]},
                              r["coverage"]["actions_missing"], r["coverage"]["actions_never_enabled"], r["steps"])
        if r["exit_code"] == ExitCode.OK and why:          # no pass unearned: below the floor
            r["exit_code"], r["verdict"] = int(ExitCode.UNDECIDED), "undecided: " + why
        eng[f"fuzz_{sut}"] = {k: r[k] for k in ("steps", "seconds", "steps_per_s", "coverage", "findings", "exit_code")
                              + (("verdict",) if "verdict" in r else ())}
        verdicts.append((f"fuzz --sut {sut}", r["exit_code"]))
    x = eng["exhaustive_reference"] = run_exhaustive_pass(cfg, out, seed, prof.exhaustive_depth,
                                                          prof.exhaustive_steps)
    verdicts.append(("fuzz --sut reference --exhaustive", x["exit_code"]))
    t = time.monotonic()
    d = registry.get("reference").differential(cfg, prof.diff_scenarios, seed, None, out)
    eng["diff_reference"] = {k: d.get(k) for k in ("scenarios", "decisions", "objects_exercised", "degradations",
                                                    "logical_hit_rate", "usable_hit_rate", "bitwise_equal",
                                                    "mismatches", "exit_code")}
    eng["diff_reference"]["seconds"] = round(time.monotonic() - t, 3)
    t = time.monotonic()
    verdicts.append(("diff --sut reference", d["exit_code"]))
    m = run_mutants(cfg, prof.mutants_budget_s, seed, list(prof.mutants_smoke))
    if m.get("interrupted"):
        raise KeyboardInterrupt
    eng["mutants_smoke"] = {k: m[k] for k in ("mutation_score", "killed", "scored", "survivors",
                                              "misattributed", "negative_control_clean", "exit_code")}
    eng["mutants_smoke"]["faults"] = {r["fault"]: r["status"] for r in m["faults"]}
    eng["mutants_smoke"]["matrix"] = m["faults"]      # full rows (per engine, seconds): the report plots them
    eng["mutants_smoke"]["seconds"] = round(time.monotonic() - t, 3)
    verdicts.append(("mutants smoke", m["exit_code"]))
    if code not in (ExitCode.OK, ExitCode.UNDECIDED):
        return code
    for name, c in verdicts:
        if c not in (ExitCode.OK,):
            why = (eng["exhaustive_reference"]["verdict"] if name.endswith("--exhaustive")
                   else eng.get(f"fuzz_{name.split()[-1]}", {}).get("verdict") if name.startswith("fuzz") else None)
            report["verdict"] = f"{why} ({name})" if why else f"failed ({name}: exit {c})"
            return c
    return code


def render_profiles_md(rep: dict[str, Any]) -> str:
    eng, lines = rep["engines"], []
    for sut in ("spec", "reference"):
        f = eng.get(f"fuzz_{sut}")
        if f:
            lines += ["", f"## Fuzz --sut {sut} (Hypothesis, lockstep with the spec)", "",
                      f"- {f['steps']} steps in {f['seconds']} s ({f['steps_per_s']} steps/s), exit {f['exit_code']}",
                      "- decisions: " + ", ".join(f"{k} {v}" for k, v in f["coverage"]["decisions"].items()),
                      f"- actions never exercised: {', '.join(f['coverage']['actions_missing']) or 'none'}"]
            lines += [f"- FINDING [{x['kind']}] {', '.join(x['checks'])}: replay `{x['replay']}`" for x in f["findings"]]
    x = eng.get("exhaustive_reference")
    if x:
        lines += ["", "## Exhaustive small scope of the reference engine", "", f"- {x['verdict']}",
                  f"- {x['summary']}, exit {x['exit_code']}"]
        lines += [f"- FINDING [{f['kind']}] {', '.join(f['checks'])}: replay `{f['replay']}`" for f in x["findings"]]
    d = eng.get("diff_reference")
    if d:
        lines += ["", "## Diff: reuse vs full recompute on the reference engine", "",
                  f"- {d['scenarios']} scenarios, bitwise equal: {d['bitwise_equal']}, exit {d['exit_code']}",
                  f"- logical hit rate {d['logical_hit_rate']}, usable hit rate {d['usable_hit_rate']}",
                  "- decisions: " + ", ".join(f"{k} {v}" for k, v in d["decisions"].items()),
                  "- objects exercised: " + ", ".join(f"{k} {v}" for k, v in d["objects_exercised"].items())]
    m = eng.get("mutants_smoke")
    if m:
        lines += ["", "## Mutants smoke", "",
                  f"- score {m['mutation_score']:.0%} ({m['killed']}/{m['scored']}); negative control "
                  + ("clean" if m["negative_control_clean"] else "NOT clean"),
                  *[f"- {k}: {v}" for k, v in m["faults"].items()]]
    return "\n".join(lines) + ("\n" if lines else "")
