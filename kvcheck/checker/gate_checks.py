"""The default profile's results as per-check records (report.json "checks" and "findings").

The default gate (no project file) keeps its report as it was; this derives, from the engines
it ran, the same per-(system, engine, check) records a project gate writes, so `--junit` and
the HTML report read one shape either way.
"""
from __future__ import annotations

from typing import Any

from ..spec.config import Config
from .project_engines import LOCKSTEP, check, finding, invariants


def default_checks(rep: dict[str, Any]) -> list[dict[str, Any]]:
    eng = rep.get("engines", {})
    out: list[dict[str, Any]] = []
    invs = invariants(Config.from_dict(rep["config"])) if "config" in rep else []
    w = eng.get("walk")
    if w:
        counts = {"steps": w["steps"], "episodes": w["episodes"]}
        v = rep.get("violation")
        f = finding("invariant", f"at {v['action']}: " + "; ".join(v["where"][:4]), v["replay"], v["trace_steps"]) \
            if v else None
        for n in sorted(set(invs) | set(v["invariants"] if v else [])):
            out.append(check("spec", "walk", n, "failed" if v and n in v["invariants"] else "passed",
                             w["seconds"], counts, f if v and n in v["invariants"] else None))
        miss = rep.get("coverage_missing")
        if miss is not None and not rep.get("fault"):
            out.append(check("spec", "walk", "coverage", "undecided" if miss else "passed", w["seconds"], counts,
                             note=("not reached: " + ", ".join(miss)) if miss else None))
        fr = rep.get("fault_result")
        if fr:
            out.append(_fault_check("walk", rep["fault"], fr, w["seconds"]))
    p = eng.get("prove")
    if p:
        for o in p["invariants"]:
            ok = o["status"] == "proved"
            out.append(check("spec", "prove", o["name"], "passed" if ok else "failed", p["seconds"],
                             {"bmc_depth": p["bmc"].get("checked")},
                             None if ok else finding("z3", f"{o['name']}: {o['status']}", "kvcheck prove", [])))
    e = eng.get("explore")
    if e:
        counts = {k: e.get(k) for k in ("states", "transitions", "depth")}
        v = e.get("violation")
        out.append(check("spec", "explore", "invariants", "failed" if v and not e.get("fault_result") else "passed",
                         e["seconds"], counts, finding("invariant", ", ".join(v["invariants"]), v.get("replay"), [])
                         if v and not e.get("fault_result") else None))
        out.append(check("spec", "explore", "deadlocks", "failed" if e.get("deadlocks") else "passed", e["seconds"],
                         counts, finding("deadlock", f"{e['deadlocks']} deadlocked states", "kvcheck explore", [])
                         if e.get("deadlocks") else None))
        if e.get("fault_result"):
            out.append(_fault_check("explore", rep["fault"], e["fault_result"], e["seconds"]))
    for sut in ("spec", "reference"):
        z = eng.get(f"fuzz_{sut}")
        if not z:
            continue
        counts = {"steps": z["steps"], **z["coverage"]["decisions"]}
        failed = {c: finding(x["kind"], x["message"], x["replay"], x["trace_steps"])
                  for x in z["findings"] for c in x["checks"]}
        names = list(dict.fromkeys(invs + list(LOCKSTEP) + (["reuse_equals_recompute"] if sut == "reference" else [])
                                   + list(failed)))
        out += [check(sut, "fuzz", n, "failed" if n in failed else "passed", z["seconds"], counts, failed.get(n))
                for n in names]
    x = eng.get("exhaustive_reference")
    if x:
        e = x["exhaustive"]
        counts = {k: e[k] for k in ("depth", "programs", "states", "steps", "complete")}
        f = x["findings"][0] if x["findings"] else None
        verdict = "failed" if f else "passed" if x["exit_code"] == 0 else "undecided"
        out.append(check("reference", "exhaustive", f"depth_{e['depth']}", verdict, x["seconds"], counts,
                         finding(f["kind"], f["message"], f["replay"], f["trace_steps"]) if f else None,
                         note=None if verdict == "passed" else x["verdict"]))
    d = eng.get("diff_reference")
    if d:
        failed = {c: finding(m["kind"], m["message"], m.get("replay"), []) for m in d["mismatches"] for c in m["checks"]}
        for n in ["reuse_equals_recompute"] + [c for c in failed if c != "reuse_equals_recompute"]:
            out.append(check("reference", "diff", n, "failed" if n in failed else "passed", d.get("seconds", 0.0),
                             {"scenarios": d["scenarios"]}, failed.get(n)))
    m = eng.get("mutants_smoke")
    if m:
        spent = {r["fault"]: round(sum(e.get("seconds", 0.0) for e in r.get("engines", {}).values()), 3)
                 for r in m.get("matrix", [])}      # per fault: its engines' seconds
        for name, status in m["faults"].items():
            ok = status == "killed"
            out.append(check("mutants", "smoke", f"expected_fault:{name}", "passed" if ok else "failed",
                             spent.get(name, 0.0),
                             {"status": status}, None if ok else finding("survived", f"{name}: {status}", None, [])))
        out.append(check("mutants", "smoke", "negative_control", "passed" if m["negative_control_clean"] else "failed",
                         round(max(0.0, m.get("seconds", 0.0) - sum(spent.values())), 3), {}, None if m["negative_control_clean"] else
                         finding("invariant", "the clean system reported a finding", None, [])))
    return out


def _fault_check(engine: str, fault: str, fr: dict[str, Any], seconds: float) -> dict[str, Any]:
    ok = fr["caught"]
    why = (f"planted fault {fault} caught by {', '.join(fr['caught_by'])}, not {fr['expected']}" if fr["caught_by"]
           else f"planted fault {fault} survived")
    return check("spec", engine, f"expected_fault:{fault}", "passed" if ok else "failed", seconds,
                 {"expected": fr["expected"], "caught_by": fr["caught_by"]},
                 None if ok else finding("survived", why, None, []))
