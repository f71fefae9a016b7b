"""The one trace format: config + named actions with parameters + expected observations.

Every engine writes it (random walks, the fuzzer, the explorer, Z3 counterexamples) and every
engine replays it (the spec, any system under test). JSON, versioned, validated on load with
one-line errors.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Config, ConfigError, read_json

FORMAT = "kvcheck-trace/1"


class TraceError(ValueError):
    """A trace file that cannot be read or does not follow the format (exit code 2)."""


@dataclass
class Step:
    action: str
    params: dict[str, Any] = field(default_factory=dict)
    expect: dict[str, Any] = field(default_factory=dict)   # e.g. {"decision": {...}, "violations": [...]}

    def label(self) -> str:
        if not self.params:
            return self.action
        return f"{self.action}(" + ", ".join(f"{k}={v}" for k, v in self.params.items()) + ")"


@dataclass
class Trace:
    config: Config
    steps: list[Step]
    fault: str | None = None
    engine: str = "walk"
    seed: int | None = None
    sut: str = "spec"
    violation: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "engine": self.engine, "sut": self.sut, "seed": self.seed,
            "fault": self.fault, "config": self.config.to_dict(),
            "steps": [{"action": s.action, "params": s.params, **({"expect": s.expect} if s.expect else {})}
                      for s in self.steps],
            "violation": self.violation, "meta": self.meta,
        }

    def save(self, path: str | Path) -> Path:
        """Write atomically (temp file + rename): an interrupted write never leaves half a trace."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".trace-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, p)
        return p

    @classmethod
    def from_dict(cls, d: Any) -> "Trace":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise TraceError(f"not a kvcheck trace (expected \"format\": \"{FORMAT}\")")
        try:
            cfg = Config.from_dict(d.get("config", {}))
        except ConfigError as e:
            raise TraceError(f"trace config: {e}") from None
        steps = []
        raw = d.get("steps")
        if not isinstance(raw, list):
            raise TraceError("trace: 'steps' must be a list")
        for i, s in enumerate(raw):
            if not isinstance(s, dict) or not isinstance(s.get("action"), str):
                raise TraceError(f"trace: steps[{i}] must be an object with an 'action' name")
            params = s.get("params", {})
            if not isinstance(params, dict):
                raise TraceError(f"trace: steps[{i}].params must be an object")
            steps.append(Step(s["action"], params, s.get("expect", {}) or {}))
        return cls(cfg, steps, d.get("fault"), d.get("engine", "walk"), d.get("seed"),
                   d.get("sut", "spec"), d.get("violation"), d.get("meta", {}) or {})

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.from_dict(read_json(path, "trace", TraceError))
