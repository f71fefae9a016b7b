"""The standalone reproducer of a scheduler-drive finding: one template for every layout and fault.

`<trace>.repro.py` runs where only SGLang (and torch) is installed: it replays the trace's steps
(`start`, `submit`, `step`, `abort`) through SGLang's own `Scheduler` on CPU, printing each step and
what the checks found, and exits 1 while the finding is there, 0 when it is not (fixed, or not
this release), 2 when the release cannot be driven. What builds the scheduler on CPU, the model
worker and the checks are kvcheck's scheduler drive itself, frozen at the end of the script as
readable text (kvcheck/fuzz/bundle.py: its modules and nothing else, about 3,000 lines); so the
script shows the engine's behaviour by the same code that found it, not by a second copy of it.
A planted fault (a kvcheck negative control) stays planted unless `--clean`.
"""
from __future__ import annotations

from typing import Any

from kvcheck.fuzz.bundle import INSTALLER, bundle_text

DRIVE = "kvcheck.engines.sglang.scheduler.adapter"

BODY = '''

def main():
    clean = "--clean" in sys.argv[1:]
    install()
    from kvcheck.engines.sglang.install import SglangUnavailable, sglang_version
    from kvcheck.engines.sglang.scheduler.adapter import SchedAdapter
    from kvcheck.fuzz.boundary import CannotDrive
    from kvcheck.spec.refusal import ActionRejected
    lay = types.SimpleNamespace(**{**LAYOUT, "components": tuple(LAYOUT["components"])})
    fault = None if clean else FAULT
    try:
        ad = SchedAdapter(lay, fault, CAPACITY)
    except SglangUnavailable as e:
        print(f"cannot drive this SGLang here: {e}")
        return 2
    print(f"SGLang {sglang_version()}, layout {lay.name} ({lay.cls} {'+'.join(lay.components)}, page "
          f"{lay.page_size}, window {lay.window}); recorded on {RECORDED} as {EXPECTED!r}"
          + (f"; PLANTED FAULT {fault!r}" if fault else ""))
    try:
        for i, (action, params) in enumerate(STEPS):
            try:
                ad.apply(action, dict(params))
            except ActionRejected as e:
                print(f"step {i:3d} {action}: refused ({e})")
                continue
            bad = ad.extra_checks(action, params)
            running = sorted(ad.reqs)
            print(f"step {i:3d} {_label(action, params)}: live requests {running}")
            if bad:
                kind, check, message = bad
                print(f"FOUND {check} ({kind}) at step {i}: {message}")
                print("(the recorded finding)" if check == EXPECTED else f"(recorded: {EXPECTED})")
                return 1
    except CannotDrive as e:
        print(f"cannot drive this SGLang here (kvcheck's side, not a finding): {e}")
        return 2
    finally:
        ad.close()
    print(f"no check failed in {len(STEPS)} steps: not reproduced on SGLang {sglang_version()}")
    return 0


def _label(action, params):
    if action == "submit":
        return (f"submit {params['r']} ({len(params['tokens'])} prompt tokens, max_new {params['max_new']}"
                f", priority {params.get('priority')})")
    if action == "step":
        return f"step x{params.get('times', 1)}"
    if action == "start":
        return "start " + ", ".join(f"{k}={v}" for k, v in params["config"].items())
    return f"{action} {params.get('r', '')}"


if __name__ == "__main__":
    sys.exit(main())

'''


def sched_reproducer_source(trace: Any, trace_path: str) -> str:
    """The script's text for a trace of a `NAME@sched` layout."""
    lay = dict(trace.meta.get("layout") or {})
    v = trace.violation or {}
    layout = {"name": lay.get("name"), "cls": lay.get("class"), "components": list(lay.get("components") or ["full"]),
              "page_size": int(lay.get("page_size", 1)), "window": lay.get("window"),
              "capacity": int(lay.get("capacity", 64))}
    steps = [[s.action, s.params] for s in trace.steps]
    head = (f'"""Standalone reproducer of a kvcheck finding through SGLang\'s own Scheduler (CPU).\n\n'
            f"Recorded on SGLang {trace.meta.get('sglang_version')}, layout {lay.get('name')!r}: "
            f"{lay.get('doc') or lay.get('class')}\n"
            f"Check {v.get('check')} ({v.get('kind')}) at step {v.get('step')}: {v.get('message', '')}\n"
            f"Trace: {trace_path} (`kvcheck replay {trace_path} --sut sglang`)\n\n"
            "    python THIS_FILE [--clean]      # needs SGLang and torch only; exit 1: the finding is there,\n"
            "                                    # 0: not (fixed, or not this release), 2: cannot drive here\n\n"
            "The steps below go to SGLang's own Scheduler: `submit` through handle_generate_request, `step`\n"
            "as passes of its event loop, `abort` through abort_request. The scheduler's CPU build, the\n"
            "model worker (tokens from the trace) and the checks are kvcheck's scheduler drive, frozen as\n"
            "text at the end of this file (`# >>> module` markers; `install()` serves them to import).\n"
            + (f"PLANTED FAULT {trace.fault!r}: a kvcheck negative control, not SGLang's code; --clean leaves it out.\n"
               if trace.fault else "")
            + '"""\n')
    data = (f"import sys\nimport types\n\nLAYOUT = {layout!r}\nCAPACITY = {int(trace.meta.get('capacity', layout['capacity']))}\n"
            f"FAULT = {trace.fault!r}\nEXPECTED = {v.get('check')!r}\nRECORDED = {trace.meta.get('sglang_version')!r}\n"
            "STEPS = [\n" + "".join(f"    {s!r},\n" for s in steps) + "]\n")
    return head + data + INSTALLER + BODY + "# " + "-" * 98 + "\n" \
        + "# kvcheck's scheduler drive, frozen (read as text by install(); never run from here)\n" + bundle_text([DRIVE])
