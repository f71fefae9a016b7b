"""Exit codes: the one table every command, engine and adapter returns.

An `IntEnum`, so a code is still a plain int in JSON results and `sys.exit`, and every part of
kvcheck (spec, reference, fuzz, checker) can name codes without importing the command line.
"""
from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0                  # holds
    USAGE = 2               # usage or bad input (one line on stderr)
    UNDECIDED = 3           # coverage below the profile minimum, solver unknown
    INVARIANT = 10          # invariant violated
    DIFF = 11               # differential mismatch (reuse != recompute)
    Z3 = 12                 # Z3 counterexample
    CONFORMANCE = 13        # spec / system-under-test conformance mismatch
    INTERRUPTED = 130       # Ctrl-C: what was done so far is written, nothing is claimed


# The exit code of a finding, by the kind of check that failed.
FOR_FINDING: dict[str, ExitCode] = {"invariant": ExitCode.INVARIANT, "differential": ExitCode.DIFF,
                                    "conformance": ExitCode.CONFORMANCE,
                                    # adapters' own kinds (vLLM, SGLang): what each one breaks
                                    "safety": ExitCode.INVARIANT, "bookkeeping": ExitCode.INVARIANT,
                                    "divergence": ExitCode.CONFORMANCE, "lost_reuse": ExitCode.CONFORMANCE,
                                    # an acknowledged known defect the release cannot have (fuzz/known.py)
                                    "stale_acknowledgement": ExitCode.CONFORMANCE}

SUMMARY = """exit codes:
  0   holds            10  invariant violated      11  differential mismatch
  2   usage/bad input  12  Z3 counterexample       13  spec/SUT conformance mismatch
  3   could not decide (coverage below the profile minimum, solver unknown)
  130 interrupted (Ctrl-C): the partial result is written, no pass is claimed"""
