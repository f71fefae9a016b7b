"""What an SGLang check reports: one violation, raised by the checks and the incremental scan."""
from __future__ import annotations


class Violation(Exception):
    """A broken check: kind (safety | bookkeeping | lost_reuse), check name, one-line message."""

    def __init__(self, kind: str, check: str, message: str) -> None:
        super().__init__(f"[{check}] {message}")
        self.kind, self.check, self.message = kind, check, message
