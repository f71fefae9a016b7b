"""`kvcheck fuzz --steer coverage` (kvcheck/fuzz/steer.py): the corpus loop keeps an episode that
reached arcs of the cache code not reached before, and later episodes replay a prefix of a kept
one and extend it. Shown on a tiny fake "engine" (a module written here, its code traced like an
engine's cache files): a bug behind a five-step window that fresh random episodes miss within the
same number of episodes is found by the corpus loop (deterministic: every choice from the seed)."""
from __future__ import annotations

import importlib
import json
import random
import sys
import textwrap
from pathlib import Path

import pytest

from kvcheck.fuzz.steer import FRESH_SHARE, Episode, Replayed, Steer, rerun_args, steer_lines

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from badinput import assert_bad_input, run  # noqa: E402

# the cache code: a state that advances on the next value of a five-value key, and falls back
# to 0 on a low value (one in ten); the key completed is the bug
_FAKE = '''
class Boom(Exception):
    pass


class Cache:
    def __init__(self):
        self.state = 0

    def step(self, x):
        if x < 5:
            self.state = 0
        elif self.state == 0 and x == 31:
            self.state = 1
        elif self.state == 1 and x == 41:
            self.state = 2
        elif self.state == 2 and x == 15:
            self.state = 3
        elif self.state == 3 and x == 9:
            self.state = 4
        elif self.state == 4 and x == 26:
            raise Boom("the window")
'''


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    (tmp_path / "steer_fake_cache.py").write_text(textwrap.dedent(_FAKE))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("steer_fake_cache", None)
    yield "steer_fake_cache"
    sys.modules.pop("steer_fake_cache", None)


class _Gen:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def next(self, cache) -> tuple[str, dict]:
        return "step", {"x": self.rng.randrange(50)}


def _campaign(strategy: str, module: str, episodes: int, seed: int = 0) -> tuple[int | None, Steer]:
    """The drivers' loop in small: the episode index the bug was found at (None: never)."""
    steer = Steer(strategy, seed, [module])
    mod = importlib.import_module(module)
    try:
        for n in range(episodes):
            ep = steer.episode(seed * 1_000_003 + n)
            rng = random.Random(ep.seed)
            cache, program = mod.Cache(), []
            gen = ep.wrap(_Gen(rng), rng)
            for _ in range(len(ep.prefix) + 20):
                a, p = gen.next(cache)
                program.append((a, p))
                try:
                    cache.step(p["x"])
                except mod.Boom:
                    return n, steer
            steer.done(ep, program)
    finally:
        steer.stop()
    return None, steer


def test_the_corpus_loop_finds_what_fresh_episodes_miss(fake) -> None:
    # (found at episode 281 on seed 0; fresh episodes: 4023 on seed 2, none in 5000 on seeds 0, 1, 3)
    found, steer = _campaign("coverage", fake, 400)
    assert found is not None and steer.from_corpus > 0 and len(steer.corpus) >= 4, (found, steer.stop())
    missed, plain = _campaign("random", fake, found + 1)
    assert missed is None and plain.corpus == [] and plain.from_corpus == 0
    assert plain.stop() == {"strategy": "random", "episodes": found + 1}
    again, _ = _campaign("coverage", fake, 400)
    assert again == found                      # the same seed, the same campaign


def test_a_new_arc_is_kept_and_a_repeat_is_not(fake) -> None:
    steer = Steer("coverage", 3, [fake])
    mod = importlib.import_module(fake)
    try:
        first = steer.episode(11)
        assert first == Episode(11)            # an empty corpus: a fresh episode
        cache = mod.Cache()
        for x in (31, 41):
            cache.step(x)
        assert steer.done(first, [("step", {"x": 31}), ("step", {"x": 41})]) > 0
        assert [(e.seed, e.program) for e in steer.corpus] == [(11, [("step", {"x": 31}), ("step", {"x": 41})])]
        again = mod.Cache()
        for x in (31, 41):
            again.step(x)
        assert steer.done(Episode(12), [("step", {"x": 31})]) == 0 and len(steer.corpus) == 1
        # nothing new: the tracer backs off for one episode, which cannot join the corpus
        skipped = steer.episode(13)
        assert skipped.traced is False and steer.feedback.paused
        for x in (31, 41, 15):
            again.step(x)                      # a new arc, untraced
        assert steer.done(skipped, [("step", {"x": 15})]) == 0 and len(steer.corpus) == 1
        assert steer.episode(14).traced and not steer.feedback.paused
        assert steer.done(Episode(14), [("step", {"x": 1})]) == 0      # (its arc was not seen)
        steer.skip = 0
        kept = [("step", {"x": 31}), ("step", {"x": 41})]
        picks = [steer.episode(100 + k) for k in range(40)]
        replays = [p for p in picks if p.extend_seed is not None]
        assert replays and all(p.seed == 11 and p.parent == 0 and p.prefix in (kept[:1], kept) for p in replays)
        assert {len(p.prefix) for p in replays} == {1, 2}
        assert 0.2 < len(replays) / len(picks) < 0.8 and FRESH_SHARE == 0.5
    finally:
        res = steer.stop()
    assert res["strategy"] == "coverage" and res["corpus"] == 1 and res["arcs"] > 0


def test_a_replayed_episode_gives_its_prefix_then_new_steps() -> None:
    rng = random.Random(5)
    ep = Episode(5, [("step", {"x": 1}), ("step", {"x": 2})], extend_seed=99, parent=0)
    gen = ep.wrap(_Gen(rng), rng)
    assert isinstance(gen, Replayed) and gen.rng is rng
    got = [gen.next(None) for _ in range(4)]
    assert got[:2] == [("step", {"x": 1}), ("step", {"x": 2})]
    assert got[2:] == [("step", {"x": x}) for x in (lambda r: [r.randrange(50), r.randrange(50)])(random.Random(99))]
    got[0][1]["x"] = 7                         # a step handed out is a copy
    assert ep.prefix[0] == ("step", {"x": 1})
    assert Episode(5).wrap(gen, rng) is gen    # a fresh episode: the generator as it is


def test_unknown_strategy_and_no_cache_code_are_one_line() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'greedy'"):
        Steer("greedy", 0)
    with pytest.raises(ValueError, match="none of the engine's cache-code modules"):
        Steer("coverage", 0, ["no_such_pkg.cache"])
    assert rerun_args("coverage") == ["--steer", "coverage"] and steer_lines({"strategy": "random"}) == []


@pytest.mark.parametrize("argv, needle", [
    (["--sut", "vllm", "--layout", "full+swa", "--steer", "greedy"], "--steer: unknown strategy 'greedy'"),
    (["--sut", "spec", "--steer", "coverage"], "--steer applies to --sut"),
    (["--sut", "vllm", "--layout", "full+swa", "--steer", "coverage", "--ray"], "--steer: the Ray shards"),
])
def test_steer_refusals_exit_2_in_one_line(capsys, tmp_path, argv, needle) -> None:
    if "vllm" in argv:
        pytest.importorskip("vllm")
    assert_bad_input(*run(capsys, "fuzz", *argv, "--budget", "10", "--out", str(tmp_path))[::2], needle)


def test_the_rerun_command_names_the_strategy_and_reruns_the_campaign(capsys, tmp_path) -> None:
    pytest.importorskip("vllm")
    argv = ["fuzz", "--sut", "vllm", "--layout", "full+swa", "--budget", "400", "--seed", "2",
            "--steer", "coverage", "--drive", "mixed", "--json"]
    run(capsys, *argv, "--out", str(tmp_path / "warm"))   # vLLM's first-call-only paths (as in a fresh process)
    code, out, err = run(capsys, *argv, "--out", str(tmp_path / "a"))
    res = json.loads(out)
    assert res["steer"]["strategy"] == "coverage" and res["steer"]["corpus"] >= 1, res["steer"]
    assert "--steer coverage" in res["command"], res["command"]
    rerun = res["command"].split()[1:]         # kvcheck fuzz ...
    code2, out2, _ = run(capsys, *rerun, "--json", "--out", str(tmp_path / "b"))
    res2 = json.loads(out2)
    assert (code2, res2["steps"], res2["steer"]) == (code, res["steps"], res["steer"])
    assert res2["coverage"] == res["coverage"]
