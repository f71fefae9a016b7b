"""The adapter: kvcheck's SystemUnderTest protocol (kvcheck/spec/sut.py, docs/adapters.md) over
the toy engine's PrefixCache, with the scheduler's request bookkeeping. kvcheck drives it in
lockstep with its spec and compares decisions and abstract state after every step.

It implements one full-attention layer on the device tier with the spec's default semantics;
any other config is refused with a ConfigError (kvcheck: one line, exit 2) naming the layouts
to pass with `--config`.
"""
from __future__ import annotations

from typing import Any

from kvcheck.spec.config import SEMANTIC_DEFAULTS, Config, ConfigError
from kvcheck.spec.objects import EVICTED, READY, R_BOUND, R_DECIDED, R_IDLE, R_PREEMPTED, R_RUNNING, R_WAITING
from kvcheck.spec.state import Layout
from kvcheck.spec.sut import ActionRejected

from . import HASH_ONLY_HIT, LAYOUT_DIR
from .allocator import PoolFull, PrefixCache


def check_config(cfg: Config) -> None:
    """What this cache can express: one full layer, device tier, default semantics."""
    why = []
    if [layer.kind for layer in cfg.layers] != ["full"]:
        why.append("layers " + "+".join(layer.kind for layer in cfg.layers))
    if tuple(cfg.tiers) != ("device",):
        why.append("tiers " + "+".join(cfg.tiers))
    why += [f"{k}={getattr(cfg, k)!r}" for k, v in SEMANTIC_DEFAULTS.items() if getattr(cfg, k) != v]
    if why:
        files = " or ".join(str(p) for p in sorted(LAYOUT_DIR.glob("*.json")))
        raise ConfigError(f"toyengine caches one full-attention layer on the device tier with the default "
                          f"semantics; this config has {', '.join(why)}: pass --config {files}")


class ToyEngineSUT:
    name = "toyengine"
    actions = frozenset({"submit", "lookup", "bind", "bind_stale", "use", "append", "finish",
                         "preempt", "resume", "evict"})
    faults = {HASH_ONLY_HIT: "decision_matches_spec"}      # planted bug -> the check that catches it

    def __init__(self, fault: str | None = None) -> None:
        if fault is not None and fault not in self.faults:
            raise ValueError(f"unknown fault {fault!r}; toyengine plants: {', '.join(self.faults)}")
        self.fault = fault

    def reset(self, cfg: Config) -> None:
        check_config(cfg)
        self.cfg, self.lay = cfg, Layout(cfg)
        self.cache = PrefixCache(cfg.cap("swa_window"), trust_hash=self.fault == HASH_ONLY_HIT)
        self.req = {r: {"st": R_IDLE, "len": 0, "k": 0, "pos": 0} for r in range(cfg.requests)}

    def apply(self, action: str, p: dict[str, Any]) -> dict[str, Any]:
        q, c = self.req.get(p.get("r", -1)), self.cache
        st = q["st"] if q else None
        active = sum(x["st"] in (R_BOUND, R_RUNNING) for x in self.req.values())
        if action == "submit" and st == R_IDLE:
            q.update(st=R_WAITING, len=p["n"], k=0, pos=0)
        elif action == "lookup" and st == R_WAITING:
            k, logical = c.match(q["len"])
            q.update(st=R_DECIDED, k=k)
            kind = "REUSE" if k == logical > 0 else "PARTIAL" if k else "RECOMPUTE"
            return {"decision": {"kind": kind, "k": k, "logical": logical,
                                 "reasons": ["window_incomplete"] if k < logical else []}}
        elif action == "bind_stale" and st == R_DECIDED and not c.present(q["k"]):
            q["st"] = R_WAITING
        elif action == "bind" and st == R_DECIDED and c.present(q["k"]) and active < self.cfg.max_active:
            q.update(st=R_BOUND, pos=q["k"])
            c.pin(q["k"], +1)
        elif action == "use" and st == R_BOUND:
            q["st"] = R_RUNNING
        elif action == "append" and st == R_RUNNING and q["pos"] == p["j"] < q["len"]:
            try:
                c.write(p["j"])
            except PoolFull as e:
                raise ActionRejected(str(e)) from None
            q["pos"] += 1
        elif action == "finish" and st == R_RUNNING and q["pos"] == q["len"]:
            c.pin(q["pos"], -1)
            q["st"] = R_IDLE
        elif action == "preempt" and st in (R_DECIDED, R_BOUND, R_RUNNING):
            if st != R_DECIDED:
                c.pin(q["pos"], -1)
            q["st"] = R_PREEMPTED
        elif action == "resume" and st == R_PREEMPTED:
            q["st"] = R_WAITING
        elif action == "evict" and c.evict(p["j"]):
            pass
        else:
            raise ActionRejected(f"{action} {p}")
        return {}

    def observe(self) -> dict[int, int]:
        """The abstraction function onto the slots this cache has: each page's state and
        holders, published hashes, each request's state and position."""
        lay, c, out = self.lay, self.cache, {}
        for j in range(self.cfg.blocks):
            out[lay.o(0, "swa_window", j, "st")] = READY if j in c.refs else EVICTED if j in c.evicted else 0
            out[lay.o(0, "swa_window", j, "ref")] = c.refs.get(j, 0)
            out[lay.b(j, "hashed")] = int(j in c.published)
        for r, q in self.req.items():
            out[lay.r(r, "rst")] = q["st"]
            if q["st"] in (R_BOUND, R_RUNNING):
                out[lay.r(r, "rpos")] = q["pos"]
        return out
