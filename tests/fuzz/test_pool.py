"""A Ctrl-C that lands inside a gc callback still stops the run, quietly.

Hypothesis registers a gc callback; a SIGINT whose handler runs inside it is an "unraisable"
exception that Python prints as a traceback and drops. This once failed CI (the first hook
re-raised inside itself, so the re-delivered interrupt was swallowed the same way). The child
sends itself SIGINT from inside its own gc callback, so the landing is certain, not a race.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import gc, os, signal, sys, time
sys.path.insert(0, {root!r})
from kvcheck.fuzz.pool import keep_interrupts
if {hook}:
    keep_interrupts()
fired = []
def cb(phase, info):
    if phase == "start" and not fired:
        fired.append(1)
        os.kill(os.getpid(), signal.SIGINT)     # its handler runs inside this callback
        sum(range(10000))                       # bytecode for the handler to land on
gc.callbacks.append(cb)
try:
    end = time.monotonic() + 5
    while time.monotonic() < end:
        [[] for _ in range(1000)]
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
"""


def _run(hook: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), hook=hook)],
                          capture_output=True, text=True, timeout=60)


def test_an_interrupt_inside_a_gc_callback_is_redelivered_quietly() -> None:
    r = _run(hook=True)
    assert r.stdout.strip() == "interrupted", r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr


def test_without_the_hook_python_drops_it() -> None:
    """The control: the case is real, plain Python loses this interrupt and prints a traceback."""
    r = _run(hook=False)
    assert r.stdout.strip() == "not interrupted" and "KeyboardInterrupt" in r.stderr, r.stderr
