"""Real ratios (``kvcheck diff --sizes ratios``): the model's own granularities scaled together.

The fixed sizes (models.GRANULARITY) make every window, chunk, compression rate and index top-k a
small number of kvcheck's choosing, so the ratios between them are kvcheck's. Here the default
config's own values of those fields are scaled by ONE factor, so that their ratios (and the
divisibility relations between them) are the model's; docs/adapters-transformers.md, "Real ratios".
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from .models import GRANULARITY, WINDOW_FIELDS

SIZES = ("fixed", "ratios")
# Token granularities that are scaled: windows, chunks, blocks, compression rates, index top-k.
# Not scaled: conv kernel widths (a few taps, not a token boundary of a cache) and the counts of
# selected blocks (index_topk_blocks, index_local_blocks), which keep their fixed values.
SCALED = tuple(k for k in GRANULARITY if k in WINDOW_FIELDS or k.endswith(("chunk_size", "block_size", "_topk",
                                                                          "compress_ratio", "_budget")))
LOW, HIGH = 4, 64          # wanted: the smallest >= LOW, the largest <= HIGH
LOW_WIDE, HIGH_WIDE = 2, 128  # when the spread is wider than HIGH / LOW: smallest >= 2, largest capped at 128


def own_sizes(d: dict[str, Any]) -> dict[str, int]:
    """The default config's token granularities (field -> value; ``compress_rates[k]`` for a dict)."""
    out = {k: v for k, v in d.items() if k in SCALED and isinstance(v, int) and not isinstance(v, bool) and v > 1}
    if d.get("use_sliding_window") is False:
        out = {k: v for k, v in out.items() if k not in WINDOW_FIELDS}
    if isinstance(d.get("compress_rates"), dict):
        out.update({f"compress_rates[{k}]": v for k, v in d["compress_rates"].items()
                    if isinstance(v, int) and not isinstance(v, bool) and v > 1})
    return out


def choose_scale(values: list[int]) -> tuple[Fraction, str]:
    """The smallest power-of-two factor that makes the smallest value >= LOW (short runs); when the
    largest then exceeds HIGH, smaller down to a smallest >= LOW_WIDE (the largest is capped later)."""
    lo, hi = min(values), max(values)
    s = Fraction(1)
    while lo * s < LOW:
        s *= 2
    while lo * s / 2 >= LOW:
        s /= 2
    if hi * s <= HIGH:
        return s, f"smallest >= {LOW}, largest <= {HIGH}"
    while lo * s / 2 >= LOW_WIDE and hi * s > HIGH_WIDE:
        s /= 2
    return s, f"spread {hi // lo}x too wide for {LOW}..{HIGH}: smallest >= {LOW_WIDE}, largest capped at {HIGH_WIDE}"


def keep_divisibility(default: dict[str, int], scaled: dict[str, int]) -> dict[str, int]:
    """Where the default has b a multiple of a, the scaled b stays a multiple of the scaled a
    (rounded up to the next multiple; smaller values first, so a fix never breaks an earlier one)."""
    out = dict(scaled)
    order = sorted(default, key=lambda k: default[k])
    for b in order:
        for a in order:
            if a != b and default[a] < default[b] and default[b] % default[a] == 0 and out[b] % out[a]:
                out[b] = -(-out[b] // out[a]) * out[a]
    return out


def divisibility_kept(default: dict[str, int], scaled: dict[str, int]) -> bool:
    """The generic rule the tests check: every 'b is a multiple of a' of the default still holds."""
    return all(scaled[b] % scaled[a] == 0 for a in default for b in default
               if a != b and default[a] <= default[b] and default[b] % default[a] == 0)


def scaled_sizes(d: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    """``{sizes, scale, rule, fields: {name: {default, scaled}}}`` for the default config dict ``d``;
    ``fixed`` is the derived (fixed-size) config, whose values a config with fewer than two distinct
    granularities keeps (no ratio to keep)."""
    own = own_sizes(d)
    if len(set(own.values())) < 2:
        fields = {k: dict(default=v, scaled=_fixed_value(k, fixed)) for k, v in own.items()}
        return dict(sizes="ratios", scale=None, rule="fewer than two distinct granularities: the fixed sizes",
                    fields=fields)
    s, rule = choose_scale(list(own.values()))
    scaled = {k: max(1, round(v * s)) for k, v in own.items()}
    capped = {k for k, v in scaled.items() if v > HIGH_WIDE}
    scaled = {k: min(v, HIGH_WIDE) for k, v in scaled.items()}
    scaled = keep_divisibility(own, scaled)
    fields = {k: dict(default=v, scaled=scaled[k]) | ({"capped": True} if k in capped else {})
              for k, v in own.items()}
    return dict(sizes="ratios", scale=str(s), rule=rule, fields=fields)


def _fixed_value(k: str, fixed: dict[str, Any]):
    if k.startswith("compress_rates["):
        return (fixed.get("compress_rates") or {}).get(k[len("compress_rates["):-1])
    return fixed.get(k)


def apply(params: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """``params`` (a derived config) with the scaled values of ``report`` set."""
    if report.get("scale") is None:
        return params
    out = dict(params)
    for k, f in report["fields"].items():
        if k.startswith("compress_rates["):
            out["compress_rates"] = {**(out.get("compress_rates") or {}), k[len("compress_rates["):-1]: f["scaled"]}
        else:
            out[k] = f["scaled"]
    return out


def multiple_cap(bounds: dict[str, int], default_cap: int) -> int:
    """How far plan.py takes a boundary's multiples in ratios mode: at least twice the largest + 1."""
    return max([default_cap] + [2 * b + 1 for b in bounds.values()])


def report_for(mt: str, fixed: dict[str, Any]) -> dict[str, Any]:
    """:func:`scaled_sizes` for model type ``mt`` (its decoder's default config)."""
    from .models import config_mapping, decoder_type

    mapping, _ = config_mapping()
    mt = decoder_type(mt)
    return scaled_sizes(mapping[mt]().get_text_config(decoder=True).to_dict(), fixed)
