"""The vllm engine package.

vLLM's own logging config writes INFO lines to stdout as soon as any vLLM module is imported,
which would corrupt ``--json``; whichever kvcheck path imports vLLM first (the release probe,
the pre-flight, the drive), logging is left to Python's (warnings and errors on stderr) unless
the user configured vLLM's."""
import os

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
