"""`kvcheck replay TRACE`: the CLI's names for the one replay (kvcheck.fuzz.traces.replay),
which runs a trace on the lockstep core: the spec, and a system under test when one is named.
"""
from __future__ import annotations

from ..fuzz.suts import resolve_sut
from ..fuzz.traces import replay as replay_trace  # noqa: F401  (the CLI's and old reproducers' name)
from ..spec.sut import SystemUnderTest


def sut_by_name(name: str, fault: str | None) -> SystemUnderTest:
    return resolve_sut(name, fault)()
