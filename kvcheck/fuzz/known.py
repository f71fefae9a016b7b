"""Known engine defects as acknowledged expectations, never silence (pytest's xfail(strict=True)
model), written once for every engine.

An engine recognises a defect of its release by the defect's signature and counts each
recognised finding under `known:NAME` in its campaign's coverage (engines/vllm/known.py,
engines/sglang/swa.py); it declares the defects it can recognise in `Engine.known_defects()`.
What a recognised defect means for the verdict is decided here, the same for every engine:

- not acknowledged: a finding of its check's kind, naming the defect and its upstream
  reference, with the exit code of that kind (a safety defect exits 10);
- acknowledged (the project file's `[known]` table, or `kvcheck fuzz --acknowledge NAME=WHY`):
  shown with its reason, does not fail the run;
- acknowledged, but the release under test is outside the defect's release range: reported
  "fixed? remove the entry" (failing with `strict`), since a stale acknowledgement would hide
  the defect's return.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..spec.verdict import FOR_FINDING, ExitCode


@dataclass(frozen=True)
class KnownDefect:
    """A real defect of a range of an engine's releases that its campaigns recognise."""

    name: str
    check: str                    # the check it makes fire
    kind: str                     # that check's finding kind: safety | bookkeeping | lost_reuse | ...
    first: str                    # first and last release whose code has it (inclusive)
    last: str
    upstream: str                 # public issue / PR, or "none found"
    repro: str = ""               # a standalone reproducer (exit 1 while the defect is there)

    def in_release(self, version: str | None) -> bool:
        return version is not None and _ver(self.first) <= _ver(version) <= _ver(self.last)


@dataclass(frozen=True)
class Acknowledgement:
    """A team's statement that it knows a defect and accepts it for now, and why."""

    name: str
    reason: str
    upstream: str = ""


_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def _ver(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def parse_acknowledgements(table: Any, where: str) -> dict[str, Acknowledgement]:
    """`{NAME: {reason = "...", upstream = "..."}}` (a project file's table) -> acknowledgements;
    ValueError("WHERE.NAME: why") on a bad entry. A reason is required: an acknowledgement
    without one is the silence this replaces."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: must be a table NAME = {{ reason = \"...\", upstream = \"...\" }}")
    out = {}
    for name, body in table.items():
        if not _NAME.fullmatch(str(name)):
            raise ValueError(f"{where}: {name!r} is not a defect name (letters, digits, _ . -)")
        if isinstance(body, str):
            body = {"reason": body}
        if not isinstance(body, dict) or set(body) - {"reason", "upstream"}:
            raise ValueError(f"{where}.{name}: must be {{ reason = \"...\", upstream = \"...\" }}")
        reason, upstream = body.get("reason"), body.get("upstream", "")
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"{where}.{name}: reason must be a non-empty string (why the team accepts it)")
        if not isinstance(upstream, str):
            raise ValueError(f"{where}.{name}: upstream must be a string (an issue or PR)")
        out[str(name)] = Acknowledgement(str(name), " ".join(reason.split())[:300], upstream.strip()[:200])
    return out


def parse_cli(values: list[str] | None) -> dict[str, Acknowledgement]:
    """`--acknowledge NAME=REASON` (repeatable), the command line's mirror of the `[known]` table."""
    table = {}
    for v in values or ():
        name, sep, reason = v.partition("=")
        if not sep:
            raise ValueError(f"--acknowledge {v!r}: give NAME=REASON (why the team accepts the defect)")
        table[name.strip()] = {"reason": reason}
    return parse_acknowledgements(table, "--acknowledge")


def judge(res: dict[str, Any], defects: Mapping[str, KnownDefect],
          acknowledged: Mapping[str, Acknowledgement] | None, release: str | None,
          strict: bool = False, fails_kinds: frozenset[str] | None = None) -> dict[str, Any]:
    """Turn the `known:NAME` counts of a campaign result into its verdict (module doc): adds
    `res["known"]`, one row per recognised or acknowledged defect (an unacknowledged one with
    status "finding", its kind, check, message and reproducer: its occurrences are counted, not
    saved as traces, so they stay out of `res["findings"]`, whose entries all replay), and raises
    `res["exit_code"]` where one fails. `fails_kinds`: the finding kinds that
    fail this run (default: every kind but lost_reuse, which fails only under strict reuse)."""
    acknowledged = acknowledged or {}
    counts = {k.split(":", 1)[1]: n for k, n in (res.get("coverage") or {}).items()
              if k.startswith("known:") and isinstance(n, int) and n > 0}
    fails = fails_kinds if fails_kinds is not None else frozenset(FOR_FINDING) - {"lost_reuse"}
    rows: list[dict[str, Any]] = []
    code = int(res.get("exit_code", 0))
    for name in sorted(set(counts) | set(acknowledged)):
        d, ack, n = defects.get(name), acknowledged.get(name), counts.get(name, 0)
        row: dict[str, Any] = {"name": name, "recognised": n, "check": d.check if d else None,
                               "kind": d.kind if d else None, "upstream": (d.upstream if d else "") or
                               (ack.upstream if ack else ""), "releases": f"{d.first}..{d.last}" if d else None}
        if ack is not None:
            row["reason"] = ack.reason
            if d is not None and release is not None and not d.in_release(release) and not n:
                row["status"] = "fixed?"
                row["message"] = (f"acknowledged defect {name} is not in release {release} (it has "
                                  f"{d.first}..{d.last}): fixed? remove the entry")
                if strict and code in (0, int(ExitCode.UNDECIDED)):
                    code = int(ExitCode.CONFORMANCE)      # the team's expectation no longer holds
            elif d is None:
                row["status"] = "unknown"
                row["message"] = (f"acknowledged defect {name} is not one this engine recognises "
                                  f"(known: {', '.join(sorted(defects)) or 'none'})")
            else:
                row["status"] = "acknowledged" if n else "acknowledged, not hit"
        else:
            kind = d.kind if d else "safety"
            row["status"] = "finding"
            row["fails"] = kind in fails
            row["message"] = (f"known defect {name} ({d.upstream if d else 'no upstream reference'}; "
                              f"releases {row['releases']}) recognised {n} time(s): its check {row['check']} "
                              "fails; acknowledge it in the project file's [known] table (or --acknowledge "
                              "NAME=REASON) to accept it")
            row["reproducer"] = d.repro if d else None
            if row["fails"] and code in (0, int(ExitCode.UNDECIDED)):
                code = int(FOR_FINDING.get(kind, ExitCode.INVARIANT))
        rows.append(row)
    res["known"] = rows
    res["exit_code"] = code
    return res


def known_lines(res: dict[str, Any]) -> list[str]:
    """The console lines of a result's known defects: a finding, or what the team acknowledged."""
    out = []
    for r in res.get("known", []):
        if r["status"] == "finding":
            out += [f"  FINDING [{r['kind']}] {r['check']} (known defect {r['name']}): {r['message']}",
                    f"    reproducer: {r['reproducer']}"]
        else:
            out.append(f"  KNOWN {r['name']} ({r['status']}): " + (r.get("message") or
                       f"recognised {r['recognised']} time(s); acknowledged: {r.get('reason', '')}"
                       + (f" [{r['upstream']}]" if r.get("upstream") else "")))
    return out
