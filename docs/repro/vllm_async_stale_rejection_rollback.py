# Standalone reproducer (docs/findings-vllm.md, "A stale frame's rejected drafts rewind the resumed
# request"), on vLLM's own AsyncScheduler with an EAGLE drafter (async scheduling is vLLM's default, also
# with EAGLE/MTP drafters), stepped as the engine core's two-deep batch queue, built on CPU.
#
# A forced reset (reset_prefix_cache(reset_running_requests=True)) preempts A with a frame in flight
# that carries 2 draft positions; A is rescheduled (a recompute of all its tokens); then the stale
# frame's output returns with its drafts rejected. That output belongs to A's previous incarnation:
# vLLM must drop it without touching the resumed request. vLLM 0.14-0.24 first takes the rejected drafts
# back from num_computed_tokens (and num_output_placeholders), then discards the output: the resumed
# request's count falls behind what its in-flight forward computes and the placeholder count goes
# negative (vllm-project/vllm PR #46066, fixed in 0.25). Exit 1: the count moved (the bug); exit 0: it
# did not. Needs only vLLM (and transformers, for a tiny model's config.json).
import copy
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
from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig,  # noqa: E402
                         SchedulerConfig, SpeculativeConfig, VllmConfig)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core import kv_cache_utils as ku  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

try:
    from vllm.utils.hashing import sha256
except ImportError:                                  # (older releases)
    from vllm.utils import sha256

BLOCK, NUM_BLOCKS, MAX_LEN = 4, 65, 256
A = [2, 36, 31, 21, 31, 34, 26, 17]


def sig(fn):
    return set(inspect.signature(fn).parameters)


def build(drafts: int):
    d = tempfile.mkdtemp(prefix="repro-model-")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=64, max_position_embeddings=1 << 16, architectures=["LlamaForCausalLM"]).save_pretrained(d)
    mc = ModelConfig(model=d, skip_tokenizer_init=True, max_model_len=MAX_LEN, dtype="float32")
    sc = SchedulerConfig(**{k: v for k, v in dict(max_num_batched_tokens=4096, max_num_seqs=4, max_model_len=MAX_LEN,
                                                  enable_chunked_prefill=True, is_encoder_decoder=False).items()
                            if k in sig(SchedulerConfig)})
    sc.async_scheduling = True                # (vLLM's default with EAGLE; kept from the CPU platform's override below)
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cc.num_gpu_blocks = NUM_BLOCKS
    spec = {}
    if drafts:                                # (built for one draft token, then the count the scheduler reads is set)
        sp = copy.copy(SpeculativeConfig(method="eagle", model=d, num_speculative_tokens=1, target_model_config=mc,
                                         target_parallel_config=ParallelConfig()))
        sp.num_speculative_tokens = drafts
        spec["speculative_config"] = sp
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
                        **spec)
    finally:
        tu.HAS_TRITON = had
        del cp.check_and_update_config
    fa = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kcfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer0"], fa)])
    kw = dict(vllm_config=vc, kv_cache_config=kcfg, block_size=BLOCK, log_stats=True,
              structured_output_manager=StructuredOutputManager(vc))
    if "hash_block_size" in sig(AsyncScheduler):
        kw["hash_block_size"] = BLOCK
    ku.init_none_hash(sha256)
    hasher = (ku.get_request_block_hasher(BLOCK, sha256, 0) if len(sig(ku.get_request_block_hasher)) > 2
              else ku.get_request_block_hasher(BLOCK, sha256))
    return AsyncScheduler(**kw), hasher, d


def output(sched, so):
    """The frame's model-runner output: for a request whose prompt is done after it, the bonus token and
    every scheduled draft accepted (tokens 7); REJECT: every draft rejected."""
    ids = list(so.num_scheduled_tokens)
    spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
    toks = [[7] * (1 if REJECT else 1 + len(spec.get(r, ()))) if END[id(so)][r] >= len(A) else [] for r in ids]
    kw = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if "req_id_to_index" in sig(ModelRunnerOutput) else {}
    for k, p in inspect.signature(ModelRunnerOutput).parameters.items():
        if p.default is inspect.Parameter.empty and k not in ("req_ids", "req_id_to_index", "sampled_token_ids"):
            kw[k] = [] if "list" in str(p.annotation) else {} if "dict" in str(p.annotation) else None
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks, **kw)


END = {}
REJECT = False


def schedule(sched):
    so = sched.schedule()
    END[id(so)] = {r: sched.requests[r].num_computed_tokens for r in so.num_scheduled_tokens}
    return so


def main() -> int:
    global REJECT
    sched, hasher, d = build(2)
    try:
        print(f"vLLM {vllm.__version__}: {type(sched).__name__}, 2 EAGLE drafts per step")
        kw = {k: v for k, v in dict(block_hasher=hasher, eos_token_id=None, arrival_time=0.0).items()
              if k in sig(Request)}
        sched.add_request(Request("A", list(A), SamplingParams(max_tokens=64), None, **kw))
        a = sched.requests["A"]
        inflight = schedule(sched)                    # frame 1: A's prompt
        frame = 1
        while True:                                   # the batch queue: N+1 scheduled before N's output
            nxt = schedule(sched)
            frame += 1
            sched.update_from_output(inflight, output(sched, inflight))
            inflight = nxt
            spec = getattr(nxt, "scheduled_spec_decode_tokens", None) or {}
            if len(spec.get("A", ())) == 2 and nxt.num_scheduled_tokens.get("A") == 3 and frame >= 3:
                break
        print(f"frame {frame} in flight: A scheduled 3 tokens (2 drafts)")
        sched.reset_prefix_cache(reset_running_requests=True)
        post = schedule(sched)                        # A resumed: its recompute, in flight
        assert "A" in post.num_scheduled_tokens, "A was not rescheduled after the reset"
        before = a.num_computed_tokens
        print(f"reset_prefix_cache(reset_running_requests=True); A rescheduled: {post.num_scheduled_tokens['A']} "
              f"tokens, num_computed_tokens {before}")
        REJECT = True                                 # the stale frame's output: both drafts rejected
        sched.update_from_output(inflight, output(sched, inflight))
        after = a.num_computed_tokens
        print(f"frame {frame}'s (stale) output taken: num_computed_tokens {before} -> {after}, "
              f"num_output_placeholders {a.num_output_placeholders}")
        if after != before:
            print("BUG: the stale frame's rejected drafts were taken back from the resumed request: vLLM now counts "
                  f"{after} computed tokens while the forward in flight computes {before}")
            return 1
        print("OK: the stale output left the resumed request alone")
        return 0
    finally:
        shutil.rmtree(d, True)


if __name__ == "__main__":
    sys.exit(main())
