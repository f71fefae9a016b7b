"""Worker processes that a Ctrl-C stops quietly and promptly.

Owns the process pool of `fuzz --workers` and `mutants --workers`: at most one worker per core
(more only thrash), workers that ignore SIGINT while idle (so a Ctrl-C never prints a
traceback per process) and take it as KeyboardInterrupt only while running a job, jobs not yet
started skipped once the run is interrupted, and a parent that, on Ctrl-C, forwards SIGINT to
its workers (a `kill -INT` reaches the parent only), collects what they return within a grace
period and terminates the rest.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any, Callable, Iterator

_STOP: Any = None          # the pool's "interrupted" event, set in each worker by _init


def cores() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - platforms without affinity
        return max(1, os.cpu_count() or 1)


def cap_workers(n: int) -> tuple[int, str | None]:
    """`n` capped at the cores, and the note to print when it was."""
    c = cores()
    if n <= c:
        return n, None
    return c, f"--workers {n} capped at {c} (the cores this machine gives this process)"


def keep_interrupts() -> None:
    """A Ctrl-C that lands inside a garbage-collector callback (Hypothesis registers one) would
    be swallowed as an "unraisable" exception: Python prints "Exception ignored ... Traceback"
    and the interrupt is lost. Re-deliver it to the main thread instead, quietly; every other
    unraisable goes to the default hook.

    The re-delivery must not happen inside the hook: `_thread.interrupt_main()` there runs the
    SIGINT handler at the very next bytecode, still inside the hook, and the new
    KeyboardInterrupt is swallowed the same way. A short-lived thread simulates the Ctrl-C once
    the hook has returned; should that one land in a gc callback too, the hook re-arms."""
    import sys

    default = sys.__unraisablehook__

    def hook(u: Any) -> None:
        if not isinstance(u.exc_value, KeyboardInterrupt):
            default(u)
            return
        while True:
            try:
                _redeliver_soon()
                return
            except KeyboardInterrupt:    # another Ctrl-C arrived inside this hook: still owed
                continue

    sys.unraisablehook = hook


def _redeliver_soon(delay_s: float = 0.01) -> None:
    import _thread
    import threading

    t = threading.Timer(delay_s, _thread.interrupt_main)
    t.daemon = True
    t.start()


def _init(stop: Any, initializer: Callable[[], None] | None) -> None:
    global _STOP
    _STOP = stop
    keep_interrupts()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if initializer is not None:
        initializer()


def _guarded(fn: Callable[..., Any], args: tuple) -> Any:
    if _STOP is not None and _STOP.is_set():
        raise KeyboardInterrupt          # queued before the Ctrl-C: not started
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return fn(*args)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class Interrupted(Exception):
    """Raised by `run_jobs` after Ctrl-C, once every result that came back was yielded."""


def run_jobs(fn: Callable[..., Any], jobs: dict[Any, tuple], workers: int,
             initializer: Callable[[], None] | None = None,
             grace_s: float = 10.0) -> Iterator[tuple[Any, Any]]:
    """Yield (key, result-or-exception) as jobs finish. A job that raised KeyboardInterrupt
    (it was interrupted, or never started) is not yielded. On Ctrl-C: SIGINT to the workers,
    up to `grace_s` for their (partial) results, then `Interrupted`."""
    ctx = multiprocessing.get_context("spawn" if os.name != "posix" else "fork")
    stop = ctx.Event()
    ex = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init,
                             initargs=(stop, initializer))
    futs: dict[Future, Any] = {ex.submit(_guarded, fn, args): key for key, args in jobs.items()}
    pending = set(futs)
    interrupted = False
    try:
        while pending:
            try:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
            except KeyboardInterrupt:
                interrupted = True
                break
            for f in done:
                item = _outcome(f)
                if item is not None:
                    yield futs[f], item
        if interrupted:
            stop.set()
            for f in pending:
                f.cancel()
            for pid in list(getattr(ex, "_processes", {}) or {}):
                try:
                    os.kill(pid, signal.SIGINT)
                except OSError:
                    pass
            deadline = time.monotonic() + grace_s
            running = {f for f in pending if not f.cancelled()}
            while running and time.monotonic() < deadline:
                try:
                    done, running = wait(running, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=FIRST_COMPLETED)
                except KeyboardInterrupt:   # a second Ctrl-C: stop waiting
                    break
                for f in done:
                    item = _outcome(f)
                    if item is not None:
                        yield futs[f], item
            raise Interrupted()
    finally:
        _shutdown(ex, force=interrupted)


def _outcome(f: Future) -> Any:
    if f.cancelled():
        return None
    e = f.exception()
    if isinstance(e, KeyboardInterrupt):
        return None
    return e if e is not None else f.result()


def _shutdown(ex: ProcessPoolExecutor, force: bool) -> None:
    procs = list((getattr(ex, "_processes", {}) or {}).values())
    if force:
        for p in procs:
            if p.is_alive():
                p.terminate()
    ex.shutdown(wait=True, cancel_futures=True)
