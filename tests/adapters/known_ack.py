"""Every known vLLM defect, acknowledged: what a "clean run" means in the adapter tests — no
finding beyond the release's known defects (kvcheck/fuzz/known.py). That an unacknowledged one
fails a run is tested in tests/fuzz/test_known.py, with a real 0.33.0 campaign in the docs."""
from kvcheck.engines.vllm.known import defects
from kvcheck.fuzz.known import Acknowledgement

ACK_ALL = {name: Acknowledgement(name, "adapter test: only findings beyond the known defects count", d.upstream)
           for name, d in defects().items()}
