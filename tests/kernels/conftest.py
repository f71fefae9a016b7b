"""Triton kernels are tested in interpreter mode (no GPU in CI): TRITON_INTERPRET must be set before
triton.jit decorates the kernels, i.e. before kvcheck.kernels.triton_ops is imported. Set it here,
at collection of tests/kernels, unless the caller chose a mode explicitly (TRITON_INTERPRET=0 on a
GPU machine runs the compiled kernels). The torch-op tests do not import triton and are unaffected."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
