"""The compiled spec does not depend on Python's parser nesting limit (200 parentheses): a sum
over 56..64 blocks' objects used to raise SyntaxError from `spec/system.py`."""
from __future__ import annotations

import random

from kvcheck.spec.config import Config
from kvcheck.spec.system import Spec, _compile, _depth


def _nested_sum(n: int) -> str:
    src = "0"
    for i in range(n):
        src = f"({src} + (s[{i % 7}] if (s[{(i + 3) % 7}] > {i % 3}) else {i}))"
    return src


def test_deep_sources_compile_to_the_same_function() -> None:
    rng = random.Random(0)
    src = _nested_sum(400)                       # 800 nested parentheses
    assert _depth(src) > 200
    fn = _compile(f"def f(s):\n    if not ({src} >= 0): return False\n    return {src}\n", "f")
    for _ in range(20):
        s = tuple(rng.randrange(4) for _ in range(7))
        assert fn(s) == _ref(s)


def _ref(s: tuple) -> int:
    """The sum computed without the parser: the same terms, added in Python."""
    total = 0
    for i in range(400):
        total += s[i % 7] if s[(i + 3) % 7] > i % 3 else i
    return total


def test_a_64_block_spec_builds_and_agrees_with_its_definitions() -> None:
    """Blocks 1..64 is the documented range: the top of it builds (it used to raise SyntaxError
    from 56 blocks on), and its compiled guards agree with the definitions read directly."""
    spec = Spec(Config(blocks=64))
    s = spec.init()
    rng = random.Random(1)
    for _ in range(12):
        enabled = spec.enabled(s)
        for inst in rng.sample(spec.instances, 10):
            assert inst.guard(s) == bool(spec.interpret(s, inst)[0]), inst.label()
        if not enabled:
            break
        inst = rng.choice(enabled)
        assert inst.effect(s) == spec.interpret(s, inst)[1]
        s = inst.effect(s)
        assert spec.check(s) == []
