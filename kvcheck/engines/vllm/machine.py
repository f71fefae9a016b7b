"""A Hypothesis stateful machine over vLLM's KV cache manager: a driver of the lockstep core,
like ``vllm.run_campaign``, with Hypothesis choosing and shrinking the operations.

Use: ``VllmMachine.for_layout("full+swa", fault=None).TestCase`` in a test, or
``run_state_machine_as_test(VllmMachine.for_layout(...))``. Every step goes through the core,
which runs the adapter's checks after it (a broken one raises ``lockstep.Finding``).
"""
from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvcheck.fuzz.lockstep import Act, FreeModel, Lockstep
from . import drivers as V

_BASES = [[(i * 7 + k * 13) % V.VOCAB for i in range(44)] for k in range(3)]


class VllmMachine(RuleBasedStateMachine):
    layout = "full+swa"
    fault: str | None = None

    @classmethod
    def for_layout(cls, layout: str, fault: str | None = None, num_blocks: int = 14) -> type:
        return type(f"VllmMachine_{layout.replace('+', '_')}", (cls,),
                    {"layout": layout, "fault": fault, "num_blocks": num_blocks})

    num_blocks = 14

    @initialize()
    def start(self) -> None:
        self.ad = V.VllmAdapter(self.layout, self.num_blocks, self.fault)
        self.core = Lockstep(FreeModel(), self.ad)

    def _do(self, action: str, params: dict) -> None:
        self.core.step(Act(action, params))

    def _pick(self, action: str, data) -> str | None:
        rs = self.ad.enabled()[action]
        return data.draw(st.sampled_from(rs)) if rs else None

    @precondition(lambda self: len(self.ad.reqs) < 5)
    @rule(base=st.integers(0, 2), cut=st.integers(0, 44), n=st.integers(2, 44),
          tail=st.lists(st.integers(0, V.VOCAB - 1), max_size=44), salt=st.sampled_from([None, "s1"]))
    def submit(self, base, cut, n, tail, salt) -> None:
        cut = min(cut, n)
        toks = _BASES[base][:cut] + (tail + [1] * n)[: n - cut]
        self._do("submit", {"r": f"r{self.ad.next_id}", "tokens": toks, "salt": salt})

    @rule(data=st.data(), chunk=st.integers(1, 48))
    def lookup(self, data, chunk) -> None:
        r = self._pick("lookup", data)
        if r is not None:
            self._do("lookup", {"r": r, "chunk": chunk})

    @rule(data=st.data(), chunk=st.integers(1, 48))
    def prefill(self, data, chunk) -> None:
        r = self._pick("prefill", data)
        if r is not None:
            self._do("prefill", {"r": r, "chunk": chunk})

    @rule(data=st.data(), tok=st.integers(0, V.VOCAB - 1))
    def decode(self, data, tok) -> None:
        r = self._pick("decode", data)
        if r is not None:
            self._do("decode", {"r": r, "tok": tok})

    @rule(data=st.data())
    def finish(self, data) -> None:
        r = self._pick("finish", data)
        if r is not None:
            self._do("finish", {"r": r})

    @rule(data=st.data())
    def preempt(self, data) -> None:
        r = self._pick("preempt", data)
        if r is not None:
            self._do("preempt", {"r": r})

    @rule()
    def reset_prefix_cache(self) -> None:
        self._do("reset_prefix_cache", {})

    @rule(ids=st.lists(st.integers(1, 63), min_size=1, max_size=3))
    def evict_blocks(self, ids) -> None:
        self._do("evict_blocks", {"block_ids": ids})

    @rule()
    def begin_step(self) -> None:      # a scheduler step: the allocations until `forward`
        if not self.ad.timeline.open:
            self._do("begin_step", {})

    @rule()
    def forward(self) -> None:         # the step's forward completes (timeline.py)
        if self.ad.timeline.open:
            self._do("forward", {})
