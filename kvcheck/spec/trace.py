"""The one trace format: config + named actions with parameters + expected observations.

Every engine writes it (random walks, the fuzzer, the explorer, Z3 counterexamples) and every
engine replays it (the spec, any system under test). JSON, versioned, validated on load with
one-line errors.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Config, ConfigError, read_json
from .outputs import write_atomic

FORMAT = "kvcheck-trace/1"


# Systems under test that speak their own action vocabulary (the lockstep core's free model):
# their traces carry token lists and the adapter's actions, checked by the adapter's replay.
OWN_ACTIONS = ("vllm", "sglang")


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
        return write_atomic(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, d: Any) -> "Trace":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise TraceError(f"not a kvcheck trace (expected \"format\": \"{FORMAT}\")")
        try:
            cfg = Config.from_dict(d.get("config", {}))
        except ConfigError as e:
            raise TraceError(f"trace config: {e}") from None
        for key, types in (("fault", (str, type(None))), ("engine", (str,)), ("sut", (str,)),
                           ("seed", (int, type(None))), ("violation", (dict, type(None))),
                           ("meta", (dict, type(None)))):
            if key in d and (not isinstance(d[key], types) or isinstance(d[key], bool)):
                raise TraceError(f"trace: {key!r} has the wrong type ({type(d[key]).__name__})")
        meta = d.get("meta") or {}
        if not isinstance(meta.get("sut_fault"), (str, type(None))):
            raise TraceError("trace: meta.sut_fault must be a fault name or null")
        raw = d.get("steps")
        if not isinstance(raw, list):
            raise TraceError("trace: 'steps' must be a list")
        steps = [_step(i, s) for i, s in enumerate(raw)]
        _check_violation(d.get("violation"), len(steps))
        tr = cls(cfg, steps, d.get("fault"), d.get("engine", "walk"), d.get("seed"),
                 d.get("sut", "spec"), d.get("violation"), meta)
        if tr.sut not in OWN_ACTIONS:     # those adapters' traces name their own actions
            check_spec_steps(tr)
        return tr

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.from_dict(read_json(path, "trace", TraceError))


def _check_violation(v: Any, n_steps: int) -> None:
    """The recorded finding's fields have their types, and its step lies inside the trace."""
    if v is None:
        return
    step = v.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < max(n_steps, 1)):
        raise TraceError(f"trace: violation.step must be a step index in 0..{max(n_steps - 1, 0)}, got {step!r}")
    inv = v.get("invariants")
    if inv is not None and not (isinstance(inv, list) and all(isinstance(x, str) for x in inv)):
        raise TraceError("trace: violation.invariants must be a list of invariant names")
    for key in ("check", "kind", "message", "action"):
        if v.get(key) is not None and not isinstance(v[key], str):
            raise TraceError(f"trace: violation.{key} must be a string, got {type(v[key]).__name__}")


def _step(i: int, s: Any) -> Step:
    """One step, its shape checked: a malformed trace is bad input (exit 2), not a divergence."""
    where = f"trace: steps[{i}]"
    if not isinstance(s, dict) or not isinstance(s.get("action"), str):
        raise TraceError(f"{where} must be an object with an 'action' name")
    params = s.get("params", {})
    if not isinstance(params, dict):
        raise TraceError(f"{where}.params must be an object")
    expect = s.get("expect", {}) or {}
    if not isinstance(expect, dict):
        raise TraceError(f"{where}.expect must be an object, got {type(expect).__name__}")
    dec = expect.get("decision")
    if dec is not None and not isinstance(dec, dict):
        raise TraceError(f"{where}.expect.decision must be an object")
    for key, typ in (("kind", str), ("k", int), ("reasons", list)):
        if dec is not None and dec.get(key) is not None and (not isinstance(dec[key], typ) or isinstance(dec[key], bool)):
            raise TraceError(f"{where}.expect.decision.{key} must be {'a string' if typ is str else 'an integer' if typ is int else 'a list'}")
    viol = expect.get("violations")
    if viol is not None and not (isinstance(viol, list) and all(isinstance(x, str) for x in viol)):
        raise TraceError(f"{where}.expect.violations must be a list of invariant names")
    mode = expect.get("mode")
    if mode is not None and not isinstance(mode, str):
        raise TraceError(f"{where}.expect.mode must be a string")
    return Step(s["action"], params, expect)


def check_spec_steps(trace: Trace) -> None:
    """Every step names a spec action with parameters in its domain for the trace's config (a
    vLLM trace names the adapter's actions, with token lists: it is not checked here)."""
    from .actions import ACTIONS
    from .state import Layout
    lay = Layout(trace.config)
    domains: dict[str, set[tuple]] = {}
    for i, st in enumerate(trace.steps):
        act = ACTIONS.get(st.action)
        if act is None:
            raise TraceError(f"trace: steps[{i}]: unknown action {st.action!r}; the spec's actions "
                             f"are {', '.join(ACTIONS)}")
        for k, v in st.params.items():
            if isinstance(v, bool) or not isinstance(v, (int, str)):
                raise TraceError(f"trace: steps[{i}].params.{k} must be an integer or a name, "
                                 f"got {type(v).__name__}")
        if st.action not in domains:
            domains[st.action] = {tuple(sorted(p.items())) for p in act.params(lay)}
        if tuple(sorted(st.params.items())) not in domains[st.action]:
            names = sorted({k for key in domains[st.action] for k, _ in key})
            raise TraceError(f"trace: steps[{i}]: {st.label()} is not an instance of {st.action} in "
                             f"this config (parameters {', '.join(names) or 'none'}, within the "
                             f"config's blocks/requests/objects)")
