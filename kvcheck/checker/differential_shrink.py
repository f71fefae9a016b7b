"""Differences between releases made small, and a two-release reproducer for each.

A difference (release A hits less than release B on some lookup of a workload, or a release's
lookup broke a check) is shrunk by the one shrinker (fuzz/shrink.py) while it still shows: each
candidate is replayed by the releases' own drivers, kept running for the whole shrink (one line
per candidate and release: the engine is imported once per release, not once per candidate).
The shrunk workload is saved with a standalone script that replays it on both releases' pythons
through the same driver, prints every lookup's hit on each, and exits 1 while they differ.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Callable

from ..fuzz.shrink import budget, shrink
from ..spec.outputs import file_stem
from .differential import DriverError, ReleaseProc
from .matrix_envs import ROOT

Steps = list[dict[str, Any]]


def _related(steps: Steps) -> list[list[int]]:
    """One request's steps (its send and its finish) go together."""
    by: dict[str, list[int]] = {}
    for i, st in enumerate(steps):
        by.setdefault(str(st.get("r")), []).append(i)
    return list(by.values())


def _alternatives(steps: Steps) -> list[list[dict[str, Any]]]:
    """Per step, smaller ones that may stand for it: a send without output, computed at once,
    with its prompt cut to half or one token shorter."""
    out: list[list[dict[str, Any]]] = []
    for st in steps:
        mine: list[dict[str, Any]] = []
        if st.get("op") == "send":
            if st.get("output"):
                mine.append({**st, "output": []})
            if st.get("chunk") is not None:
                mine.append({**st, "chunk": None})
            t = list(st["tokens"])
            mine += [{**st, "tokens": t[:n]} for n in sorted({len(t) // 2, len(t) - 1}) if n >= 1]
        out.append(mine)
    return out


def less_than(a: str, b: str) -> Callable[[dict[str, list[dict[str, Any]]]], bool]:
    """The difference holds while release `a` hits less than `b` on some lookup."""
    def holds(recs: dict[str, list[dict[str, Any]]]) -> bool:
        hb = {(r["trace"], r["step"]): r["hit"] for r in recs[b]}
        return any(r["hit"] < hb.get((r["trace"], r["step"]), -1) for r in recs[a])
    return holds


def breaks(a: str, check: str) -> Callable[[dict[str, list[dict[str, Any]]]], bool]:
    """The finding holds while a lookup of release `a` breaks `check`."""
    return lambda recs: any((r.get("violation") or {}).get("check") == check for r in recs[a])


def shrink_trace(trace: dict[str, Any], layout: str, procs: dict[str, ReleaseProc],
                 holds: Callable[[dict[str, list[dict[str, Any]]]], bool], seconds: float) -> dict[str, Any]:
    """The smallest workload (by fuzz/shrink.py's order) on which `holds` still does, within
    `seconds` of this process's CPU (the drivers' time is theirs); then every prompt cut to the
    shortest length at which it still holds (one prompt at a time cannot shrink a resend: its
    copy no longer matches) and shrunk again."""
    def fails(steps: Steps) -> Steps | None:
        cand = {**trace, "steps": steps}
        try:
            recs = {label: p.replay(layout, [cand]) for label, p in procs.items()}
        except DriverError:
            return None
        return steps if holds(recs) else None
    left = budget(seconds)
    steps = shrink(list(trace["steps"]), fails, seconds, _alternatives, _related)
    longest = max([len(st["tokens"]) for st in steps if st.get("op") == "send"] + [0])
    for n in range(1, longest):        # every prompt cut at once: prompts that share a prefix still do
        if not left():
            break
        cut = fails([{**st, "tokens": st["tokens"][:n]} if st.get("op") == "send" else st for st in steps])
        if cut is not None:
            steps = shrink(cut, fails, max(0.0, seconds / 4), _alternatives, _related)
            break
    name = trace["name"] if trace["name"].endswith("-shrunk") else f"{trace['name']}-shrunk"
    return {**trace, "name": name, "steps": steps}


def shrunk_hits(trace: dict[str, Any], layout: str, procs: dict[str, ReleaseProc]) -> dict[str, list[dict[str, Any]]]:
    """Each release's lookups on the (shrunk) workload, {release: [{step, hit, usable}]}: the page
    shows the hits the reproducer prints, not only the unshrunk lookup's."""
    return {label: [{"step": r["step"], "hit": r["hit"], "usable": r.get("usable")} for r in p.replay(layout, [trace])]
            for label, p in procs.items()}


REPRO = '''#!/usr/bin/env python3
"""kvcheck cross-release differential reproducer ({engine}, layout {layout}): {what}.

Replays one workload on each release's own python through kvcheck's differential driver and
prints every lookup's hit; exits 1 while release {less} hits less than {more} on some lookup
(or, for a check, while {less} still breaks it), 0 once it does not, 2 if a release cannot run.
Generated by: {command}
"""
import json, os, subprocess, sys

ROOT = {root!r}
ENGINE, LAYOUT, CHECK = {engine_ref!r}, {layout!r}, {check!r}
PYTHONS = {pythons!r}
LESS, MORE = {less!r}, {more!r}
TRACE = json.loads({trace!r})


def records(python):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    req = json.dumps({{"id": 1, "layout": LAYOUT, "workloads": [TRACE]}}) + "\\n"
    p = subprocess.run([python, "-m", "kvcheck.checker.differential_driver", ENGINE], input=req, cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=1800)
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.strip()]
    bad = [x.get("error") for x in lines if x.get("error")]
    if bad or len(lines) < 2:
        print(f"{{python}}: {{bad[0] if bad else (p.stderr.strip().splitlines() or ['no answer'])[-1]}}")
        sys.exit(2)
    return lines[0].get("release"), lines[1]["records"]


hits = {{}}
for label, python in PYTHONS.items():
    release, recs = records(python)
    hits[label] = recs
    print(f"{{label}} ({{release}}, {{python}}):")
    for r in recs:
        v = (r.get("violation") or {{}}).get("check")
        print(f"  step {{r['step']}} {{r['request']}}: {{r['prompt_tokens']}} prompt tokens, hit {{r['hit']}}"
              + (f" (kvcheck's usable hit on this release: {{r['usable']}})" if r.get("usable") is not None else "")
              + (f", breaks {{v}}" if v else ""))
if CHECK:
    differ = any((r.get("violation") or {{}}).get("check") == CHECK for r in hits[LESS])
else:
    more = {{(r["trace"], r["step"]): r["hit"] for r in hits[MORE]}}
    differ = any(r["hit"] < more.get((r["trace"], r["step"]), -1) for r in hits[LESS])
print("still differs" if differ else "no longer differs")
sys.exit(1 if differ else 0)
'''


def write_difference(out: Path, engine: str, engine_ref: str, layout: str, diff: dict[str, Any],
                     pythons: dict[str, str], command: str) -> dict[str, Any]:
    """Save the shrunk workload (OUT/differences/NAME.json) and its reproducer (NAME.py);
    `diff` gains their paths and the commands that replay them."""
    d = out / "differences"
    d.mkdir(parents=True, exist_ok=True)
    stem = file_stem(f"{layout}-{diff['less']}-vs-{diff['more']}-{diff['trace']['name']}")
    path, script = d / f"{stem}.json", d / f"{stem}.py"
    check = diff.get("check")
    what = (f"{diff['less']} breaks {check}" if check else
            f"{diff['less']} reuses less than {diff['more']} (reuse available elsewhere)")
    script.write_text(REPRO.format(engine=engine, layout=layout, what=what, less=diff["less"], more=diff["more"],
                                   command=command, root=str(ROOT), engine_ref=engine_ref, check=check,
                                   pythons={k: pythons[k] for k in dict.fromkeys([diff["less"], diff["more"]])},
                                   trace=json.dumps(diff["trace"])))
    script.chmod(0o755)
    saved = dict(diff, layout=layout, pythons={k: pythons[k] for k in (diff["less"], diff["more"])},
                 reproducer=str(script), path=str(path))
    pys = [x for k in dict.fromkeys([diff["less"], diff["more"]]) for x in ("--python", pythons[k])]
    saved["replay"] = shlex.join(["kvcheck", "matrix", "--sut", engine, "--differential", *pys,
                                  "--layouts", layout, "--traces", str(path), "--out", str(out / "replay")])
    saved["reproduce"] = shlex.join(["python3", str(script)])
    path.write_text(json.dumps(saved, indent=1))
    return saved
