"""The lockstep core: every driver and every adapter goes through it; each divergence kind,
the adapter's own checks, the one shrinker and the one replay (old traces included)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvcheck.fuzz import lockstep
from kvcheck.fuzz.lockstep import Act, Finding, FreeModel, Lockstep, SpecModel
from kvcheck.spec.verdict import FOR_FINDING as EXIT
from kvcheck.fuzz.shrink import shrink
from kvcheck.fuzz.suts import resolve_sut
from kvcheck.fuzz.traces import replay, to_trace
from kvcheck.spec.config import Config
from kvcheck.spec.sut import ActionRejected, SpecSUT
from kvcheck.spec.system import Spec
from kvcheck.spec.trace import Step, Trace

CFG = Config()


def _spec_run(spec: Spec, length: int, seed: int) -> list:
    """A legal walk of the spec (its instances), from a printed seed."""
    rng, s, out = random.Random(seed), spec.init(), []
    for _ in range(length):
        en = spec.enabled(s)
        if not en:
            break
        x = rng.choice(en)
        out.append(x)
        s = x.effect(s)
    return out


class _Refuses(SpecSUT):
    """The spec as SUT, except that it refuses one action (a planted conformance bug)."""

    def __init__(self, action: str) -> None:
        super().__init__()
        self.refused = action

    def apply(self, action, params):
        if action == self.refused:
            raise ActionRejected("planted")
        return super().apply(action, params)


class _TakesEverything(SpecSUT):
    """Takes an action the spec forbids (a planted bug a negative probe must catch)."""

    name = "takes-everything"

    def apply(self, action, params):
        inst = self.spec.instance(action, params)
        if not inst.guard(self.state):
            return {}          # "did it" without changing the abstract state
        return super().apply(action, params)


def test_every_driver_and_adapter_goes_through_the_one_core(monkeypatch) -> None:
    """The reference engine (kvcheck diff's driver), the spec in the Hypothesis machine and
    vLLM's manager (its campaign driver) all step through Lockstep.check."""
    seen: list[str] = []
    real = Lockstep.check

    def spy(self, x):
        seen.append(type(self.sut).__name__)
        return real(self, x)
    monkeypatch.setattr(Lockstep, "check", spy)
    from kvcheck.engines.reference import diff
    spec = Spec(CFG)
    f, _, _ = diff.run_scenario(spec, None, _spec_run(spec, 12, seed=0))
    assert f is None and "_CountingSUT" in seen                 # ReferenceSUT's driver subclass
    from kvcheck.fuzz.machine import Tally, make_machine, run_program
    assert run_program(make_machine(spec, lambda: SpecSUT(), Tally()), _spec_run(spec, 12, seed=1)) is None
    assert "SpecSUT" in seen
    pytest.importorskip("vllm")
    from kvcheck.engines.vllm import drivers as V
    V.run_campaign("full+swa", budget_s=None, steps=30, seed=0, drive="mixed")
    assert "VllmAdapter" in seen
    V.run_campaign("full+swa", budget_s=None, steps=30, seed=0)      # the default (auto): vLLM's own scheduler
    assert "EngineAdapter" in seen


def test_rejected_enabled_action_is_a_conformance_finding() -> None:
    spec = Spec(CFG)
    sut = _Refuses("finish")
    sut.reset(CFG)
    prog = [x for x in _spec_run(spec, 200, seed=2)]
    assert any(x.action == "finish" for x in prog)
    f = Lockstep(SpecModel(spec), sut).run(prog)
    assert f is not None and f.kind == "conformance" and f.checks == ["sut_rejected_enabled_action"]
    assert EXIT[f.kind] == 13 and f.trail[-1][0] != "finish"     # the refused step is not in the trail


def test_negative_probe_taken_is_a_divergence() -> None:
    spec = Spec(CFG)
    sut = _TakesEverything()
    sut.reset(CFG)
    core = Lockstep(SpecModel(spec), sut)
    probe = next(x for x in core.probes if not x.guard(core.s))
    assert core.probe(probe) is True and core.diverged is not None
    assert core.diverged.checks == ["sut_accepted_disabled_action"]
    with pytest.raises(Finding):
        core.end()
    plain = SpecSUT()                       # the spec as SUT: no probes (it refuses them all)
    plain.reset(CFG)
    assert Lockstep(SpecModel(spec), plain).probes == []


class _Counter:
    """A toy adapter with its own vocabulary and its own check (the vLLM adapter's shape)."""

    name = "counter"
    actions = frozenset({"inc", "dec"})

    def reset(self, cfg=None):
        self.n = 0

    def apply(self, action, params):
        if action == "dec" and self.n == 0:
            raise ActionRejected("empty")
        self.n += params.get("by", 1) if action == "inc" else -1
        return {}

    def observe(self):
        return None

    def extra_checks(self, action, params):
        return ("bookkeeping", "counter_below_ten", f"counter at {self.n}") if self.n >= 10 else None


def test_free_model_runs_the_adapters_own_checks() -> None:
    ad = _Counter()
    ad.reset()
    prog = [Act("dec", {})] + [Act("inc", {"by": 3})] * 5
    f = Lockstep(FreeModel(), ad).run(prog)
    assert f is not None and (f.kind, f.checks) == ("bookkeeping", ["counter_below_ten"])
    assert EXIT[f.kind] == 10 and len(f.trail) == 4 and f.program[0].action == "inc"   # refused: skipped


def test_one_shrinker_keeps_what_still_fails() -> None:
    def fails(p):
        return p if 3 in p and 7 in p else None
    assert shrink(list(range(20)), fails, 5.0) == [3, 7]

    def alts(p):                           # substitution: 9 alone also fails, but only via 8 -> 9
        return [[9] if x == 8 else [] for x in p]
    assert shrink([1, 8, 2], lambda p: p if 9 in p or (8 in p and 1 in p) else None, 5.0, alts) == [9]


def test_leading_check_order() -> None:
    assert lockstep.lead(["refcount_equals_holders", "hit_sound_swa_window"]) == "hit_sound_swa_window"


def test_replay_reports_each_way_a_trace_fails() -> None:
    spec = Spec(CFG, "shared_free_list")
    prog = next(p for seed in range(50) if (p := _spec_run(spec, 60, seed))
                and any(spec.check(s) for s in _states(spec, p)))
    cut = next(n for n, s in enumerate(_states(spec, prog)) if spec.check(s))
    trace = to_trace(spec, [(x.action, x.params) for x in prog[:cut + 1]], seed=0)
    code, out = replay(trace)
    assert code == 10 and out["violation"]["invariants"] == trace.steps[-1].expect["violations"]
    trace.steps[-1].expect["violations"] = ["no_such_invariant"]          # the trace says otherwise
    code, out = replay(trace)
    assert code == 13 and out["divergence"]["why"] == "violated invariants differ from the trace"
    clean = Trace(CFG, [Step("bind", {"r": 0})])                           # not enabled at Init
    code, out = replay(clean)
    assert code == 13 and out["divergence"]["why"] == "not enabled in the spec"


def test_old_diff_traces_replay_with_their_modes() -> None:
    """kvcheck diff traces written before the core mark probes and follow-through steps; the
    ones the SUT refused are skipped, as when they were recorded."""
    probe = Trace(CFG, [Step("bind", {"r": 0}, {"mode": "probe"}), Step("submit", {"r": 0, "n": 1})])
    assert replay(probe)[0] == 0


def _states(spec: Spec, prog: list) -> list:
    s, out = spec.init(), []
    for x in prog:
        s = x.effect(s)
        out.append(s)
    return out


OLD = Path(__file__).parent / "traces-78478e7"      # written by the code before the core


@pytest.mark.parametrize("name, sut, code, check", [
    ("fuzz-spec-shared_free_list", None, 10, "five_state_routing"),
    ("fuzz-toy-hash_only_hit", "examples.toy_allocator:ToyAllocator", 13, "decision_matches_spec"),
    ("fuzz-reference-engine_tail_check_skipped", "reference", 10, "hit_sound_tail"),
    ("diff-reference-engine_pinned_object_evicted", "reference", 10, "toctou_bound_stable"),   # a probe
    ("diff-reference-engine_load_before_checksum", "reference", 13, "abstract_state_matches_spec"),  # refused follow steps
    ("diff-reference-engine_cache_salt_missing", "reference", 13, "decision_matches_spec"),   # isolation
])
def test_traces_written_before_the_core_replay(name, sut, code, check, monkeypatch) -> None:
    """`kvcheck replay` (the old code gave 13 for the follow-through diff trace: a follow step
    the engine had refused when it was recorded)."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    trace = Trace.load(OLD / f"{name}.json")
    assert trace.violation and check in trace.violation["checks"]
    got, out = replay(trace, None if sut is None else resolve_sut(sut, trace.meta.get("sut_fault"))())
    assert got == code and check in out["finding"]["checks"], out


def test_vllm_trace_written_before_the_core_replays() -> None:
    pytest.importorskip("vllm")
    from kvcheck.engines.vllm import drivers as V
    out = V.replay(OLD / "vllm-full_swa-swa_hit_unchecked.json")
    assert out["reproduced"] and out["exit_code"] == 10 and out["violation"]["check"] == "hit_sound_swa_window"


def test_one_shrinker_deletes_related_steps_together() -> None:
    # the failure needs 5 and 9; steps 2 and 7 are one request's: only both together may go
    # (a program with one but not the other fails differently); no contiguous chunk holds them
    def fails(p):
        if 5 in p and 9 in p and ((2 in p) == (7 in p)):
            return p
        return None
    prog = [1, 2, 3, 5, 7, 9]
    assert shrink(prog, fails, 5.0) == [2, 5, 7, 9]
    related = lambda p: [[i for i, x in enumerate(p) if x in (2, 7)]]   # noqa: E731
    assert shrink(prog, fails, 5.0, related=related) == [5, 9]
