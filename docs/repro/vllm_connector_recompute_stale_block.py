# Standalone reproducer of a kvcheck finding (docs/findings-vllm.md, "KV connector: a block whose
# synchronous load failed stays cached under recompute"), on vLLM's own v1 Scheduler, built on CPU.
#
# With kv_load_failure_policy="recompute", a block a KV connector reports as failed in a
# synchronous load (invalid_block_ids) stays in the prefix cache: vLLM truncates the loading
# request to it and expects that request to recompute it. When the request is aborted first, the
# block keeps its hash with bytes nobody wrote for those tokens, and a later request hits it.
#
# Steps: P (12 tokens) runs and finishes; the prefix cache is reset (the prefix now lives only in
# the "external store"); B (P + 4 tokens) gets 8 tokens from the connector, loaded synchronously,
# and the load of its second block fails; B is aborted; C (B's first 13 tokens) is looked up.
# Needs only vLLM (0.14.1, 0.16.0, 0.19.1, 0.34.0 checked). Exit 1: C's hit includes the failed
# block (the bug); exit 0: it does not (evicted or recomputed first). `--policy fail` runs the same
# steps under kv_load_failure_policy="fail", which evicts the failed blocks: exit 0 (the contrast).
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
P = [2, 36, 31, 21, 31, 34, 26, 17, 26, 8, 15, 14]
B = P + [9, 17, 23, 29]
C = B[:13]
STATE = {"fail_block": None}
POLICY = sys.argv[sys.argv.index("--policy") + 1] if "--policy" in sys.argv else "recompute"


class ReproConnector(KVConnectorBase_V1):
    """An external store that holds B's first 8 tokens; its synchronous load of the second block fails."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id == "B" and num_computed_tokens < 8:
            return 8 - num_computed_tokens, False          # 8 tokens, loaded synchronously
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if request.request_id == "B" and num_external_tokens:
            STATE["fail_block"] = blocks.get_block_ids()[0][1]    # tokens 4..7: its load will fail

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
    kt = KVTransferConfig(kv_connector="ReproConnector", kv_role="kv_both",
                          **({"kv_load_failure_policy": POLICY} if "kv_load_failure_policy" in sig(KVTransferConfig) else {}))
    import vllm.triton_utils as tu            # (0.34's CPU platform asks for Triton's CPU backend; no kernel runs here)
    had, tu.HAS_TRITON = getattr(tu, "HAS_TRITON", True), True
    try:
        vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, device_config=DeviceConfig(device="cpu"),
                        kv_transfer_config=kt)
    finally:
        tu.HAS_TRITON = had
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kcfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)])
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


def step(sched, fail=False):
    """schedule() -> a model-runner output (one token per request whose prompt is done; with `fail`,
    the connector's failed block in invalid_block_ids, as the worker reports a failed sync load in
    the step whose forward ran it) -> update_from_output()."""
    so = sched.schedule()
    invalid = {STATE["fail_block"]} if fail else set()
    ids = list(so.num_scheduled_tokens)
    toks = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else [] for r in ids]
    kw = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if "req_id_to_index" in sig(ModelRunnerOutput) else {}
    for k, p in inspect.signature(ModelRunnerOutput).parameters.items():
        if p.default is inspect.Parameter.empty and k not in ("req_ids", "req_id_to_index", "sampled_token_ids"):
            kw[k] = [] if "list" in str(p.annotation) else {} if "dict" in str(p.annotation) else None
    out = ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks, **kw,
                            kv_connector_output=KVConnectorOutput(invalid_block_ids=set(invalid)))
    sched.update_from_output(so, out)
    return so


def main() -> int:
    sched, hasher, d = build()
    try:
        mgr = sched.kv_cache_manager
        print(f"vLLM {vllm.__version__}: block {BLOCK}, kv_load_failure_policy={POLICY}")
        submit(sched, hasher, "P", P, 1)
        while "P" in sched.requests:
            step(sched)
        print("P ran and finished; reset_prefix_cache:", sched.reset_prefix_cache())
        submit(sched, hasher, "B", B, 2)
        so = step(sched, fail=True)
        bad = STATE["fail_block"]
        print(f"B: 8 tokens from the connector, {so.num_scheduled_tokens.get('B')} scheduled; the load of "
              f"block #{bad} (tokens 4..7) failed (invalid_block_ids)")
        if "B" in sched.requests:
            print(f"B truncated to {sched.requests['B'].num_computed_tokens} computed tokens, blocks "
                  f"{list(mgr.get_block_ids('B')[0])}")
            sched.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)
        print(f"B aborted before its recompute; block #{bad} still cached: "
              f"{mgr.block_pool.blocks[bad].block_hash is not None}")
        submit(sched, hasher, "C", C, 1)
        got = mgr.get_computed_blocks(sched.requests["C"])       # (blocks, hit[, ...] by release)
        blocks, hit = got[0], got[1]
        ids = [b.block_id for b in blocks.blocks[0]]
        print(f"C ({len(C)} tokens, B's first {len(C)}): prefix-cache hit {hit} tokens, blocks {ids}")
        if bad in ids:
            print(f"BUG: C's hit includes block #{bad}, whose synchronous load failed and which nothing "
                  f"wrote since: C would attend to bytes that are not the KV of tokens 4..7")
            return 1
        print("OK: the failed block is not served")
        return 0
    finally:
        shutil.rmtree(d, True)


if __name__ == "__main__":
    sys.exit(main())
