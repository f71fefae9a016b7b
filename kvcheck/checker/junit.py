"""`kvcheck gate --junit FILE`: the gate's checks as JUnit XML, so CI shows them as tests.

One <testcase> per (system, engine, check): classname "kvcheck.<system>.<engine>", name the
check. A failed check carries a <failure> with the finding and the command that replays it; an
undecided one an <error>; a check that did not apply, <skipped>; an acknowledged known engine
defect, <skipped> with "acknowledged known defect" and the team's reason (pytest's xfail).
"fixed" corpus traces pass.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from .common import UsageError


def junit_xml(report: dict[str, Any]) -> bytes:
    checks = report.get("checks", [])
    suites = ET.Element("testsuites", name="kvcheck gate")
    by_suite: dict[str, list[dict[str, Any]]] = {}
    for c in checks:
        by_suite.setdefault(f"kvcheck.{c['system']}.{c['engine']}", []).append(c)
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for name, cs in by_suite.items():
        n = {"tests": len(cs), "failures": sum(c["verdict"] == "failed" for c in cs),
             "errors": sum(c["verdict"] == "undecided" for c in cs),
             "skipped": sum(c["verdict"] in ("skipped", "acknowledged") for c in cs)}
        suite = ET.SubElement(suites, "testsuite", name=name, time=f"{max(c['seconds'] for c in cs):.3f}",
                              **{k: str(v) for k, v in n.items()})
        for k in totals:
            totals[k] += n[k]
        for c in cs:
            case = ET.SubElement(suite, "testcase", classname=name, name=c["check"], time=f"{c['seconds']:.3f}")
            f = c.get("finding")
            if c["verdict"] == "failed":
                msg = f["message"] if f else "failed"
                el = ET.SubElement(case, "failure", message=msg[:500], type=(f or {}).get("kind", "failure"))
                el.text = _body(c)
            elif c["verdict"] == "undecided":
                el = ET.SubElement(case, "error", message=(c.get("note") or "undecided")[:500], type="undecided")
                el.text = c.get("note") or ""
            elif c["verdict"] == "skipped":
                ET.SubElement(case, "skipped", message=(c.get("note") or "not applicable")[:500])
            elif c["verdict"] == "acknowledged":
                ET.SubElement(case, "skipped", type="xfail",
                              message=f"acknowledged known defect: {c.get('note') or ''}"[:500])
            elif c.get("note"):
                ET.SubElement(case, "system-out").text = f"{c['verdict']}: {c['note']}"
    for k, v in totals.items():
        suites.set(k, str(v))
    ET.indent(suites)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True)


def _body(c: dict[str, Any]) -> str:
    f = c.get("finding") or {}
    lines = [f"{f.get('kind', 'failure')}: {f.get('message', '')}"]
    if f.get("trace_steps"):
        lines.append("shrunk trace:")
        lines += [f"  {i:3}. {s}" for i, s in enumerate(f["trace_steps"])]
    if f.get("replay"):
        lines.append(f"replay: {f['replay']}")
    return "\n".join(lines)


def write_junit(path: Path, report: dict[str, Any]) -> None:
    from .gate import write_public
    try:
        write_public(path, junit_xml(report))
    except OSError as e:
        raise UsageError(f"--junit {path}: cannot write ({e.strerror or e})") from None
