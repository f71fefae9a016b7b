"""Coverage as feedback (`kvcheck fuzz --steer coverage`): a corpus loop over a campaign's episodes.

Why: a plain random walk keeps drawing fresh episodes, so a branch of the engine's cache code
behind a narrow window is reached only by luck. Here an episode that reaches arcs (branch
transitions) of the engine's declared cache code (`Engine.cache_code`) never reached before is
kept in a corpus; later episodes take a corpus entry half of the time, replay a prefix of its
steps on a fresh engine built from the same episode seed (same layout, knobs, swarm weights)
and extend it with fresh random steps (AFL-style: entries that found more arcs and were picked
less often are picked first). Every choice comes from the campaign seed.

Per-episode arcs: coverage.py's C tracer (branch mode) restricted to the cache files, flushed
once per episode with `Coverage.get_data()` and counted per file. It costs about 2.5-3x a step,
so it backs off: after k traced episodes in a row that reached nothing new, the next 2^k - 1 (at
most MAX_SKIP) run untraced (they replay and extend the corpus all the same, but cannot join it).
Measured cheaper than a `sys.settrace` restricted to those files' code objects
(benchmarks/search.py `tracer`: 2.4x against 3.1x untraced): a Python trace function still runs
on every call event of every module (vLLM, the adapter, the checks), where the C tracer decides
per file once and records arcs in C. Where `--cover` already measures the same files, its
Coverage object is read instead of starting a second one (coverage.py traces with one tracer at
a time), and every episode is traced.

The driver calls `episode()` before drawing an episode, `Episode.wrap` on its step generator,
and `done()` after it; `--steer random` is the same loop with no tracer and no corpus.
"""
from __future__ import annotations

import copy
import importlib
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

STEERS = ("random", "coverage")
FRESH_SHARE = 0.5          # the share of episodes drawn fresh once the corpus has entries
MAX_SKIP = 7               # at most this many untraced episodes between two traced ones


@dataclass
class Entry:
    """A kept episode: its seed (the engine's config is drawn from it) and the steps it ran."""

    seed: int
    program: list[tuple[str, dict]]
    arcs: int                      # arcs it reached first
    picked: int = 0


@dataclass
class Episode:
    """What the driver runs next: a fresh episode (`prefix` empty) or a corpus entry's prefix
    replayed, then extended from `extend_seed`."""

    seed: int
    prefix: list[tuple[str, dict]] = field(default_factory=list)
    extend_seed: int | None = None
    parent: int | None = None      # the corpus entry's index
    traced: bool = True            # its arcs are collected (else it runs untraced: see Steer.episode)

    def wrap(self, gen: Any, rng: random.Random) -> Any:
        """The step generator the driver uses: the prefix first, then `gen`. `rng` (the one
        `gen` draws from, after the config draws) is reseeded, so the extension is new."""
        if self.extend_seed is None:
            return gen
        rng.seed(self.extend_seed)
        return Replayed(gen, list(self.prefix))


class Replayed:
    """A step generator that gives back recorded steps before its own."""

    def __init__(self, gen: Any, steps: list[tuple[str, dict]]) -> None:
        self.gen, self.steps = gen, steps

    def next(self, ad: Any) -> tuple[str, dict]:
        if self.steps:
            action, params = self.steps.pop(0)
            return action, copy.deepcopy(params)
        return self.gen.next(ad)

    def __getattr__(self, name: str) -> Any:      # the wrapped generator's other attributes
        return getattr(self.gen, name)


class ArcFeedback:
    """Arcs of `files` reached so far; `new()` says how many were first reached since its last call."""

    def __init__(self, files: Sequence[str]) -> None:
        from . import engine_coverage as ec
        active = ec.active()
        self.own = active is None
        if active is not None:
            self.cov = active.cov               # --cover measures these files already
        else:
            import coverage
            self.cov = coverage.Coverage(data_file=None, branch=True, config_file=False, include=list(files))
            self.cov.start()
        self.total, self.paused = 0, False

    def new(self) -> int:
        data = self.cov.get_data()
        n = sum(len(data.arcs(f) or ()) for f in data.measured_files())
        fresh, self.total = n - self.total, n
        return fresh

    def pause(self, paused: bool) -> None:
        """Stop or restart the tracer between episodes (not one --cover owns: it measures all)."""
        if self.own and paused != self.paused:
            (self.cov.stop if paused else self.cov.start)()
            self.paused = paused

    def stop(self) -> None:
        if self.own:
            self.pause(True)
            self.own = False


class Steer:
    """The campaign's episode source: `random` (fresh episodes only) or `coverage` (the corpus loop)."""

    def __init__(self, strategy: str, seed: int, modules: Sequence[str] = ()) -> None:
        if strategy not in STEERS:
            raise ValueError(f"--steer: unknown strategy {strategy!r}; known: {', '.join(STEERS)}")
        self.strategy, self.modules = strategy, tuple(modules)
        self.rng = random.Random(f"steer:{seed}")
        self.corpus: list[Entry] = []
        self.feedback: ArcFeedback | None = None
        self.absent: list[str] = []
        self.episodes = self.from_corpus = self.kept = self.traced = 0
        self.misses = self.skip = 0         # traced episodes in a row without a new arc; untraced ones left
        if strategy == "coverage":
            from .engine_coverage import resolve
            files, self.absent = resolve(self.modules)
            if not files:
                raise ValueError("--steer coverage: none of the engine's cache-code modules is importable "
                                 f"here ({', '.join(self.modules) or 'it declares none'})")
            self.files = files

    def _start(self) -> None:
        """Import the cache modules, then start tracing them: at the first episode, once the driver
        has imported the engine its own way (SGLang's CPU stand-ins first: imported bare before,
        a module half-loaded broke the release's import, KeyError 'sglang' on 0.5.11). Imported
        before tracing: the import's own arcs would be a first episode's only."""
        for m in self.files:
            try:
                importlib.import_module(m)
            except Exception:  # noqa: BLE001 - the campaign reports a module that cannot load
                pass
        self.feedback = ArcFeedback(list(self.files.values()))

    def episode(self, fresh_seed: int) -> Episode:
        """The next episode: fresh from `fresh_seed`, or (the corpus loop) a kept one's prefix
        replayed and extended."""
        if self.strategy == "coverage" and self.feedback is None:
            self._start()
        self.episodes += 1
        # (sharing --cover's tracer, every episode is traced anyway: no back-off)
        traced = self.skip == 0 or (self.feedback is not None and not self.feedback.own)
        self.skip = max(0, self.skip - 1)
        if self.feedback is not None:
            self.feedback.pause(not traced)
            self.traced += traced
        if not self.corpus or self.rng.random() < FRESH_SHARE:
            return Episode(fresh_seed, traced=traced)
        weights = [e.arcs / (1 + e.picked) for e in self.corpus]
        i = self.rng.choices(range(len(self.corpus)), weights)[0]
        e = self.corpus[i]
        e.picked += 1
        n = len(e.program)
        cut = self.rng.randint(n // 2, n)       # the whole, or its tail cut off (where it went astray)
        self.from_corpus += 1
        return Episode(e.seed, e.program[:cut], self.rng.getrandbits(63), i, traced)

    def done(self, ep: Episode, program: Sequence[tuple[str, dict]]) -> int:
        """After an episode (its steps: (action, params) pairs such as `Act`s): the arcs it
        reached first; an episode with any is kept."""
        if self.feedback is None or not ep.traced:
            return 0
        fresh = self.feedback.new()
        # the tracer's cost (about 3x) is paid where it pays: after k traced episodes in a row
        # without a new arc, the next 2^k - 1 (at most MAX_SKIP) run untraced
        self.misses = 0 if fresh else self.misses + 1
        self.skip = min(2 ** self.misses - 1, MAX_SKIP)
        if fresh > 0:
            steps = [(a[0], copy.deepcopy(a[1])) for a in program]     # (an engine may keep and grow its lists)
            self.corpus.append(Entry(ep.seed, steps, fresh))
            self.kept += 1
        return fresh

    def stop(self) -> dict[str, Any]:
        """Stop tracing; the JSON's `steer` entry."""
        res: dict[str, Any] = {"strategy": self.strategy, "episodes": self.episodes}
        if self.feedback is not None:
            self.feedback.new()
            self.feedback.stop()
            res.update(corpus=len(self.corpus), from_corpus=self.from_corpus, arcs=self.feedback.total,
                       traced=self.traced,
                       tracer="coverage.py CTracer (branch) on the cache files, flushed per traced episode",
                       absent_modules=self.absent)
        return res


def rerun_args(strategy: str) -> list[str]:
    """The rerun command's arguments naming the strategy (given with --steer: a rerun under
    another default would run another campaign)."""
    return ["--steer", strategy]


def steer_lines(res: dict[str, Any] | None) -> list[str]:
    """The console line of a steered campaign (none for fresh random episodes)."""
    if not res or res.get("strategy") == "random":
        return []
    return [f"  steer {res['strategy']}: {res['episodes']} episodes, {res.get('from_corpus', 0)} from the corpus "
            f"({res.get('corpus', 0)} kept), {res.get('arcs', 0)} cache-code arcs reached"]
