# Standalone reproducer (docs/findings-vllm.md, "Async scheduling with a KV connector: a freed block's
# in-flight write lands on a connector load"), on vLLM's own AsyncScheduler (async scheduling is vLLM's
# default), stepped as the engine core's two-deep batch queue, built on CPU. The race PR #45357 fixed.
#
# Under the batch queue frame N+1 is scheduled before frame N's output arrives. A request that N's output
# finishes still runs in N+1 (its output is discarded), so N+1's forward writes its blocks; a release that
# returns them to the pool at once lets the next frame hand one to another request, whose KV connector
# load (an RDMA write, not ordered with the GPU stream) fills it while N+1 may still be writing: the old
# request's write can land on the loaded KV. From 0.24.0 such frees wait behind the in-flight frame
# (defer_block_free, with a consumer connector).
#
# Steps: A (10 tokens, stop token 7) is scheduled (frame 1, its prefill) and again (frame 2, its decode)
# before frame 1's output; frame 1's output (token 7) finishes A; B (9 tokens, 8 in the connector's store) is
# scheduled (frame 3) with frame 2 in flight. Needs only vLLM (and transformers, for a tiny model's
# config.json). Exit 1: the block frame 2 writes is among those B's load fills (the bug); exit 0: not.
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
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

try:
    from vllm.utils.hashing import sha256
except ImportError:                                  # (older releases)
    from vllm.utils import sha256

BLOCK, NUM_BLOCKS, MAX_LEN = 4, 4, 256                # (3 usable: B gets what A frees)
A = [2, 36, 31, 21, 31, 34, 26, 17, 5, 9]           # 10 tokens: its decode writes slot 2 of its third block
B = [40, 41, 42, 43, 44, 45, 46, 47, 48]             # 9 tokens: 8 of them loaded by the connector
LOADS = {}                                           # request -> (block ids its load fills, tokens loaded)


class ReproConnector(KVConnectorBase_V1):
    """An external prefix store (kv_both) that holds B's first 8 tokens: B's load is synchronous (the
    worker's start_load_kv, at the start of B's first frame, RDMA: not ordered with the GPU stream)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id == "B" and num_computed_tokens == 0:
            return 8, False
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
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
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
        print(f"vLLM {vllm.__version__}: {type(sched).__name__}, a KV connector that loads B's first 8 tokens, "
              f"defer_block_free={getattr(sched, 'defer_block_free', None)}")
        kw = {k: v for k, v in dict(block_hasher=hasher, eos_token_id=None, arrival_time=0.0).items()
              if k in sig(Request)}
        sched.add_request(Request("A", list(A), SamplingParams(max_tokens=8, stop_token_ids=[7]), None, **kw))
        f1 = schedule(sched)                           # A's prefill
        f2 = schedule(sched)                           # A's decode, before frame 1's output: in flight
        a_blocks = list(sched.kv_cache_manager.get_block_ids("A")[0])
        p = END[id(f2)]["A"] - 1                       # the position frame 2 writes (the token frame 1 samples)
        writes = a_blocks[p // BLOCK]
        print(f"frame 1: {dict(f1.num_scheduled_tokens)}; frame 2: {dict(f2.num_scheduled_tokens)} in flight, "
              f"writing A's position {p} into block #{writes} (A's blocks {a_blocks})")
        sched.update_from_output(f1, output(sched, f1))  # A samples 7, its stop token: A finishes
        print(f"frame 1's output: A finished; free blocks now {sched.kv_cache_manager.block_pool.get_num_free_blocks()}")
        sched.add_request(Request("B", list(B), SamplingParams(max_tokens=1), None, **kw))
        f3 = schedule(sched)                           # B's first frame, with frame 2 still in flight
        loaded, n = LOADS.get("B", ([], 0))
        print(f"frame 3: {dict(f3.num_scheduled_tokens)}; B's connector load of {n} tokens fills blocks {loaded} "
              "as frame 3 starts, while frame 2 still runs")
        if writes in loaded:
            print(f"BUG: block #{writes} was freed at frame 1's output with frame 2 still writing it, and handed to B, "
                  f"whose load fills it: frame 2's write of A's position {p} (slot {p % BLOCK}) can land after the "
                  f"load, and B attends to A's KV as its token {loaded.index(writes) * BLOCK + p % BLOCK}'s")
            return 1
        print(f"OK: frame 2's block #{writes} is not among B's loaded blocks (the free waited for frame 2)")
        return 0
    finally:
        shutil.rmtree(d, True)


if __name__ == "__main__":
    sys.exit(main())
