"""State diagrams of what an exploration observed: one digraph per object kind (DOT, and an
SVG drawn here without graphviz), written next to explore.json and inlined by the report.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from ..spec.objects import DEVICE_STATES, DISK_STATES
from ..spec.outputs import write_atomic

def diagrams(report: dict[str, Any]) -> dict[str, str]:
    """One DOT digraph per object kind, from the transitions observed."""
    edges: dict[str, list[tuple[str, str]]] = {}
    for t in report["transitions_observed"]:
        kind, rest = t.split(":", 1)
        a, b = rest.split("->")
        edges.setdefault(kind, []).append((a, b))
    out = {}
    for kind, es in sorted(edges.items()):
        lines = [f'digraph "{kind}" {{', "  rankdir=LR;", f'  label="{kind}"; labelloc=t;',
                 '  node [shape=ellipse, fontname="Helvetica"];']
        for a, b in es:
            lines.append(f'  "{a}" -> "{b}";')
        lines.append("}")
        out[kind] = "\n".join(lines) + "\n"
    return out


def svg_diagram(kind: str, edges: list[tuple[str, str]]) -> str:
    """A self-made SVG (no graphviz): states on a circle, arrows between them."""
    import math
    nodes = sorted({x for e in edges for x in e}, key=lambda x: (DEVICE_STATES + DISK_STATES).index(x)
                   if x in DEVICE_STATES + DISK_STATES else 99)
    W, H, R = 420, 320, 110
    pos = {n: (W / 2 + R * math.cos(2 * math.pi * i / len(nodes) - math.pi / 2),
               H / 2 + 10 + R * math.sin(2 * math.pi * i / len(nodes) - math.pi / 2))
           for i, n in enumerate(nodes)}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}">',
             '<defs><marker id="ah" markerWidth="10" markerHeight="8" refX="9" refY="4" orient="auto">'
             '<path d="M0,0 L10,4 L0,8 z" fill="#444"/></marker></defs>',
             f'<text x="{W / 2}" y="18" text-anchor="middle" font-family="sans-serif" font-size="14" '
             f'font-weight="bold">{kind}</text>']
    for a, b in edges:
        (x1, y1), (x2, y2) = pos[a], pos[b]
        dx, dy = x2 - x1, y2 - y1
        d = math.hypot(dx, dy) or 1
        ox, oy = -dy / d * 6, dx / d * 6           # offset so a->b and b->a do not overlap
        sx, sy = x1 + dx / d * 38 + ox, y1 + dy / d * 16 + oy
        ex, ey = x2 - dx / d * 38 + ox, y2 - dy / d * 16 + oy
        parts.append(f'<line x1="{sx:.1f}" y1="{sy:.1f}" x2="{ex:.1f}" y2="{ey:.1f}" stroke="#444" '
                     'stroke-width="1.4" marker-end="url(#ah)"/>')
    for n, (x, y) in pos.items():
        parts.append(f'<ellipse cx="{x:.1f}" cy="{y:.1f}" rx="40" ry="16" fill="#e8f0fe" stroke="#1a5ab8"/>')
        parts.append(f'<text x="{x:.1f}" y="{y + 4:.1f}" text-anchor="middle" font-family="sans-serif" '
                     f'font-size="11">{n}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_diagrams(report: dict[str, Any], out: Path) -> dict[str, dict[str, str]]:
    """DOT always; PNG through graphviz `dot` when it is installed, else a self-made SVG."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, str]] = {}
    dot = shutil.which("dot")
    edges: dict[str, list[tuple[str, str]]] = {}
    for t in report["transitions_observed"]:
        kind, rest = t.split(":", 1)
        a, b = rest.split("->")
        edges.setdefault(kind, []).append((a, b))
    for kind, text in diagrams(report).items():
        p = write_atomic(out / f"states-{kind}.dot", text)
        files[kind] = {"dot": str(p)}
        if dot:
            png = out / f"states-{kind}.png"
            try:
                subprocess.run([dot, "-Tpng", "-o", str(png), str(p)], check=True,
                               capture_output=True, timeout=30)
                files[kind]["png"] = str(png)
                continue
            except (OSError, subprocess.SubprocessError):
                pass
        svg = write_atomic(out / f"states-{kind}.svg", svg_diagram(kind, edges[kind]))
        files[kind]["svg"] = str(svg)
    return files


