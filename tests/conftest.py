"""Triton kernels are tested in interpreter mode (no GPU in CI): TRITON_INTERPRET must be set before
triton is first imported — and other test modules import it early (vLLM imports triton), so it is
set here, at the root of the test tree, before anything is collected, unless the caller chose a
mode explicitly (TRITON_INTERPRET=0 on a GPU machine runs the compiled kernels)."""
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def one_thread():
    """Run single-threaded: on a busy 2-core box, 2 OpenMP threads stall every small op (50x).
    Bits do not depend on the thread count (test_thread_count_does_not_change_bits and
    test_linear_two_threads cover 2 threads). torch is imported here only when asked for."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _sigint_restored(request):
    """A test that leaves SIGINT ignored in this process (a library driven in-process can set
    SIG_IGN and not restore it) makes every child process started later ignore Ctrl-C, since an
    ignored signal is inherited across exec: the interrupt tests then fail for a reason that is
    not theirs. Restored after each test, and the test that left it is named (a warning)."""
    import signal
    import warnings
    yield
    h = signal.getsignal(signal.SIGINT)
    if h is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        warnings.warn(f"SIGINT left as {h!r} by {request.node.nodeid}; restored to Python's default")
    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []):     # (a blocked mask is inherited too)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        warnings.warn(f"SIGINT left blocked by {request.node.nodeid}; unblocked")
