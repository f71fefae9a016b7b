"""`kvcheck fuzz --exhaustive DEPTH`: a planted fault is found with a shortest trace that replays
(and replays clean on the fix); a clean SUT is "complete"; state caching prunes, by counts
computed here on the spec alone; a small budget never claims completeness; bad depths are exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcheck.checker.cli import main
from kvcheck.fuzz.campaign import Budget, machine_actions
from kvcheck.fuzz.exhaustive import run_exhaustive
from kvcheck.fuzz.machine import drive_model
from kvcheck.fuzz.suts import resolve_sut
from kvcheck.spec.config import Config
from kvcheck.spec.system import Spec

ROOT = Path(__file__).resolve().parents[2]
SEQ = "examples.seq_adapter:Adapter"
SEQ_CFG = str(ROOT / "examples" / "seq.json")
TINY = {"layers": [{"kind": "full"}], "blocks": 2, "requests": 1, "tiers": ["device"]}


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)            # MODULE:CLASS resolves from the working directory


def _fuzz(capsys, *args: str) -> tuple[int, dict]:
    code = main(["fuzz", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_planted_fault_found_shortest_and_replays(tmp_path, capsys) -> None:
    code, res = _fuzz(capsys, "--sut", SEQ, "--config", SEQ_CFG, "--fault", "key_without_prefix",
                      "--exhaustive", "8", "--out", str(tmp_path))
    assert code == 10, res
    f = res["findings"][0]
    assert "hit_sound_content" in f["checks"]
    # breadth first: no program shorter than the finding's fails (the search stopped at its level)
    assert len(f["trace_steps"]) == res["exhaustive"]["reached"] + 1 and not res["exhaustive"]["complete"]
    assert "replay" in f and f["replay"].startswith("kvcheck replay ")
    assert main(["replay", f["trace"], "--sut", SEQ]) == 10
    assert main(["replay", f["trace"], "--sut", SEQ, "--without-fault"]) == 0


def test_clean_sut_is_complete(tmp_path, capsys) -> None:
    code, res = _fuzz(capsys, "--sut", SEQ, "--config", SEQ_CFG, "--exhaustive", "4", "--out", str(tmp_path))
    e = res["exhaustive"]
    assert code == 0 and res["findings"] == [] and e["complete"] and e["depth"] == 4
    assert res["verdict"].startswith("holds: exhaustive to depth 4, complete")
    assert e["edges"] == e["programs"] - 1 and e["states"] <= e["programs"]


def _spec_counts(cfg: Config, depth: int, actions: frozenset[str] | None) -> tuple[int, int, int]:
    """On the spec alone: raw action sequences up to `depth`, and what a cached breadth-first
    search over spec states runs (programs) and reaches (states)."""
    spec = Spec(cfg)
    insts = [i for i in spec.instances if actions is None or i.action in actions]
    raw, level = 0, [spec.init()]
    for _ in range(depth):
        level = [i.effect(s) for s in level for i in insts if i.guard(s)]
        raw += len(level)
    seen, frontier, programs = {spec.init()}, [spec.init()], 1
    for _ in range(depth):
        nxt = []
        for s in frontier:
            for i in insts:
                if i.guard(s):
                    programs += 1
                    t = i.effect(s)
                    if t not in seen:
                        seen.add(t)
                        nxt.append(t)
        frontier = nxt
    return raw, programs, len(seen)


def test_state_caching_prunes(tmp_path) -> None:
    cfg = Config.from_dict(TINY)
    # the spec as SUT observes the spec state: the search's counts are the spec BFS's exactly
    res = run_exhaustive(cfg, "spec", 5, Budget(seconds=60), out=tmp_path)
    raw, programs, states = _spec_counts(cfg, 5, None)
    e = res["exhaustive"]
    assert res["exit_code"] == 0 and e["complete"]
    assert (e["programs"], e["states"]) == (programs, states)
    assert e["programs"] < 1 + raw
    # a real SUT, over the actions it declares: fewer programs than raw sequences too
    seq = Config.load(SEQ_CFG)
    spec = Spec(seq)
    factory = resolve_sut(SEQ)
    declared = frozenset(i.action for i in drive_model(spec, factory, machine_actions(spec, factory)).instances)
    res = run_exhaustive(seq, SEQ, 4, Budget(seconds=60), out=tmp_path)
    raw, programs, _ = _spec_counts(seq, 4, declared)
    assert res["exhaustive"]["complete"] and res["exhaustive"]["programs"] < 1 + raw
    assert res["exhaustive"]["programs"] >= programs     # the SUT's observation only splits states


def test_budget_too_small_is_never_complete(tmp_path, capsys) -> None:
    code, res = _fuzz(capsys, "--sut", SEQ, "--config", SEQ_CFG, "--exhaustive", "30", "--budget", "50",
                      "--out", str(tmp_path))
    e = res["exhaustive"]
    assert code == 3 and not e["complete"] and e["stopped"] == "budget" and e["reached"] < 30
    assert "complete" not in res["verdict"].replace("incomplete", "")
    assert f"to depth {e['reached']}<30" in res["verdict"]


@pytest.mark.parametrize("depth", ["0", "-2", "two", "1.5"])
def test_bad_depth_is_exit_2_one_line(depth, capsys) -> None:
    with pytest.raises(SystemExit) as ex:
        main(["fuzz", "--sut", SEQ, "--config", SEQ_CFG, "--exhaustive", depth])
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--exhaustive" in err


def test_own_driver_engine_refused(capsys) -> None:
    assert main(["fuzz", "--sut", "vllm", "--exhaustive", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--exhaustive" in err
