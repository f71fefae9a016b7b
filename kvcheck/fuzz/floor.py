"""The coverage floor: what a clean campaign must have done before it may claim anything.

One rule for `kvcheck fuzz`, the default gate's fuzz profiles and a project file's systems (the
Hypothesis machines and the engines' own drivers alike): a campaign that ran no step, tried no
example, decided no lookup, or never exercised an action it declares is "undecided" (exit 3),
never a pass. Which actions were never even enabled is said apart, since no budget fixes those:
the SUT declares what the spec cannot reach with the actions it has in this config.
"""
from __future__ import annotations

from typing import Any, Iterable

from ..spec.objects import DECISION_KINDS


def shortfall(counts: dict[str, Any], missing: Iterable[str], never_enabled: Iterable[str] = (),
              steps_run: int | None = None) -> str | None:
    """Why a clean campaign claims nothing, or None when it met the floor. `counts` may hold
    steps, examples and the decision kinds (those it lacks are not judged); `missing` are the
    declared actions never exercised, `never_enabled` those of them the spec never enabled."""
    short = [f"0 {k} ran" for k in ("steps", "examples") if k in counts and not counts[k]]
    if any(k in counts for k in DECISION_KINDS) and not sum(
            v for k, v in counts.items() if k in DECISION_KINDS and isinstance(v, int)):
        short.append("no lookup decided")
    never = list(never_enabled)
    drawn = [a for a in missing if a not in never]
    if never:
        within = f" in {steps_run} steps" if steps_run is not None else ""
        short.append(f"the SUT declares {', '.join(never)}, which the spec never enabled{within} "
                     "(a longer budget; or, if the actions it declares cannot reach them in this config, "
                     "drop them from `actions` or declare what enables them: `kvcheck adapter-check` lints this)")
    if drawn:
        short.append(f"{', '.join(drawn)} never exercised (a longer budget)")
    return "; ".join(short) or None


def undecided_lines(res: dict[str, Any]) -> list[str]:
    """The console line of an engine driver's result (missing_actions, steps) that stopped at
    the floor: what it left untried, so that an exit 3 never comes without its reason."""
    why = shortfall({"steps": res.get("steps", 0)}, res.get("missing_actions") or [])
    return [f"  undecided: {why}"] if res.get("exit_code") == 3 and why else []
