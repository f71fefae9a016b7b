"""Triton kernels are tested in interpreter mode (no GPU in CI): TRITON_INTERPRET must be set before
triton is first imported — and other test modules import it early (vLLM imports triton), so it is
set here, at the root of the test tree, before anything is collected, unless the caller chose a
mode explicitly (TRITON_INTERPRET=0 on a GPU machine runs the compiled kernels)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
