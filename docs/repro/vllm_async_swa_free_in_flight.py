# Standalone reproducer (docs/findings-vllm.md, "Async scheduling with a KV connector on sliding-window
# layouts: a block leaves the window under an in-flight forward"), on vLLM's own AsyncScheduler (async
# scheduling is vLLM's default), stepped as the engine core's two-deep batch queue, built on CPU. The race
# PR #47728 fixed in 0.26.0.
#
# allocate_slots drops a request's blocks that left its sliding window, counted on num_computed_tokens,
# which under async scheduling already includes the frame in flight. That frame still writes (and
# attends to) those blocks; returned to the pool, one can go to a request whose KV connector load (an
# RDMA write, not ordered with the GPU stream) fills it. 0.26.0 drops them on the processed tokens
# (num_computed_tokens - num_in_flight_tokens).
#
# Steps: one sliding-window group (window 8, block 4); A's 20-token prompt is scheduled whole (frame 1,
# writing blocks 0-4); B (5 tokens, 4 in the connector's store) arrives; frame 2 (A's decode and B) is
# scheduled before frame 1's output. Needs only vLLM (and transformers, for a tiny model's config.json).
# Exit 1: a block frame 1 writes is among those B's load fills (the bug); exit 0: not.
import inspect
import os
import shutil
import sys
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import vllm  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core import kv_cache_utils as ku  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

try:
    from vllm.utils.hashing import sha256
except ImportError:                                  # (older releases)
    from vllm.utils import sha256

BLOCK, NUM_BLOCKS, MAX_LEN, WINDOW = 4, 7, 256, 8   # (6 usable: A's prompt and decode take them all)
A = [2, 36, 31, 21, 31, 34, 26, 17, 5, 9, 11, 12, 13, 14, 15, 16, 18, 19, 20, 22]   # 20 tokens: blocks 0-4
B = [40, 41, 42, 43, 44]                             # 5 tokens: 4 of them loaded by the connector
LOADS = {}                                           # request -> (block ids its load fills, tokens loaded)


class ReproConnector(KVConnectorBase_V1):
    """An external prefix store (kv_both) that holds B's first 4 tokens: B's load is synchronous (the
    worker's start_load_kv, at the start of B's first frame, RDMA: not ordered with the GPU stream)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id == "B" and num_computed_tokens == 0:
            return 4, False
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            LOADS[request.request_id] = ([b for g in blocks.get_block_ids() for b in g][:num_external_tokens // BLOCK],
                                         num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs): ...
    def wait_for_layer_load(self, layer_name): ...
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...
    def wait_for_save(self): ...


def sig(fn):
    return set(inspect.signature(fn).parameters)


def build(async_sched: bool):
    d = tempfile.mkdtemp(prefix="repro-model-")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=64, max_position_embeddings=1 << 16, architectures=["LlamaForCausalLM"]).save_pretrained(d)
    mc = ModelConfig(model=d, skip_tokenizer_init=True, max_model_len=MAX_LEN, dtype="float32")
    sc = SchedulerConfig(**{k: v for k, v in dict(max_num_batched_tokens=4096, max_num_seqs=4, max_model_len=MAX_LEN,
                                                  enable_chunked_prefill=True, is_encoder_decoder=False).items()
                            if k in sig(SchedulerConfig)})
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cc.num_gpu_blocks = NUM_BLOCKS
    KVConnectorFactory.register_connector("ReproConnector", "__main__", "ReproConnector")
    kt = KVTransferConfig(kv_connector="ReproConnector", kv_role="kv_both")
    sc.async_scheduling = async_sched         # (vLLM's default: True; kept from the CPU platform's override below)
    import vllm.triton_utils as tu            # (0.34's CPU platform asks for Triton's CPU backend; no kernel runs here)
    from vllm import platforms
    cp = platforms.current_platform
    orig = cp.check_and_update_config

    def keep(vc):                             # (the CPU platform turns async scheduling off; a GPU engine keeps it)
        before = vc.scheduler_config.async_scheduling
        orig(vc)
        vc.scheduler_config.async_scheduling = before
    had, tu.HAS_TRITON, cp.check_and_update_config = getattr(tu, "HAS_TRITON", True), True, keep
    try:
        vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, device_config=DeviceConfig(device="cpu"),
                        kv_transfer_config=kt)
    finally:
        tu.HAS_TRITON = had
        del cp.check_and_update_config
    spec = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=WINDOW)
    kcfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)])
    kw = dict(vllm_config=vc, kv_cache_config=kcfg, block_size=BLOCK, log_stats=True,
              structured_output_manager=StructuredOutputManager(vc))
    if "hash_block_size" in sig(Scheduler):
        kw["hash_block_size"] = BLOCK
    ku.init_none_hash(sha256)
    hasher = (ku.get_request_block_hasher(BLOCK, sha256, 0) if len(sig(ku.get_request_block_hasher)) > 2
              else ku.get_request_block_hasher(BLOCK, sha256))
    return (AsyncScheduler if async_sched else Scheduler)(**kw), hasher, d



def output(sched, so, sending=()):
    """The frame's model-runner output: one token per request whose prompt is done after it."""
    ids = list(so.num_scheduled_tokens)
    toks = [[7] if END[id(so)][r] >= LEN[r] else [] for r in ids]
    kw = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if "req_id_to_index" in sig(ModelRunnerOutput) else {}
    for k, p in inspect.signature(ModelRunnerOutput).parameters.items():
        if p.default is inspect.Parameter.empty and k not in ("req_ids", "req_id_to_index", "sampled_token_ids"):
            kw[k] = [] if "list" in str(p.annotation) else {} if "dict" in str(p.annotation) else None
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks, **kw,
                             kv_connector_output=KVConnectorOutput(finished_sending=set(sending) or None))


END = {}
LEN = {"A": len(A), "B": len(B)}


def schedule(sched):
    so = sched.schedule()
    END[id(so)] = {r: sched.requests[r].num_computed_tokens for r in so.num_scheduled_tokens}
    return so


def main() -> int:
    sched, hasher, d = build(True)
    try:
        print(f"vLLM {vllm.__version__}: {type(sched).__name__}, one sliding-window group (window {WINDOW}, block "
              f"{BLOCK}), a KV connector that loads B's first 4 tokens")
        kw = {k: v for k, v in dict(block_hasher=hasher, eos_token_id=None, arrival_time=0.0).items()
              if k in sig(Request)}
        sched.add_request(Request("A", list(A), SamplingParams(max_tokens=8), None, **kw))
        f1 = schedule(sched)                           # A's whole prompt: writes blocks 0-4
        a_blocks = list(sched.kv_cache_manager.get_block_ids("A")[0])
        print(f"frame 1: {dict(f1.num_scheduled_tokens)} in flight, writing A's blocks {a_blocks}")
        sched.add_request(Request("B", list(B), SamplingParams(max_tokens=1), None, **kw))
        f2 = schedule(sched)                           # A's decode and B, before frame 1's output
        now = list(sched.kv_cache_manager.get_block_ids("A")[0])
        loaded, n = LOADS.get("B", ([], 0))
        print(f"frame 2: {dict(f2.num_scheduled_tokens)}; A's table now {now}; B's load of {n} tokens fills "
              f"blocks {loaded} while frame 1 still runs")
        hit = [b for b in loaded if b in a_blocks]
        if hit:
            print(f"BUG: block #{hit[0]} left A's window at frame 2's schedule (which counts frame 1's tokens as "
                  f"computed) and was freed with frame 1 still writing it; B's load fills it, and frame 1's write "
                  "of A's KV can land after the load")
            return 1
        print("OK: no block frame 1 writes is among B's loaded blocks (freed on the processed tokens, or not yet)")
        return 0
    finally:
        shutil.rmtree(d, True)


if __name__ == "__main__":
    sys.exit(main())
