"""The action table's registry: `Action`, the table `ACTIONS` and the `@action` decorator, with
the common parameter generators.

A module of its own so that the modules defining actions (actions.py, decode.py, alloc.py,
duplicates.py) all import it and none imports another to register; actions.py imports them
after its own actions, so the table's order (the order actions are tried and listed) is
actions.py's, then decode, alloc, duplicates. Use `kvcheck.spec.actions.ACTIONS`: it is
complete once that module is imported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .state import Layout


@dataclass(frozen=True)
class Action:
    name: str
    doc: str
    params: Callable[[Layout], list[dict[str, Any]]]
    body: Callable[..., Any]


ACTIONS: dict[str, Action] = {}


def action(params: Callable[[Layout], Iterable[dict[str, Any]]] | None = None):
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = fn.__name__.rstrip("_")
        ps = (lambda lay: list(params(lay))) if params else (lambda lay: [{}])
        ACTIONS[name] = Action(name, (fn.__doc__ or "").strip().split("\n")[0], ps, fn)
        return fn
    return deco


def per_request(lay: Layout) -> Iterable[dict[str, Any]]:
    return ({"r": r} for r in range(lay.cfg.requests))


def per_block(lay: Layout) -> Iterable[dict[str, Any]]:
    return ({"j": j} for j in range(lay.cfg.blocks))


def per_object(lay: Layout) -> Iterable[dict[str, Any]]:
    return ({"g": o.group, "kind": o.kind, "j": o.block} for o in lay.objects)


def per_object_kind(kinds: tuple[str, ...]):
    return lambda lay: ({"g": o.group, "kind": o.kind, "j": o.block}
                        for o in lay.objects if o.kind in kinds)
