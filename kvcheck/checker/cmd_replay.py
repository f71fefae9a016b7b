"""`kvcheck replay TRACE`: check the trace, then replay it (the loop is replay.py)."""
from __future__ import annotations

import argparse

from ..spec.trace import Trace
from ..fuzz import registry
from ..fuzz.engine import Engine, EngineUnavailable
from .common import UsageError, check_fault, emit


def _engine_with_replay(name: str | None) -> Engine | None:
    """The registered engine that replays its own traces (vLLM, SGLang), if `name` is one."""
    if not name or ":" in name or name == "spec":
        return None
    try:
        eng = registry.get(name)
    except registry.UnknownEngine:
        return None
    return eng if eng.has_replay() else None


def _same_config(args: argparse.Namespace, trace: Trace) -> None:
    """A trace carries the config it was recorded under and replays under it; `--config` (the
    file the campaign ran with) is accepted as a check that they agree, refused when they do not."""
    if not getattr(args, "config", None):
        return
    from ..spec.config import Config
    want, got = Config.load(args.config).to_dict(), trace.config.to_dict()
    if want != got:
        keys = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        raise UsageError(f"--config {args.config} differs from the config the trace carries at "
                         f"{', '.join(keys)}; a trace replays under its own config: drop --config")


def _write_reproducer(eng: Engine, trace: Trace, args: argparse.Namespace) -> dict:
    """A copy of the trace in --reproducer DIR and the engine's script beside it."""
    from pathlib import Path
    out = Path(args.reproducer)
    try:
        out.mkdir(parents=True, exist_ok=True)
        path = str(trace.save(out / Path(args.trace).name))
        return eng.write_reproducer(trace, path)
    except OSError as e:
        raise UsageError(f"--reproducer {args.reproducer}: cannot write there ({e.strerror})") from None


def cmd_replay(args: argparse.Namespace) -> int:
    from .replay import replay_trace, sut_by_name
    trace = Trace.load(args.trace)
    _same_config(args, trace)
    name = args.sut or trace.sut
    eng = _engine_with_replay(name)
    if eng is not None:
        rep = _write_reproducer(eng, trace, args) if getattr(args, "reproducer", None) else None
        try:
            code, res, text = eng.replay(trace)
        except (EngineUnavailable, ValueError) as e:     # (a trace field the engine cannot take: one line)
            wrote = f" (the reproducer was written: {rep['reproducer']})" if rep and rep.get("reproducer") else ""
            raise UsageError(f"{e}{wrote}") from None
        if rep is not None:
            res = {**res, **rep}
            text += f"\n  reproducer: {rep['reproducer'] or rep.get('reproducer_note')}"
        emit(args, res, lambda: f"kvcheck replay {args.trace} {text}")
        return code
    if getattr(args, "reproducer", None):
        raise UsageError(f"--reproducer: standalone reproducers are written for engine traces (vLLM, SGLang); "
                         f"this trace replays on {name or 'the spec'}")
    if trace.fault is not None:
        check_fault(trace.fault, ("spec",), "the trace's 'fault' (replayed on the spec)")
    try:
        fault = None if args.without_fault else trace.meta.get("sut_fault", trace.fault)
        sut = sut_by_name(args.sut, fault) if args.sut else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    code, out = replay_trace(trace, sut)

    def text() -> str:
        lines = [f"kvcheck replay {args.trace}: {out['steps']} steps on the spec"
                 + (f" and {out['sut']}" if out.get("sut") else "")
                 + (f" (fault {out['fault']})" if out.get("fault") else "")]
        if "divergence" in out:
            d = out["divergence"]
            lines.append(f"  diverged at step {d['step']} `{d['action']}`: {d['why']}")
        if "differential" in out:
            d = out["differential"]
            lines.append(f"  reuse != recompute at step {d['step']} `{d['action']}`: {d['why']}")
        if "violation" in out:
            v = out["violation"]
            if "invariants" in v:
                lines.append(f"  reproduced: {', '.join(v['invariants'])} violated at step {v['step']} `{v['action']}`")
                lines += [f"    {w}" for w in v["where"][:5]]
            else:           # an adapter's own check (e.g. the hash-chain shadow's hit_sound_content)
                lines.append(f"  reproduced: [{v['kind']}] {v['check']} at step {v['step']} `{v['action']}`: {v['message']}")
        if not {"divergence", "differential", "violation"} & set(out):
            lines.append("  every step enabled, decisions as recorded, no invariant violated")
        lines.append(f"  exit {code}")
        return "\n".join(lines)

    out["exit_code"] = code
    emit(args, out, text)
    return code


