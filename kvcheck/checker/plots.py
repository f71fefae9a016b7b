"""The report's plots, drawn with matplotlib and embedded as PNG data URIs.

Owns the pictures where people would rather look than read: logical vs usable hit rate,
degradations per reason, detection time per fault, the reuse profile of each vLLM layout.
Each function takes plain numbers (already pulled out of the report) and returns one
`<img>` with its data inline, so the page stays one self-contained file. The Figure API
(not pyplot) with the Agg canvas: no display, no global state, safe in any process.
"""
from __future__ import annotations

import base64
import html
import io
from typing import Any

PALETTE = {"logical": "#8da0cb", "usable": "#1b9e77", "killed": "#1b9e77",
           "mis-attributed": "#d95f02", "survived": "#b00020", "other": "#999999"}


def available() -> str | None:
    """None when matplotlib can be used, else the line saying how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "plots need matplotlib: pip install 'matplotlib>=3.8'"
    return None


def _figure(w: float, h: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(w, h), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _img(fig: Any, name: str, alt: str) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", metadata={"Software": None})
    b64 = base64.b64encode(buf.getvalue()).decode()
    return (f'<img class="plot" data-plot="{html.escape(name)}" alt="{html.escape(alt)}" '
            f'src="data:image/png;base64,{b64}">')


def hit_rates(rows: list[tuple[str, float, float]]) -> str:
    """Grouped bars per source: logical hit rate (what the prefix table says) vs usable (what
    could really be reused). The gap between the two is the point of the whole project."""
    fig = _figure(5.6, 2.8)
    ax = fig.add_subplot()
    xs = range(len(rows))
    w = 0.38
    lb = ax.bar([x - w / 2 for x in xs], [r[1] for r in rows], w, label="logical", color=PALETTE["logical"])
    ub = ax.bar([x + w / 2 for x in xs], [r[2] for r in rows], w, label="usable", color=PALETTE["usable"])
    ax.bar_label(lb, fmt="%.2f", fontsize=8)
    ax.bar_label(ub, fmt="%.2f", fontsize=8)
    ax.set_xticks(list(xs), [r[0] for r in rows])
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("hit rate (blocks)")
    ax.set_title("logical vs usable hit rate")
    ax.legend(loc="upper right", fontsize=8)
    return _img(fig, "hit_rates", "logical vs usable hit rate per engine")


def degradations(series: dict[str, dict[str, int]]) -> str:
    """Horizontal bars: how often each reason degraded a hit, one colour per source."""
    reasons = sorted({r for counts in series.values() for r in counts})
    fig = _figure(5.6, min(30.0, 1.0 + len(reasons) * (0.1 + 0.12 * max(1, len(series)))))
    ax = fig.add_subplot()
    n = max(1, len(series))
    h = 0.8 / n
    for i, (src, counts) in enumerate(series.items()):
        ys = [y + (i - (n - 1) / 2) * h for y in range(len(reasons))]
        ax.barh(ys, [counts.get(r, 0) for r in reasons], h, label=src)
    ax.set_yticks(range(len(reasons)), reasons, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("lookups degraded")
    ax.set_title("degradations per reason")
    ax.legend(fontsize=8)
    return _img(fig, "degradations", "degradations per reason")


def detection_times(rows: list[tuple[str, str, float, str]]) -> str:
    """(fault, engine, seconds, status) as horizontal bars: how long each engine needed to
    catch each planted fault, coloured by whether the expected check caught it."""
    faults = list(dict.fromkeys(r[0] for r in rows))
    engines = list(dict.fromkeys(r[1] for r in rows))
    per_fault = {f: sum(1 for r in rows if r[0] == f) for f in faults}
    fig = _figure(5.6, min(40.0, max(2.2, 1.0 + sum(0.12 * n + 0.1 for n in per_fault.values()))))
    ax = fig.add_subplot()
    n = max(1, len(engines))
    h = 0.8 / n
    hatches = ["", "//", "..", "xx", "\\\\", "oo"]
    for i, e in enumerate(engines):
        for fault, eng, secs, status in rows:
            if eng != e:
                continue
            y = faults.index(fault) + (i - (n - 1) / 2) * h
            ax.barh(y, secs, h, color=PALETTE.get(status, PALETTE["other"]), hatch=hatches[i % len(hatches)],
                    edgecolor="white")
            ax.text(secs, y, f" {e} {secs:g}s", va="center", fontsize=7)
    ax.set_yticks(range(len(faults)), faults, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds to detection")
    ax.set_title("detection time per fault")
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=PALETTE[s], label=f"{s} (by the expected check)" if s == "killed" else s)
                       for s in ("killed", "mis-attributed") if any(r[3] == s for r in rows)],
              fontsize=7, loc="best")
    ax.margins(x=0.25)
    return _img(fig, "detection_times", "detection time per fault and engine")


def reuse_profile(layout: str, points: list[tuple[float, float]]) -> str:
    """Usable hit tokens against the position where two prompts diverge: a layout that reuses
    well climbs with the shared prefix; steps and plateaus show where its pages stop it."""
    fig = _figure(4.2, 2.6)
    ax = fig.add_subplot()
    pts = sorted(points)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    top = max(xs + ys + [1])
    ax.plot([0, top], [0, top], color="#cccccc", lw=1, ls="--", label="ideal (reuse the whole prefix)")
    ax.step(xs, ys, where="post", color=PALETTE["usable"], lw=1.6, label="usable hit")
    ax.plot(xs, ys, "o", color=PALETTE["usable"], ms=3)
    ax.set_xlabel("divergence position (tokens)")
    ax.set_ylabel("usable hit (tokens)")
    ax.set_title(layout, fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    return _img(fig, f"reuse_profile:{layout}", f"reuse profile of {layout}")
