"""GPU benchmark of the Triton kernels: one JSON object on stdout.

    python benchmarks/kernels_gpu.py            # on a CUDA machine
    python benchmarks/kernels_gpu.py --smoke    # CPU, Triton interpreter, tiny shapes: checks
                                                # that this script runs (timings meaningless)
    python benchmarks/kernels_gpu.py --tiny     # the --smoke shapes on the GPU (compiled kernels);
                                                # without CUDA the same as no flag

For each kernel: median time of the Triton kernel and of its PyTorch twin (on the GPU when the
twin runs there; the reference ops build some constants on the CPU, then the twin is timed on the
CPU and says so), torch.nn.functional.scaled_dot_product_attention where comparable, the bytes
the kernel must move at least (inputs read once + outputs written) and the achieved bandwidth
against the device peak (nominal from a table of known parts, and a measured device-to-device
copy). Then HybridLM(backend="triton") on the GPU: reuse (snapshot/restore, continue) vs
recompute bitwise, and logits vs the torch backend. Without CUDA it prints {"cuda": false, ...}
and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

if __name__ == "__main__":   # parsed before triton is imported (TRITON_INTERPRET below)
    _ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _ap.add_argument("--smoke", action="store_true",
                     help="CPU, Triton interpreter, tiny shapes: checks the script runs (timings meaningless)")
    _ap.add_argument("--tiny", action="store_true",
                     help="the --smoke shapes and repetitions on the GPU: checks the script runs there "
                          "(timings meaningless); without CUDA it reports cuda: false")
    _ARGS = _ap.parse_args()
else:
    _ARGS = argparse.Namespace(smoke=False, tiny=False)
SMOKE = _ARGS.smoke
TINY = SMOKE or _ARGS.tiny      # the small shapes and repetitions
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
elif torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "0"          # compiled kernels, before triton is imported

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# nominal HBM bandwidth, GB/s (vendor figures)
PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350,
             "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864,
             "L4": 300, "A10G": 600, "RTX 4090": 1008, "V100": 900, "T4": 320}


def _peak(name: str) -> float | None:
    for key, val in PEAK_GBPS.items():
        if key.lower() in name.lower():
            return float(val)
    return None


def _time_ms(fn, dev: str, reps: int) -> float:
    fn()
    if dev == "cuda":
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def _to(x, dev):
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    return x


def _carry(A, H, T, D, dev):
    c = A.new_carry(H, T, D)
    return A.Carry(c.m.to(dev), c.acc.to(dev), c.n)


def main() -> dict:
    if not torch.cuda.is_available() and not SMOKE:
        return {"cuda": False, "reason": "no CUDA device (torch.cuda.is_available() is False); "
                "nothing timed. Run on a GPU machine, or --smoke for a CPU interpreter dry run.",
                "torch": torch.__version__}
    from kvcheck.kernels import attention as A
    from kvcheck.kernels import triton_ops as tr
    from kvcheck.kernels.backend import get_ops
    from kvcheck.reference.model import HybridLM

    dev = "cpu" if SMOKE else "cuda"
    reps = 2 if TINY else 20
    torch.manual_seed(0)
    out: dict = {"cuda": not SMOKE, "smoke": SMOKE, "tiny": TINY, "torch": torch.__version__,
                 "triton_interpret": tr.INTERPRET}
    if not SMOKE:
        props = torch.cuda.get_device_properties(0)
        name = props.name
        big = torch.empty(1 << (20 if TINY else 28), device="cuda")    # 1 GiB (4 MiB --tiny)
        ms = _time_ms(lambda: big.clone(), "cuda", reps if TINY else 10)
        copy_gbps = 2 * big.numel() * 4 / ms / 1e6
        del big
    else:
        name, copy_gbps = "cpu (interpreter smoke run)", None
    peak = _peak(name)
    out["device"] = {"name": name, "peak_GBps_nominal": peak,
                     "copy_GBps_measured": None if copy_gbps is None else round(copy_gbps, 1)}
    ref_bw = peak or copy_gbps

    # shapes: a 512-query chunk against a 4096-token paged context (tiny for --smoke, --tiny)
    H, D, P = (2, 16, 4) if TINY else (8, 64, 16)
    T, L = (4, 40) if TINY else (512, 4096)
    E, n, Hi, Di, m, C = (20, 4, 2, 16, 4, 32) if TINY else (1024, 64, 8, 64, 8, 1024)
    nb = 8 if TINY else 4096
    R = lambda *s: torch.randn(*s, device=dev)   # noqa: E731
    kernels: dict = {}

    def bench(key, tri_fn, twin_fn, twin_args, nbytes, sdpa_fn=None, compare=None):
        row: dict = {}
        try:
            t_tri = _time_ms(tri_fn, dev, reps)
            row["triton_ms"] = round(t_tri, 4)
            row["bytes_min"] = int(nbytes)
            gbps = nbytes / t_tri / 1e6
            row["triton_GBps"] = round(gbps, 1)
            if ref_bw:
                row["triton_frac_of_peak"] = round(gbps / ref_bw, 4)
        except Exception as e:                                     # report, keep going
            row["triton_error"] = repr(e)[:300]
        for tdev in ([dev, "cpu"] if dev != "cpu" else ["cpu"]):
            try:
                args = [_to(a, tdev) for a in twin_args]
                row["twin_ms"] = round(_time_ms(lambda: twin_fn(*args, tdev), tdev,
                                                max(2, reps // 4 if tdev == "cpu" else reps)), 4)
                row["twin_device"] = tdev
                break
            except Exception as e:
                row[f"twin_error_{tdev}"] = repr(e)[:200]
        if sdpa_fn is not None:
            try:
                row["sdpa_ms"] = round(_time_ms(sdpa_fn, dev, reps), 4)
            except Exception as e:
                row["sdpa_error"] = repr(e)[:200]
        if compare is not None:
            try:
                row.update(compare())
            except Exception as e:
                row["compare_error"] = repr(e)[:200]
        kernels[key] = row

    def rel(a, b):
        a, b = a.float().cpu(), b.float().cpu()
        fin = torch.isfinite(b)
        return {"max_rel_err_vs_twin": float((a[fin] - b[fin]).abs().max()
                                             / b[fin].abs().max().clamp(min=1e-30))}

    # paged attention (causal and sliding window)
    npg = -(-L // P)
    kp, vp = R(npg + 8, P, H, D), R(npg + 8, P, H, D)
    bt = torch.randperm(npg + 8, device=dev)[:npg].contiguous()
    q = R(T, H, D)
    qpos = torch.arange(L - T, L, device=dev)
    scale = D ** -0.5
    kc, vc = A.gather_pages(kp, bt)[0], A.gather_pages(vp, bt)[0]

    def sdpa(window):
        qs, ks, vs = q.transpose(0, 1)[None], kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]
        s = torch.arange(kc.shape[0], device=dev)
        mask = s[None, :] <= qpos[:, None]
        if window is not None:
            mask &= s[None, :] > qpos[:, None] - window
        return lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                                        scale=scale)
    for window in (None, 512 if not TINY else 7):
        seen = L if window is None else min(L, window + T)
        nbytes = 4 * (2 * T * H * D + 2 * seen * H * D) + bt.numel() * 8
        bench(f"paged_attention_{'causal' if window is None else 'swa'}",
              lambda w=window: tr.paged_attention(q, qpos, kp, vp, bt, w, scale),
              lambda q_, p_, k_, v_, b_, d_, w=window: A.paged_attention(q_, p_, k_, v_, b_, w,
                                                                         scale),
              [q, qpos, kp, vp, bt], nbytes, sdpa(window),
              lambda w=window: rel(tr.paged_attention(q, qpos, kp, vp, bt, w, scale),
                                   A.paged_attention(q.cpu(), qpos.cpu(), kp.cpu(), vp.cpu(),
                                                     bt.cpu(), w, scale)))

    # attention over compressed entries (hca: every entry w < limit) into a carry
    ek, ev = R(E, H, D), R(E, H, D)
    limit = torch.randint(0, E + 1, (T,), device=dev)
    zero = torch.zeros_like(limit)

    def rng_tri():
        return tr.attend_range(q, ek, ev, 0, zero, limit, _carry(A, H, T, D, dev))

    def rng_twin(q_, ek_, ev_, z_, l_, d_):
        return A.attend_range(q_, ek_, ev_, 0, z_, l_, _carry(A, H, T, D, d_))
    bench("attend_compressed_entries", rng_tri, rng_twin, [q, ek, ev, zero, limit],
          4 * (2 * T * H * D + 2 * E * H * D + T * H * 2),
          compare=lambda: rel(A.finish(rng_tri()),
                              A.finish(rng_twin(q.cpu(), ek.cpu(), ev.cpu(), zero.cpu(),
                                                limit.cpu(), "cpu"))))

    # sparse gather-attention over top-k selected entries
    sel = torch.sort(torch.randint(-1, E, (T, n), device=dev), dim=1).values

    def sel_tri():
        return tr.attend_selected(q, ek, ev, sel, _carry(A, H, T, D, dev))

    def sel_twin(q_, ek_, ev_, s_, d_):
        i = s_.clamp(min=0)
        return A.attend_gathered(q_, ek_[i], ev_[i], s_ >= 0, _carry(A, H, T, D, d_))
    bench("attend_selected_topk", sel_tri, sel_twin, [q, ek, ev, sel],
          4 * (2 * T * H * D + 2 * T * n * H * D + T * H * 2) + sel.numel() * 8,
          compare=lambda: rel(A.finish(sel_tri()),
                              A.finish(sel_twin(q.cpu(), ek.cpu(), ev.cpu(), sel.cpu(), "cpu"))))

    # block compression
    from kvcheck.kernels import compression, indexer, topk
    kv, gate, bias = R(nb, m, C), R(nb, m, C), R(m, C)
    bench("compress", lambda: tr.compress(kv, gate, bias),
          lambda a, b, c, d_: compression.compress(a, b, c), [kv, gate, bias],
          4 * (2 * nb * m * C + m * C + nb * C),
          compare=lambda: rel(tr.compress(kv, gate, bias),
                              compression.compress(kv.cpu(), gate.cpu(), bias.cpu())))

    # lightning indexer scores and top-k
    iq, iw, keys = R(T, Hi, Di), R(T, Hi), R(E, Di)
    ilim = torch.randint(0, E + 1, (T,), device=dev)
    bench("index_scores", lambda: tr.index_scores(iq, iw, keys, ilim),
          lambda a, b, c, l_, d_: indexer.index_scores(a, b, c, l_), [iq, iw, keys, ilim],
          4 * (T * Hi * Di + T * Hi + E * Di + T * E),
          compare=lambda: rel(tr.index_scores(iq, iw, keys, ilim),
                              indexer.index_scores(iq.cpu(), iw.cpu(), keys.cpu(), ilim.cpu())))
    scores = tr.index_scores(iq, iw, keys, ilim)
    bench("topk_desc", lambda: tr.topk_desc(scores, n),
          lambda s_, d_: topk.topk_desc(s_, n), [scores], 4 * T * E + 8 * T * n,
          compare=lambda: {"bitwise_equal_to_twin": bool(torch.equal(
              tr.topk_desc(scores, n).cpu(), topk.topk_desc(scores.cpu(), n)))})
    out["kernels"] = kernels

    # the model on the GPU kernels: reuse == recompute, and agreement with the torch backend
    try:
        toks = list(b"the hybrid cache is reused, then continued token by token..")
        toks = toks[:25] if TINY else toks * 4
        tri, ref = HybridLM(backend="triton"), HybridLM()
        full, _ = tri.prefill(toks)
        cut = len(toks) // 2 + 1
        _, st = tri.prefill(toks[:cut])
        rest, st2 = tri.prefill(toks[cut:-1], tri.restore(st.snapshot()))
        last, _ = tri.decode(toks[-1], st2)
        a, _ = ref.prefill(toks)
        out["model"] = {"backend_version": get_ops("triton").version, "tokens": len(toks),
                        "reuse_equals_recompute_bitwise": bool(torch.equal(rest, full[cut:-1])
                                                               and torch.equal(last, full[-1])),
                        "max_rel_err_vs_torch_backend": float((a - full).abs().max()
                                                              / a.abs().max())}
    except Exception as e:
        out["model"] = {"error": repr(e)[:300]}
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
