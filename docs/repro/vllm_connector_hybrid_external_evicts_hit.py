# Standalone reproducer of a kvcheck finding (docs/findings-vllm.md, "KV connector on a hybrid
# layout: one group's external blocks evict another group's cache hit"), on vLLM's own v1
# Scheduler, built on CPU. Upstream: vllm-project/vllm PR #33775 (the report and first fix),
# fixed by PR #44409 (two-phase allocation).
#
# When a request has both a local prefix-cache hit and external (KV connector) tokens, vLLM before
# the fix touched each group's hit blocks and allocated that group's external blocks group by
# group; group 0's allocation pops the free queue, whose head can be a cache-hit block group 1 is
# about to reuse (still free, not touched yet). The same block then sits in both groups' tables:
# group 0's connector load writes into the bytes group 1 attends to as its cached prefix.
#
# Steps: a full-attention group and a sliding-window group (window 16), block 4, 12 blocks; P
# (8 tokens) and D (16 other tokens) run one step and finish, freeing P's blocks first; B (P + 5
# tokens) hits P's 8 tokens locally and gets 4 more from the connector (loaded synchronously).
# Exit 1: a block is in B's tables of both groups (the bug: 0.18.1-0.23.0 checked); exit 0: none
# is (0.28.0, 0.32.0, 0.34.0 checked). 0.14-0.17 ship no connector serving hybrid layouts
# (SupportsHMA without a user; their remote-KV path unpacks one group): not run there.
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
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,  # noqa: E402
                                                               SupportsHMA)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core import kv_cache_utils as ku  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,  # noqa: E402
                                        SlidingWindowSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

try:
    from vllm.utils.hashing import sha256
except ImportError:                                  # (older releases)
    from vllm.utils import sha256

BLOCK, WINDOW, NUM_BLOCKS, MAX_LEN = 4, 16, 13, 256
P = [2, 36, 31, 21, 31, 34, 26, 17]
D = [40 + i for i in range(16)]
B = P + [9, 17, 23, 29, 5]


class ReproConnector(KVConnectorBase_V1, SupportsHMA):
    """An external store holding B's tokens 8..11 (one block per group), loaded synchronously."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id == "B" and num_computed_tokens == 8:
            return 4, False
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return False, None

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
    import vllm.triton_utils as tu            # (0.34's CPU platform asks for Triton's CPU backend; no kernel runs here)
    had, tu.HAS_TRITON = getattr(tu, "HAS_TRITON", True), True
    try:
        vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, device_config=DeviceConfig(device="cpu"),
                        kv_transfer_config=kt)
    finally:
        tu.HAS_TRITON = had
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=WINDOW)
    kcfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["layer0"], full), KVCacheGroupSpec(["layer1"], swa)])
    kw = dict(vllm_config=vc, kv_cache_config=kcfg, block_size=BLOCK, log_stats=True,
              structured_output_manager=StructuredOutputManager(vc))
    if "hash_block_size" in sig(Scheduler):
        kw["hash_block_size"] = BLOCK
    ku.init_none_hash(sha256)
    hasher = (ku.get_request_block_hasher(BLOCK, sha256, 0) if len(sig(ku.get_request_block_hasher)) > 2
              else ku.get_request_block_hasher(BLOCK, sha256))
    return Scheduler(**kw), hasher, d


def submit(sched, hasher, rid, tokens, max_tokens):
    kw = {k: v for k, v in dict(block_hasher=hasher, eos_token_id=None, arrival_time=0.0).items() if k in sig(Request)}
    sched.add_request(Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), None, **kw))


def step(sched):
    """schedule() -> a model-runner output (one token per request whose prompt is done) -> update_from_output()."""
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    toks = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else [] for r in ids]
    kw = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if "req_id_to_index" in sig(ModelRunnerOutput) else {}
    for k, p in inspect.signature(ModelRunnerOutput).parameters.items():
        if p.default is inspect.Parameter.empty and k not in ("req_ids", "req_id_to_index", "sampled_token_ids"):
            kw[k] = [] if "list" in str(p.annotation) else {} if "dict" in str(p.annotation) else None
    sched.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks, **kw,
                                                   kv_connector_output=KVConnectorOutput()))
    return so


def main() -> int:
    sched, hasher, d = build()
    try:
        mgr = sched.kv_cache_manager
        print(f"vLLM {vllm.__version__}: full + sliding window {WINDOW}, block {BLOCK}, {NUM_BLOCKS - 1} usable blocks")
        submit(sched, hasher, "P", P, 1)
        submit(sched, hasher, "D", D, 1)
        step(sched)
        print(f"P and D ran one step and finished: {'P' not in sched.requests and 'D' not in sched.requests}")
        submit(sched, hasher, "B", B, 2)
        so = step(sched)
        if "B" not in so.num_scheduled_tokens:
            print("B was not scheduled: the setup did not hold on this release")
            return 2
        tables = [list(ids) for ids in mgr.get_block_ids("B")]
        print(f"B: local hit 8 tokens, 4 from the connector; its tables: full {tables[0]}, sliding window {tables[1]}")
        shared = sorted(set(tables[0]) & set(tables[1]) - {0})
        if shared:
            print(f"BUG: block(s) {shared} in both groups' tables of B: the full group's external block is a "
                  "cache-hit block the sliding-window group reuses; the connector's load overwrites its KV")
            return 1
        print("OK: no block is in both groups' tables")
        return 0
    finally:
        shutil.rmtree(d, True)


if __name__ == "__main__":
    sys.exit(main())
