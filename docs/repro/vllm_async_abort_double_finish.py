# Standalone reproducer of a kvcheck finding (docs/findings-vllm.md, "Async scheduling with a KV
# connector: an aborted request is finished twice"), on vLLM's own AsyncScheduler (async scheduling is
# vLLM's default), stepped as the engine core's two-deep batch queue, built on CPU.
#
# A request aborted while its frame is in flight keeps its blocks for the connector's send
# (request_finished answers delay_free_blocks=True), so it stays in the scheduler's requests; when the
# frame's output arrives, a release that does not skip finished requests appends the token, check_stop
# finishes the request again (its last token: max_tokens) and request_finished is called a second
# time. A connector with nothing more to store answers False: vLLM frees the blocks its send still
# reads, and the send's finished_sending then trips `assert req_id in self.requests`
# (_update_from_kv_xfer_finished; the EngineCore crash of vllm#43226). 0.16.0 skips a finished
# request's output (`if request is None or request.is_finished()`).
#
# Steps: A (8 tokens, max_tokens 2) is scheduled (frame 1, its prefill) and again (frame 2, its decode)
# before frame 1's output arrives; A is aborted with frame 2 in flight; frame 2's output arrives; the
# connector's send finishes in the next output. Needs only vLLM (and transformers, for a tiny model's
# config.json). Exit 1: request_finished was called twice for A (the bug); exit 0: once.
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
CALLS = []                                           # (request id, the answer) of each request_finished
SENDING = set()                                      # requests whose store the connector is running


class ReproConnector(KVConnectorBase_V1):
    """An external store: it saves a finished request's blocks asynchronously (holds them until its
    finished_sending); a request it already stores has nothing more to store."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        delay = request.request_id not in SENDING and bool(block_ids)
        SENDING.add(request.request_id)
        CALLS.append((request.request_id, delay, request.status.name))
        return delay, None

    def start_load_kv(self, forward_context, **kwargs): ...
    def wait_for_layer_load(self, layer_name): ...
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...
    def wait_for_save(self): ...


def sig(fn):
    return set(inspect.signature(fn).parameters)


def build():
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
    sc.async_scheduling = True                # (vLLM's default; kept from the CPU platform's override below)
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
    return AsyncScheduler(**kw), hasher, d



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
    sched, hasher, d = build()
    try:
        print(f"vLLM {vllm.__version__}: {type(sched).__name__}, a KV connector that stores finished requests")
        kw = {k: v for k, v in dict(block_hasher=hasher, eos_token_id=None, arrival_time=0.0).items()
              if k in sig(Request)}
        sched.add_request(Request("A", list(A), SamplingParams(max_tokens=2), None, **kw))
        f1 = schedule(sched)
        f2 = schedule(sched)                           # frame 2 (A's decode) before frame 1's output
        print(f"frame 1: {dict(f1.num_scheduled_tokens)}; frame 2: {dict(f2.num_scheduled_tokens)} (in flight)")
        sched.update_from_output(f1, output(sched, f1))
        sched.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
        print(f"A aborted with frame 2 in flight: request_finished -> {CALLS}")
        f3 = schedule(sched)
        sched.update_from_output(f2, output(sched, f2))
        print(f"frame 2's output arrives: request_finished calls {CALLS}; A in requests: {'A' in sched.requests}")
        try:                                           # the connector's send finishes
            f4 = schedule(sched)
            END[id(f3)] = {}
            sched.update_from_output(f3, output(sched, f3, sending={"A"}))
            print(f"the send's finished_sending taken; A in requests: {'A' in sched.requests}")
        except AssertionError as e:
            print(f"the send's finished_sending: vLLM raised AssertionError {e} (the request's blocks were "
                  "freed at the second request_finished, under the connector's send)")
        twice = sum(1 for c in CALLS if c[0] == "A") > 1
        if twice:
            print("BUG: request_finished was called twice for A: vLLM processed the in-flight output of a "
                  "request it had finished (aborted), and finished it again")
            return 1
        print("OK: A was finished once")
        return 0
    finally:
        shutil.rmtree(d, True)


if __name__ == "__main__":
    sys.exit(main())
