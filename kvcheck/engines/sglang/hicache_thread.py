"""HiCacheController's own transfer threads, held and stepped by kvcheck (KVCHECK_CPU_STUB).

Releases whose controller moves the bytes on threads of its own (0.4.10-0.5.1:
`write_thread_func_direct` takes a write off `write_queue`, copies it on `write_stream`, waits
for the stream and acknowledges on `ack_write_queue`; `load_thread_func_layer_by_layer` wakes on
`load_cache_event`, copies layer by layer on `load_stream`, counts each layer on the
`LayerDoneCounter` once the stream finished it, and acknowledges on `ack_load_queue`) are driven
with those functions themselves, each on a real thread of its own, but never two threads at once:
kvcheck hands control to a held thread and takes it back where that thread would block, so every
interleaving is the same from run to run. Where a thread blocks, and what wakes it:

- its loop's next job (`stop_event.is_set()` at the top of the loop, where the real thread then
  blocks on `write_queue.get` / `load_cache_event.wait`): it waits until that queue has an
  operation or that event is set (`ROLES`), as the real one does (it polls with a 1 s timeout);
- `stream.synchronize()` on a side stream with work queued (the CPU device stand-in,
  hicache_cpu.py): it waits until the device ran that work.

A woken thread runs promptly, up to its next blocking point (`HeldThreads.run`: kvcheck calls it
where the scheduler just gave a thread work, and at every step); the device is as lazy as on the
newer releases' stand-in: it runs queued work at a step boundary (`settle`) or while the scheduler
waits for it. The scheduler waits for a held thread only in `LayerDoneCounter.wait_until` (the
forward waiting for a layer's load), on a `threading.Condition` made in cache_controller:
`_DrivenCondition.wait` lets the device run what the parked threads wait on and the threads run
on, instead of sleeping until a notify; a wait that nothing can end (no thread able to move, no
queued work) raises instead of hanging, as SGLang's scheduler would hang there.
"""
from __future__ import annotations

import sys
import threading
import traceback
from typing import Any, Callable

from .hicache_cpu import CPU_DEVICE

# the controller attribute that holds a thread -> when its loop has a next job to take
ROLES: dict[str, Callable[[Any], bool]] = {
    "write_thread": lambda ctl: not ctl.write_queue.empty(),
    "load_thread": lambda ctl: ctl.load_cache_event.is_set(),
}
_HANDOFF_S = 60.0           # a held thread that does not return to a blocking point kvcheck drives
_tls = threading.local()


class _Stopped(BaseException):
    """Unwinds a held thread of a cache kvcheck dropped (not an Exception: SGLang's loops catch those)."""


class _HeldThread:
    """Stands for `threading.Thread` in cache_controller: the controller's `start()` hands the
    thread to kvcheck (`THREADS`), which runs its target on a real thread, one thread at a time."""

    def __init__(self, group: Any = None, target: Any = None, name: Any = None, args: Any = (),
                 kwargs: Any = None, *, daemon: Any = None) -> None:
        self.target, self.args, self.kwargs, self.name = target, tuple(args), dict(kwargs or {}), name
        self.daemon, self.worker = daemon, None

    def start(self) -> None:
        self.worker = THREADS.adopt(self)

    def is_alive(self) -> bool:
        return self.worker is not None and self.worker.state != "done"

    def join(self, timeout: Any = None) -> None:
        """The controller's `reset()` sets `stop_event`, then joins: the thread runs on to its
        loop's top, sees the event and returns."""
        while self.worker is not None and self.worker.state != "done" and self.worker.runnable():
            self.worker.resume()


class _DrivenEvent(threading.Event):
    """`threading.Event` as cache_controller makes them (its `stop_event`). Read by anyone else it is
    an Event; read by a held thread at the top of its loop it is also where that thread blocks for
    its next job: it waits there until the job is there (`ROLES`) or the event is set."""

    def is_set(self) -> bool:
        w = getattr(_tls, "worker", None)
        if w is None or super().is_set():
            return super().is_set()
        while not w.has_work():
            w.park("idle")
            if super().is_set():
                return True
        return False


class _DrivenCondition(threading.Condition):
    """`threading.Condition` as cache_controller makes them (the LayerDoneCounter's). The scheduler
    waiting on one releases the lock, as a wait does, while the device and the held threads run
    (`THREADS.device_wait`), then takes it back: the caller re-checks its predicate, as after a
    notify."""

    def wait(self, timeout: Any = None) -> bool:
        if getattr(_tls, "worker", None) is not None or not THREADS.workers:
            return super().wait(timeout)
        if not self._is_owned():
            raise RuntimeError("cannot wait on un-acquired lock")
        saved = self._release_save()
        try:
            THREADS.device_wait()
        finally:
            self._acquire_restore(saved)
        return True


class _Threading:
    """cache_controller's `threading`: Thread, Event and Condition as above, the rest the module's."""

    Thread, Event, Condition = _HeldThread, _DrivenEvent, _DrivenCondition

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)


class _Worker:
    """A held thread's real thread and the hand-off between it and the scheduler's thread."""

    def __init__(self, held: _HeldThread, ctl: Any, role: str | None, what: str) -> None:
        self.held, self.ctl, self.role, self.what = held, ctl, role, what
        self.state, self.stream, self.stop, self.error = "new", None, False, None
        self.cv, self.turn = threading.Condition(threading.Lock()), "sched"
        self.thread = threading.Thread(target=self._main, daemon=True, name=f"kvcheck-held-{role}")
        if role is not None:            # (one kvcheck cannot step never runs)
            self.thread.start()

    def has_work(self) -> bool:
        return self.stop or ROLES[self.role](self.ctl)

    def runnable(self) -> bool:
        if self.role is None or self.state == "done":
            return False
        if self.state == "stream":
            return self.stop or not self.stream.queue
        return self.state == "new" or self.has_work() or self.stopping()

    def stopping(self) -> bool:
        """The controller set its stop_event (its `reset()`): the loop's top returns."""
        ev = getattr(self.ctl, "stop_event", None)
        return isinstance(ev, _DrivenEvent) and threading.Event.is_set(ev)

    def _main(self) -> None:
        _tls.worker = self
        with self.cv:
            self.cv.wait_for(lambda: self.turn == "worker")
        try:
            if not self.stop:
                self.held.target(*self.held.args, **self.held.kwargs)
        except _Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - SGLang's thread died: raised to the scheduler
            self.error = e
        finally:
            with self.cv:
                self.state, self.turn = "done", "sched"
                self.cv.notify_all()

    def resume(self) -> None:
        """(scheduler's thread) Let the thread run until it blocks again or returns."""
        with self.cv:
            self.turn = "worker"
            self.cv.notify_all()
            if not self.cv.wait_for(lambda: self.turn == "sched", timeout=_HANDOFF_S):
                stack = "".join(traceback.format_stack(sys._current_frames().get(self.thread.ident)))
                raise RuntimeError(f"SGLang's {self.role} (held by kvcheck) did not return to a point kvcheck "
                                   f"drives within {_HANDOFF_S:.0f} s; it is at:\n{stack}")
        if self.error is not None:
            e, self.error = self.error, None
            raise e

    def park(self, state: str, stream: Any = None) -> None:
        """(the held thread) Block here; the scheduler's thread runs until it resumes this one."""
        with self.cv:
            self.state, self.stream, self.turn = state, stream, "sched"
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.turn == "worker")
            self.state, self.stream = "running", None
        if self.stop:
            raise _Stopped()


class HeldThreads:
    """The held threads of the cache being driven (one process drives one cache at a time)."""

    def __init__(self) -> None:
        self.workers: list[_Worker] = []

    def install(self, cc: Any) -> None:
        """Hold the threads the release's controller starts (cache_controller's `threading`)."""
        if not isinstance(cc.threading, _Threading):
            cc.threading = _Threading()
        CPU_DEVICE.thread_sync = self.stream_sync

    def adopt(self, held: _HeldThread) -> _Worker:
        ctl = getattr(held.target, "__self__", None)
        attr = next((n for n, v in vars(ctl).items() if v is held), None) if ctl is not None else None
        w = _Worker(held, ctl, attr if attr in ROLES else None,
                    f"{attr or '?'} ({getattr(held.target, '__qualname__', repr(held.target))})")
        self.workers.append(w)
        return w

    def unknown(self) -> list[str]:
        """Threads the controller started that kvcheck does not know how to step (never run)."""
        return [w.what for w in self.workers if w.role is None]

    def reset(self) -> None:
        """Drop the held threads of the last cache: each unwinds where it is parked."""
        for w in self.workers:
            w.stop = True
            if w.state != "done" and w.role is not None:
                w.resume()
        self.workers.clear()

    def stream_sync(self, stream: Any) -> bool:
        """`stream.synchronize()` (hicache_cpu's hook): on a held thread, block until the device ran
        the stream's queued work; elsewhere (False) the caller runs it, as a host wait lets it run."""
        w = getattr(_tls, "worker", None)
        if w is None:
            return False
        while stream.queue:
            w.park("stream", stream)
        return True

    def run(self) -> bool:
        """Every held thread that can move runs up to its next blocking point; whether any moved."""
        moved = False
        self.workers = [w for w in self.workers if w.state != "done"]    # (threads a controller reset joined)
        for _ in range(100_000):
            ready = [w for w in self.workers if w.runnable()]
            if not ready:
                return moved
            for w in ready:
                w.resume()
            moved = True
        raise RuntimeError("SGLang's held transfer threads never came to rest (100000 hand-offs)")

    def settle(self) -> None:
        """A step boundary: the device ran what was queued (CPU_DEVICE.progress) and the threads it
        unblocked ran, until neither the device nor a thread has anything left to do."""
        while self.run():
            CPU_DEVICE.progress()

    def device_wait(self) -> None:
        """The scheduler waits for a held thread: threads that can move run; if none can, the device
        runs the streams parked threads wait on, and they run on. Nothing to run: it would hang."""
        if self.run():
            return
        streams = list({id(w.stream): w.stream for w in self.workers
                        if w.state == "stream" and w.stream.queue}.values())
        if not streams:
            raise RuntimeError("the scheduler waits on a LayerDoneCounter that no SGLang thread will advance "
                               "(no held thread can move, no transfer is queued): SGLang would hang here")
        for s in streams:
            s.run()
        self.run()


THREADS = HeldThreads()
