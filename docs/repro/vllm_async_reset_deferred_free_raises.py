# Standalone reproducer (docs/findings-vllm.md, "Async scheduling with a consumer KV connector: a forced
# prefix-cache reset raises"), on vLLM's own AsyncScheduler (async scheduling is vLLM's default), stepped as
# the engine core's two-deep batch queue, built on CPU.
#
# reset_prefix_cache(reset_running_requests=True) promises a successful reset: it preempts every running
# request "so that we can make sure the reset is successful", and raises only for requests "waiting for
# remote KV transfer, which is not supported yet". With overlapping batches and a consumer connector
# (kv_consumer or kv_both: PR #45357's defer_block_free) a preempted request's blocks are not returned to
# the pool while the frame the scheduler already dispatched for it is in flight (its fence step); the
# block pool then refuses the reset, and the scheduler raises that RuntimeError although no transfer
# exists -- after it has preempted every running request. EngineCore.reset_prefix_cache calls it without
# draining its batch queue, and under the batch queue a running request nearly always has a frame in
# flight.
#
# Steps: A (8 tokens) is scheduled (frame 1) and again (frame 2) before frame 1's output arrives; frame 1's
# output is taken; the forced reset runs with frame 2 in flight. --sync: the same with the synchronous
# Scheduler (frame 1's output taken, nothing in flight). Needs only vLLM (and transformers, for a tiny
# model's config.json). Exit 1: the reset raised (the bug); exit 0: it succeeded.
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

BLOCK, NUM_BLOCKS, MAX_LEN = 4, 33, 256
A = [2, 36, 31, 21, 31, 34, 26, 17]


class ReproConnector(KVConnectorBase_V1):
    """A consumer connector (kv_both) with nothing to load and nothing to store: no transfer is ever
    in flight."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

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
    toks = [[7] if END[id(so)][r] >= len(A) else [] for r in ids]
    kw = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if "req_id_to_index" in sig(ModelRunnerOutput) else {}
    for k, p in inspect.signature(ModelRunnerOutput).parameters.items():
        if p.default is inspect.Parameter.empty and k not in ("req_ids", "req_id_to_index", "sampled_token_ids"):
            kw[k] = [] if "list" in str(p.annotation) else {} if "dict" in str(p.annotation) else None
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks, **kw,
                             kv_connector_output=KVConnectorOutput(finished_sending=set(sending) or None))


END = {}


def schedule(sched):
    so = sched.schedule()
    END[id(so)] = {r: sched.requests[r].num_computed_tokens for r in so.num_scheduled_tokens}
    return so


def main() -> int:
    sync = "--sync" in sys.argv[1:]
    sched, hasher, d = build(not sync)
    try:
        print(f"vLLM {vllm.__version__}: {type(sched).__name__}, a consumer KV connector (no transfer ever), "
              f"defer_block_free={getattr(sched, 'defer_block_free', None)}")
        kw = {k: v for k, v in dict(block_hasher=hasher, eos_token_id=None, arrival_time=0.0).items()
              if k in sig(Request)}
        sched.add_request(Request("A", list(A), SamplingParams(max_tokens=8), None, **kw))
        f1 = schedule(sched)
        if sync:                                       # one frame at a time: its output, then the reset
            sched.update_from_output(f1, output(sched, f1))
            print(f"frame 1: {dict(f1.num_scheduled_tokens)}; its output taken, nothing in flight")
        else:                                          # the batch queue: frame 2 scheduled before frame 1's output
            f2 = schedule(sched)
            sched.update_from_output(f1, output(sched, f1))
            print(f"frame 1: {dict(f1.num_scheduled_tokens)}; frame 2: {dict(f2.num_scheduled_tokens)} scheduled "
                  "before frame 1's output, still in flight")
        try:
            ok = sched.reset_prefix_cache(reset_running_requests=True)
        except RuntimeError as e:
            print(f"reset_prefix_cache(reset_running_requests=True) raised RuntimeError: {e}")
            waiting = [r.request_id for r in sched.waiting] if hasattr(sched.waiting, "__iter__") else "?"
            print(f"BUG: the reset failed although no KV transfer is in flight: A's blocks wait for the scheduler's "
                  f"own in-flight frame (deferred frees: {len(getattr(sched, 'deferred_frees', ()))}); the running "
                  f"requests were preempted all the same (waiting: {waiting})")
            return 1
        print(f"reset_prefix_cache(reset_running_requests=True) -> {ok}")
        print("OK: the forced reset succeeded")
        return 0
    finally:
        shutil.rmtree(d, True)


if __name__ == "__main__":
    sys.exit(main())
