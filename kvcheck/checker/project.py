"""The project file: which systems `kvcheck gate` checks, with which engines, budgets and seeds.

A serving team keeps `[tool.kvcheck]` in its pyproject.toml (or a kvcheck.toml: the top-level
table or its [tool.kvcheck]); `--project FILE` names one. This module owns the schema and its
validation only: every key is checked before anything runs, and a bad one is one line naming
its key path (`kvcheck.toml: [tool.kvcheck.systems.vllm] layouts[1]: unknown layout 'foo'`),
exit 2. Running the systems is gate_project.py's.
"""
from __future__ import annotations

import dataclasses

import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..fuzz.campaign import Budget
from .common import UsageError

# The engines that make sense for each kind of system under test.
ENGINES: dict[str, tuple[str, ...]] = {
    "spec": ("walk", "fuzz", "prove", "explore", "replay-corpus"),
    "reference": ("fuzz", "diff", "exhaustive", "replay-corpus"),
    "vllm": ("fuzz", "replay-corpus"),
    "transformers": ("diff",),
    "user": ("fuzz", "exhaustive", "replay-corpus"),
}
DEFAULT_ENGINES: dict[str, tuple[str, ...]] = {
    "spec": ("walk", "fuzz", "replay-corpus"), "reference": ("fuzz", "diff", "replay-corpus"),
    "vllm": ("fuzz", "replay-corpus"), "transformers": ("diff",), "user": ("fuzz", "replay-corpus")}
# Default budgets per (kind, engine): walk and diff count steps / scenarios; fuzz takes either.
DEFAULT_BUDGETS: dict[tuple[str, str], str] = {
    ("spec", "walk"): "10000", ("spec", "fuzz"): "3000", ("reference", "fuzz"): "600",
    ("reference", "diff"): "30", ("vllm", "fuzz"): "2000", ("transformers", "diff"): "10",
    ("user", "fuzz"): "2000", ("reference", "exhaustive"): "40000", ("user", "exhaustive"): "40000"}
DEFAULT_DEPTH = 4                                              # `depth` of the exhaustive engine
COUNT_ONLY = {"walk": "steps", "diff": "scenarios"}           # engines whose budget is a count
NO_BUDGET = ("prove", "explore", "replay-corpus")              # run at CI bounds / whole corpus
# The engines that can run an expected fault, per kind (the mutants engines of its layer).
FAULT_ENGINES: dict[str, tuple[str, ...]] = {
    "spec": ("walk", "fuzz"), "reference": ("fuzz", "diff"), "vllm": ("fuzz",),
    "transformers": ("diff",), "user": ("fuzz",)}
DEFAULT_FAULT_BUDGET = "30s"

TOP_KEYS = {"corpus": "a path (string)", "seeds": "a list of integers", "systems": "a table",
            "ray": "true (a local or RAY_ADDRESS cluster) or a cluster address HOST:PORT (string)",
            "redis": "a Redis URL (string): the shared Hypothesis example database of ray campaigns",
            "ray_shards": "a positive integer: Ray tasks per seed of each fuzz campaign",
            "known": "a table NAME = { reason = \"...\", upstream = \"...\" }: known engine defects the team accepts",
            "known_strict": "true: an acknowledged defect the release under test cannot have fails the gate"}
SYSTEM_KEYS = {"engines": "a list of engine names", "budget": "a budget: steps (2000) or a duration (30s)",
               "budgets": "a table engine = budget", "seeds": "a list of integers",
               "expected_faults": "a list of fault names",
               "fault_budget": "a budget: steps (2000) or a duration (30s)",
               "config": "a path to a JSON config (string)", "layouts": "a list of vLLM layout names or files",
               "model_types": "a list of transformers model types",
               "sched_policy": "fcfs or priority: vLLM's scheduler policy in the scheduler-driven episodes",
               "known": "a table NAME = { reason = \"...\", upstream = \"...\" } (adds to the top-level [known])",
               "depth": "a positive integer: the exhaustive engine's depth (steps per program, default 4)",
               "cover": "true (default) or false: measure the engine's cache-code coverage over each campaign "
                        "and hold it to the engine's floor"}
KIND_ONLY = {"layouts": ("vllm",), "model_types": ("transformers",), "sched_policy": ("vllm",), "known": ("vllm",),
             "cover": ("vllm", "transformers"),
             "config": ("spec", "reference", "user")}
# Kinds that are registered engines checked through their own project hooks (fuzz/engine.py).
ENGINE_KINDS = ("vllm", "transformers")
_BARE = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True)
class System:
    """One system under test and what runs on it."""

    name: str                        # as in the file: spec, reference, vllm, transformers, MODULE:CLASS
    kind: str                        # spec | reference | vllm | transformers | user
    engines: tuple[str, ...]
    budgets: dict[str, Budget]       # per engine that takes one
    seeds: tuple[int, ...]
    expected_faults: tuple[str, ...] = ()
    fault_budget: Budget = field(default_factory=lambda: Budget.parse(DEFAULT_FAULT_BUDGET))
    config: Path | None = None
    variants: tuple[str, ...] = ()   # an engine's layouts / model types (its project_variant_key)
    options: dict[str, Any] = field(default_factory=dict)   # an engine's own keys (vLLM: sched_policy)
    ray: str | bool | None = None    # fuzz as Ray tasks: True (local / RAY_ADDRESS) or an address
    redis: str | None = None
    ray_shards: int = 2


    @property
    def layouts(self) -> tuple[str, ...]:
        return self.variants if self.kind == "vllm" else ()

    @property
    def model_types(self) -> tuple[str, ...]:
        return self.variants if self.kind == "transformers" else ()

    @property
    def sched_policy(self) -> str:
        return str(self.options.get("sched_policy", "fcfs"))


@dataclass(frozen=True)
class Project:
    path: Path
    systems: tuple[System, ...]
    corpus: Path

    def strict_known(self) -> None:
        """`kvcheck gate --strict-known`: every engine system as under `known_strict = true`."""
        for s in self.systems:
            if "strict_known" in s.options:
                s.options["strict_known"] = True


def find_project(explicit: str | None, cwd: Path | None = None) -> Path | None:
    """--project FILE, else ./pyproject.toml with [tool.kvcheck], else ./kvcheck.toml, else None."""
    if explicit is not None:
        p = Path(explicit)
        if not p.is_file():
            raise UsageError(f"--project {explicit}: no such file")
        return p
    cwd = cwd or Path.cwd()
    py = cwd / "pyproject.toml"
    if py.is_file():
        try:
            if "kvcheck" in _read_toml(py).get("tool", {}):
                return py
        except UsageError:
            pass                     # a pyproject.toml that is not ours to judge: look on
    kv = cwd / "kvcheck.toml"
    return kv if kv.is_file() else None


def _read_toml(path: Path) -> dict[str, Any]:
    from ..spec.config import read_text
    text = read_text(path, "project file", UsageError)
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError, ValueError) as e:
        raise UsageError(f"{path}: invalid TOML: {' '.join(str(e).split())}") from None


def load_project(path: Path) -> Project:
    """Parse and validate every key of the project file."""
    doc = _read_toml(path)
    if path.name == "pyproject.toml" or isinstance(doc.get("tool"), dict):
        tool = doc.get("tool")
        if not isinstance(tool, dict) or "kvcheck" not in tool:
            raise UsageError(f"{path}: no [tool.kvcheck] table")
        table, where = tool["kvcheck"], "tool.kvcheck"
        if not isinstance(table, dict):
            raise UsageError(f"{path}: tool.kvcheck: must be a table")
    else:
        table, where = doc, ""
    return _Validator(path, where).project(table)


def _sut_engine(name: str) -> bool:
    """A registered engine (a third party's too) whose SUT class the core's campaign drives:
    a system like MODULE:CLASS, named by the engine."""
    from ..fuzz import registry
    try:
        return not registry.get(name).own_driver()
    except registry.UnknownEngine:
        return False


class _Validator:
    def __init__(self, path: Path, root: str) -> None:
        self.path, self.root, self.base = path, root, path.parent

    def fail(self, table: str, key: str, why: str) -> UsageError:
        head = f"[{table}] " if table else ""
        return UsageError(f"{self.path.name}: {head}{key}: {why}")

    def sub(self, *names: str) -> str:
        parts = [self.root] if self.root else []
        parts += [n if _BARE.fullmatch(n) else json.dumps(n) for n in names]
        return ".".join(parts)

    def project(self, t: dict[str, Any]) -> Project:
        tab = self.root
        for k in t:
            if k not in TOP_KEYS:
                raise self.fail(tab, k, f"unknown key (known: {', '.join(TOP_KEYS)})")
        corpus = t.get("corpus", "kvcheck-corpus")
        if not isinstance(corpus, str) or not corpus.strip():
            raise self.fail(tab, "corpus", f"must be {TOP_KEYS['corpus']}")
        if "\0" in corpus:
            raise self.fail(tab, "corpus", f"a path cannot hold a NUL byte (got {corpus!r})")
        seeds = self.seeds(tab, "seeds", t.get("seeds", [0]))
        self.known = self.acknowledgements(tab, "known", t.get("known", {}))
        self.known_strict = t.get("known_strict", False)
        if not isinstance(self.known_strict, bool):
            raise self.fail(tab, "known_strict", f"must be true or false (got {self.known_strict!r})")
        systems = t.get("systems")
        if systems is None:
            raise self.fail(tab, "systems", "missing: name at least one system under test "
                            "([...systems.reference], [...systems.vllm], ...)")
        if not isinstance(systems, dict) or not systems:
            raise self.fail(tab, "systems", "must be a non-empty table of systems under test")
        out = tuple(self.system(name, body, seeds) for name, body in systems.items())
        scale = self.scale(tab, t)
        if scale:
            out = tuple(dataclasses.replace(x, **scale) if x.kind in ("spec", "reference", "user") else x
                        for x in out)
        return Project(self.path, out, Path(os.path.normpath(self.base / corpus)))

    def scale(self, tab: str, t: dict[str, Any]) -> dict[str, Any]:
        """`ray`, `redis`, `ray_shards`: the fuzz campaigns of spec, reference and MODULE:CLASS
        systems run as Ray tasks (kvcheck/fuzz/ray_campaign.py), as `fuzz --ray` does."""
        ray, redis, shards = t.get("ray"), t.get("redis"), t.get("ray_shards", 2)
        if ray is not None and not (ray is True or (isinstance(ray, str) and ray.strip())):
            raise self.fail(tab, "ray", f"must be {TOP_KEYS['ray']}")
        if ray is False:
            ray = None
        if redis is not None and (ray is None or not isinstance(redis, str) or not redis.strip()):
            raise self.fail(tab, "redis", f"must be {TOP_KEYS['redis']}, with `ray` set")
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 \
                or ("ray_shards" in t and ray is None):
            raise self.fail(tab, "ray_shards", f"must be {TOP_KEYS['ray_shards']}, with `ray` set")
        if ray is None:
            return {}
        from ..fuzz.ray_campaign import require_ray
        try:
            require_ray()
        except Exception as e:              # not installed: the install line
            raise self.fail(tab, "ray", " ".join(str(e).split())) from None
        if redis is not None:
            from ..fuzz.exampledb import check_redis
            try:
                check_redis(redis)
            except Exception as e:
                raise self.fail(tab, "redis", " ".join(str(e).split())) from None
        return {"ray": ray, "redis": redis, "ray_shards": shards}

    def seeds(self, tab: str, key: str, v: Any) -> tuple[int, ...]:
        if not isinstance(v, list) or not v:
            raise self.fail(tab, key, "must be a non-empty list of integers")
        for i, s in enumerate(v):
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise self.fail(tab, f"{key}[{i}]", f"must be a non-negative integer, got {s!r}")
        return tuple(v)

    def strings(self, tab: str, key: str, v: Any, what: str, empty_ok: bool = True) -> list[str]:
        if not isinstance(v, list) or (not v and not empty_ok):
            raise self.fail(tab, key, f"must be {'a non-empty' if not empty_ok else 'a'} list of {what}")
        for i, s in enumerate(v):
            if not isinstance(s, str):
                raise self.fail(tab, f"{key}[{i}]", f"must be a string ({what}), got {type(s).__name__}")
        if len(set(v)) != len(v):
            dup = next(s for s in v if v.count(s) > 1)
            raise self.fail(tab, key, f"{dup!r} is listed twice")
        return v

    def budget(self, tab: str, key: str, v: Any, engine: str | None) -> Budget:
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise self.fail(tab, key, "must be a budget: steps (2000) or a duration (30s, 5m)")
        try:
            b = Budget.parse(str(v))
        except ValueError as e:
            raise self.fail(tab, key, str(e)) from None
        if (b.steps is not None and b.steps < 1) or (b.seconds is not None and b.seconds <= 0):
            raise self.fail(tab, key, f"must be positive, got {v!r}")
        if engine in COUNT_ONLY and b.steps is None:
            raise self.fail(tab, key, f"{engine}'s budget is a count of {COUNT_ONLY[engine]}, got {v!r}")
        return b

    def system(self, name: str, body: Any, default_seeds: tuple[int, ...]) -> System:
        tab = self.sub("systems", name)
        kind = name if name in ENGINES and name != "user" else "user" if ":" in name or _sut_engine(name) else None
        if kind is None:
            raise self.fail(self.sub("systems"), name, "unknown system under test (known: spec, reference, "
                            "vllm, transformers, a registered engine with a SUT class (`kvcheck engines`), "
                            "or MODULE:CLASS for your own adapter)")
        if not isinstance(body, dict):
            raise self.fail(self.sub("systems"), name, "must be a table")
        for k in body:
            if k not in SYSTEM_KEYS:
                raise self.fail(tab, k, f"unknown key (known: {', '.join(SYSTEM_KEYS)})")
            if k in KIND_ONLY and kind not in KIND_ONLY[k]:
                raise self.fail(tab, k, f"applies to {' and '.join(KIND_ONLY[k])} only")
        engines = self.strings(tab, "engines", body.get("engines", list(DEFAULT_ENGINES[kind])),
                               "engine names", empty_ok=False)
        for i, e in enumerate(engines):
            if e not in ENGINES[kind]:
                known = {x for es in ENGINES.values() for x in es}
                why = "unknown engine" if e not in known else f"does not apply to {name}"
                raise self.fail(tab, f"engines[{i}]", f"{why} {e!r} (for {name}: {', '.join(ENGINES[kind])})")
        budgets = self.budgets(tab, kind, engines, body)
        seeds = self.seeds(tab, "seeds", body["seeds"]) if "seeds" in body else default_seeds
        fb = self.budget(tab, "fault_budget", body.get("fault_budget", DEFAULT_FAULT_BUDGET), None)
        config = self.config(tab, body["config"]) if "config" in body else None
        variants, options = self.engine_system(tab, kind, body) if kind in ENGINE_KINDS else ((), {})
        if kind in ENGINE_KINDS:
            cover = body.get("cover", True)
            if not isinstance(cover, bool):
                raise self.fail(tab, "cover", f"must be true or false (got {cover!r})")
            options = dict(options, cover=cover)
        if kind in ENGINE_KINDS:          # known defects the team accepts: the file's, then the system's
            options = dict(options, acknowledged={**self.known, **self.acknowledgements(tab, "known", body.get("known", {}))},
                           strict_known=self.known_strict)
        if "depth" in body:
            d = body["depth"]
            if "exhaustive" not in engines:
                raise self.fail(tab, "depth", "applies to the exhaustive engine only (add it to engines)")
            if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= 12:
                raise self.fail(tab, "depth", f"must be an integer from 1 to 12 (got {d!r})")
            options = dict(options, depth=d)
        faults = self.strings(tab, "expected_faults", body.get("expected_faults", []), "fault names")
        if faults and not set(engines) & set(FAULT_ENGINES[kind]):
            raise self.fail(tab, "expected_faults", f"need an engine that plants faults "
                            f"({' or '.join(FAULT_ENGINES[kind])}) in engines")
        for i, f in enumerate(faults):
            self.fault(tab, f"expected_faults[{i}]", kind, name, f)
        return System(name, kind, tuple(engines), budgets, seeds, tuple(faults), fb, config, variants, options)

    def budgets(self, tab: str, kind: str, engines: list[str], body: dict[str, Any]) -> dict[str, Budget]:
        per = body.get("budgets", {})
        if not isinstance(per, dict):
            raise self.fail(tab, "budgets", "must be a table engine = budget")
        for e in per:
            if e not in engines:
                raise self.fail(f"{tab}.budgets", e, f"not one of this system's engines ({', '.join(engines)})")
            if e in NO_BUDGET:
                raise self.fail(f"{tab}.budgets", e, f"{e} takes no budget (it runs at CI bounds)")
        out: dict[str, Budget] = {}
        for e in engines:
            if e in NO_BUDGET:
                continue
            if e in per:
                out[e] = self.budget(f"{tab}.budgets", e, per[e], e)
            elif "budget" in body:
                out[e] = self.budget(tab, "budget", body["budget"], e)
            else:
                out[e] = Budget.parse(DEFAULT_BUDGETS[(kind, e)])
        return out

    def config(self, tab: str, v: Any) -> Path:
        from ..spec.config import Config, ConfigError
        if not isinstance(v, str) or not v:
            raise self.fail(tab, "config", "must be a path to a JSON config (string)")
        p = self.base / v
        try:
            Config.load(str(p))
        except ConfigError as e:
            raise self.fail(tab, "config", " ".join(str(e).split())) from None
        return p

    def acknowledgements(self, tab: str, key: str, v: Any) -> dict[str, Any]:
        """A `known` table (fuzz/known.py): each entry a defect name with the reason it is accepted."""
        from ..fuzz.known import parse_acknowledgements
        try:
            return parse_acknowledgements(v, key)
        except ValueError as e:
            k, _, why = str(e).partition(": ")
            raise self.fail(tab, k, why) from None

    def engine_system(self, tab: str, kind: str, body: dict[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
        """A registered engine's variants (its `project_variant_key`) and options, checked by it."""
        from ..fuzz import registry
        from ..fuzz.engine import EngineUnavailable, ProjectKeyError
        try:
            eng = registry.get(kind)
        except registry.UnknownEngine as e:
            raise self.fail(self.sub("systems"), kind, str(e)) from None
        key = eng.project_variant_key
        names = None
        if key is not None and key in body:
            names = list(self.strings(tab, key, body[key], f"{key.replace('_', ' ')} (strings)", empty_ok=False))
        try:
            variants, options = eng.project_system(names, body, self.base)
        except ProjectKeyError as e:
            raise self.fail(tab, e.key, " ".join(e.why.split())) from None
        except EngineUnavailable as e:
            raise self.fail(tab, key or "engines", str(e)) from None
        return tuple(variants), options

    def fault(self, tab: str, key: str, kind: str, name: str, f: str) -> None:
        """A fault this system plants (the one registry; a user SUT's own `faults`)."""
        from ..fuzz import faults as faultlib
        from ..fuzz.suts import SutError
        from .common import check_sut_fault
        try:
            if kind in ("spec", "reference", "user"):
                check_sut_fault(name, f)
                return
            got = faultlib.get(f.split("@")[0] if kind == "transformers" else f)
        except (UsageError, SutError, faultlib.UnknownFault, faultlib.FaultError) as e:
            raise self.fail(tab, key, " ".join(str(e).split())) from None
        if kind not in got.suts:
            raise self.fail(tab, key, f"fault {f!r} is planted by --sut {' or '.join(got.suts)}, not by {name}")
