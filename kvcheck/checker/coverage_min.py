"""The object states a clean walk must reach (the gate's vacuity minimum), shared by the
default profile (gate.py) and a project file's walks (project_engines.py)."""
from __future__ import annotations

from ..spec.config import Config
from ..spec.objects import OBJECTS
from ..spec.state import Layout


def required_states(cfg: Config) -> list[str]:
    kinds = {o.kind for o in Layout(cfg).objects} | ({"on_disk"} if cfg.offload_enabled else set())
    return [f"{k.name}:{st}" for k in OBJECTS if k.name in kinds for st in k.reachable_states()]
