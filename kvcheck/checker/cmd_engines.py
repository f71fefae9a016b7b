"""`kvcheck engines`: the registered engines (the `kvcheck.engines` entry points), each with its
installed release, layouts, faults and docs; entry points that failed to load, with why."""
from __future__ import annotations

import argparse

from ..fuzz import registry
from .common import UsageError, emit


def cmd_engines(args: argparse.Namespace) -> int:
    found = registry.engines()
    if args.name is not None and args.name not in found:
        raise UsageError(f"kvcheck engines: unknown engine {args.name!r}; registered: {', '.join(found) or 'none'}")
    rows = [eng.describe(unsupported=args.layouts or args.name is not None)
            for name, eng in found.items() if args.name in (None, name)]
    if not args.layouts:
        for r in rows:
            r.pop("layouts", None)
    data = {"engines": rows, "load_errors": registry.load_errors(), "entry_point_group": registry.GROUP}

    def text() -> str:
        lines = [f"{len(rows)} engine(s) registered under the {registry.GROUP!r} entry points:"]
        for r in rows:
            rel = r["release"] or "not installed"
            lines.append(f"  {r['name']:13} {rel:14} {r['layout_count']:3} layouts"
                         + (f" ({r['unsupported_count']} not on this release)" if r["unsupported_count"] else "")
                         + f", {len(r['faults'])} faults  [{r['module']}]")
            lines.append(f"  {'':13} {r['summary']}" + (f"  (docs: {r['docs']})" if r["docs"] else ""))
            for k, why in (r.get("errors") or {}).items():
                lines.append(f"  {'':13} ! {k}: {why}")
            if args.layouts and r.get("layouts"):
                gaps = r.get("unsupported") or {}
                lines += [f"  {'':15}{k:24} {d}" + (f"  [not on this release: {gaps[k]}]" if k in gaps else "")
                          for k, d in r["layouts"].items()]
        for name, why in data["load_errors"].items():
            lines.append(f"  {name:13} FAILED TO LOAD: {why}")
        return "\n".join(lines)

    emit(args, data, text)
    return 0
