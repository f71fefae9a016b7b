"""SGLang's HiCacheController threads held and stepped by kvcheck (hicache_thread.py): releases
whose controller writes through and loads back on threads of its own (0.4.10-0.5.1). A write is
copied only once the device ran it and acknowledged only after the copy; a load is counted layer
by layer as the consumer waits for it (`LayerDoneCounter.wait_until`), and a forward that does not
wait reads bytes not yet loaded; a dropped cache's threads unwind; a wait no thread can end raises
instead of hanging. The first tests drive a controller of that shape without SGLang; the last one
SGLang's own controller, where the installed release has such threads (skipped elsewhere).
"""
from __future__ import annotations

import queue
import threading
import types

import pytest


class _Controller:
    """The shape of 0.5.1's HiCacheController threads (cache_controller.py): a write thread taking
    operations off a queue, a load thread woken by an event that counts layers on a condition."""

    def __init__(self, th, device) -> None:
        self.device, self.layers = device, 2
        self.stop_event = th.Event()
        self.write_queue, self.ack_write_queue = queue.PriorityQueue(), queue.Queue()
        self.load_queue, self.ack_load_queue = queue.Queue(), queue.Queue()
        self.load_cache_event = threading.Event()
        self.cond, self.counter = th.Condition(), self.layers
        self.write_stream, self.load_stream = device.Stream(), device.Stream()
        self.src = [[1.0] * 4 for _ in range(self.layers)]
        self.dst = [[0.0] * 4 for _ in range(self.layers)]
        self.write_thread = th.Thread(target=self.write_thread_func, daemon=True)
        self.load_thread = th.Thread(target=self.load_thread_func, daemon=True)
        self.write_thread.start()
        self.load_thread.start()

    def _copy(self, layer: int, i: int) -> None:
        def run() -> None:
            self.dst[layer][i] = self.src[layer][i]
        self.device.current_stream().queue.append(run)

    def write_thread_func(self) -> None:
        self.device.set_stream(self.write_stream)
        while not self.stop_event.is_set():
            try:
                op = self.write_queue.get(block=True, timeout=1)
                for layer in range(self.layers):
                    self._copy(layer, op)
                self.write_stream.synchronize()
                self.ack_write_queue.put(op)
            except queue.Empty:
                continue

    def load_thread_func(self) -> None:
        self.device.set_stream(self.load_stream)
        while not self.stop_event.is_set():
            self.load_cache_event.wait(timeout=1)
            if not self.load_cache_event.is_set():
                continue
            self.load_cache_event.clear()
            op = self.load_queue.get()
            with self.cond:
                self.counter = 0
            for layer in range(self.layers):
                self._copy(layer, op)
                self.load_stream.synchronize()
                with self.cond:
                    self.counter += 1
                    self.cond.notify_all()
            self.ack_load_queue.put(op)

    def wait_until(self, threshold: int) -> None:
        with self.cond:
            while self.counter <= threshold:
                self.cond.wait()


@pytest.fixture
def held():
    from kvcheck.engines.sglang.hicache_cpu import CPU_DEVICE
    from kvcheck.engines.sglang.hicache_thread import THREADS, _Threading
    THREADS.reset()
    cc = types.SimpleNamespace(threading=threading)
    THREADS.install(cc)
    assert isinstance(cc.threading, _Threading)
    before = CPU_DEVICE.thread_sync
    yield THREADS, CPU_DEVICE, cc.threading
    THREADS.reset()
    CPU_DEVICE.thread_sync = before


def test_a_write_is_copied_when_the_device_runs_and_acknowledged_after(held):
    threads, device, th = held
    ctl = _Controller(th, device)
    assert threads.unknown() == [] and {w.role for w in threads.workers} == {"write_thread", "load_thread"}
    threads.run()                                   # both start and wait for a job
    ctl.write_queue.put(1)
    threads.run()                                   # woken: the copy is queued, the thread waits on it
    assert ctl.ack_write_queue.empty() and ctl.dst[0][1] == 0.0 and ctl.write_stream.queue
    device.progress()
    threads.settle()                                # the device ran it: the thread acknowledges
    assert ctl.ack_write_queue.get_nowait() == 1 and [d[1] for d in ctl.dst] == [1.0, 1.0]
    assert threading.current_thread() is threading.main_thread() and device.current is device.default


def test_the_consumer_waits_layer_by_layer_and_a_skipped_wait_reads_nothing_loaded(held):
    threads, device, th = held
    ctl = _Controller(th, device)
    threads.run()
    ctl.load_queue.put(2)
    ctl.load_cache_event.set()
    threads.run()                                   # the load thread starts: counter reset, layer 0 queued
    assert ctl.counter == 0 and [d[2] for d in ctl.dst] == [0.0, 0.0]     # (not waited for: not there)
    ctl.wait_until(0)
    assert ctl.counter == 1 and [d[2] for d in ctl.dst] == [1.0, 0.0]
    ctl.wait_until(1)
    assert ctl.counter == 2 and [d[2] for d in ctl.dst] == [1.0, 1.0]
    assert ctl.ack_load_queue.get_nowait() == 2


def test_a_wait_nothing_can_end_raises_and_dropped_threads_unwind(held):
    threads, device, th = held
    ctl = _Controller(th, device)
    threads.run()
    with pytest.raises(RuntimeError, match="would hang"):
        ctl.wait_until(5)                           # no load queued: no thread will ever count
    ctl.write_queue.put(3)
    threads.run()                                   # parked on its stream when the cache is dropped
    real = [w.thread for w in threads.workers]
    threads.reset()
    for t in real:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in real) and threads.workers == []


def test_sglang_own_controller_threads_are_held_and_stepped():
    from kvcheck.engines.sglang.install import SglangUnavailable, load
    try:
        load()
    except SglangUnavailable as e:
        pytest.skip(str(e))
    from sglang.srt.managers import cache_controller as cc
    if not hasattr(cc.HiCacheController, "write_thread_func_direct"):
        pytest.skip("this release's HiCacheController has no transfer threads of its own")
    import torch

    from kvcheck.engines.sglang.hicache import HiCacheAdapter
    from kvcheck.engines.sglang.hicache_cpu import CPU_DEVICE
    from kvcheck.engines.sglang.hicache_thread import THREADS
    a = HiCacheAdapter("hicache")
    a.reset()                                       # (the first cache's threads unwind)
    assert sorted(w.role for w in THREADS.workers) == ["load_thread", "write_thread"]
    assert sum(t.name.startswith("kvcheck-held-") for t in threading.enumerate()) <= 4
    ctl = a.cache.cache_controller
    dev = a.alloc.alloc(3)
    for layer, buf in enumerate(a.kv.k_buffer + a.kv.v_buffer):
        buf[dev] = 7.0 + layer
    host = ctl.write(device_indices=dev, node_id=11)
    THREADS.run()
    assert ctl.ack_write_queue.empty()              # queued on the write stream, not copied yet
    CPU_DEVICE.progress()
    THREADS.settle()
    assert ctl.ack_write_queue.get_nowait() == 11
    assert ctl.mem_pool_host.kv_buffer[:, :, host].flatten().tolist() == [7.0] * 3 + [8.0] * 3 + [9.0] * 3 + \
        [10.0] * 3                                  # k: layers 0, 1; v: layers 0, 1 (layer-first)
    back = ctl.load(host_indices=host, node_id=12)
    ctl.layer_done_counter.set_consumer(a.cache.ready_to_load_host_cache())
    THREADS.run()
    assert not torch.equal(a.kv.k_buffer[0][back].flatten(), torch.full((3,), 7.0))     # not waited for yet
    ctl.layer_done_counter.wait_until(0)
    assert a.kv.k_buffer[0][back].flatten().tolist() == [7.0] * 3
    ctl.layer_done_counter.wait_until(1)
    assert a.kv.v_buffer[1][back].flatten().tolist() == [10.0] * 3
    assert ctl.ack_load_queue.get_nowait() == 12
