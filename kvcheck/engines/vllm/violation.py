"""What a vLLM check reports: one violation (kind, check, message), raised by the checks, the
bookkeeping scan and the Mamba shadow alike."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Violation(Exception):
    kind: str       # safety | bookkeeping | divergence | lost_reuse
    check: str
    message: str
    size: dict | None = None    # lost reuse: tokens_lost, prompt_tokens, share (of the prompt)

    def __str__(self) -> str:
        return f"{self.kind}/{self.check}: {self.message}"
