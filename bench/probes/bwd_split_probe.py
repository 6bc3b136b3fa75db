# hipflash — development probe (not a benchmark of record): where a backward call's device
# time goes. For each train-suite cell (bf16, [B, S, H, D], B * S = 16k, H * D = 2048): the
# gradients checked against fp32 SDPA on two heads, then torch.profiler over a few calls of
# hipflash's backward (a saved forward's graph reused) and of cuDNN's (SDPA cuDNN backend) in
# the same run: each kernel's device time per call (preprocess, dk/dv, dq conversion or dq
# pass), the sum, and cuDNN's sum beside it — the fixed passes' share at short rows, before
# and after a kernel change.
# Usage (GPU machine, after scripts/gpu-check build):
#   python3 bench/probes/bwd_split_probe.py build-gpu/python [--cells S:D[:c],...] [--calls N]
#     [--deterministic]
# A cell S:D is B = 16k / S, H = 2048 / D; a trailing :c makes it causal.
import argparse
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("hipflash_path")
ap.add_argument("--cells", default="512:128:c,1024:128:c,4096:128:c,16384:128:c,512:64:c,512:128")
ap.add_argument("--calls", type=int, default=5, help="profiled backward calls per side")
ap.add_argument("--deterministic", action="store_true", help="hipflash's deterministic mode")
args = ap.parse_args()
sys.path.insert(0, args.hipflash_path)
import hipflash as hf  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("bwd_split_probe: needs a CUDA GPU (torch.cuda.is_available() is False)")


def cells():
    for spec in args.cells.split(","):
        parts = spec.split(":")
        s, d = int(parts[0]), int(parts[1])
        yield s, d, len(parts) > 2 and parts[2] == "c"


def cudnn(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=causal).transpose(1, 2)


def ours(q, k, v, causal):
    return hf.flash_attn_func(q, k, v, causal=causal, deterministic=args.deterministic)


def per_kernel(attn, q, k, v, dout, causal):
    """Device time per backward call of each kernel (ms), from torch.profiler."""
    out = attn(q, k, v, causal)
    for _ in range(2):  # warm-up
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
    times = defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and not e.key.startswith("cudaLaunch"):
            times[e.key] += t / 1e3 / args.calls
    return times


torch.manual_seed(0)
print(f"{'cell':22s} {'side':9s} {'ms/call':>8s}  kernels (ms/call)")
for s, d, causal in cells():
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    label = f"S={s} D={d}{' causal' if causal else ''}"
    # Correct first: hipflash's gradients against PyTorch's fp32 math on a slice of the heads.
    hs = slice(0, 2)
    qs, ks, vs = (t[:, :, hs].detach().float().requires_grad_() for t in (q, k, v))
    ref_out = F.scaled_dot_product_attention(qs.transpose(1, 2), ks.transpose(1, 2),
                                             vs.transpose(1, 2), is_causal=causal).transpose(1, 2)
    ref = torch.autograd.grad(ref_out, (qs, ks, vs), dout[:, :, hs].float())
    got = torch.autograd.grad(ours(q, k, v, causal), (q, k, v), dout)
    for name, g, r in zip("qkv", got, ref):
        err = (g[:, :, hs].float() - r).abs().max().item()
        if not err <= 2e-2 * r.abs().max().item() + 1e-3:
            print(f"{label:22s} d{name} max|err| {err:.3g}: not timed")
            break
    else:
        for side, attn in (("hipflash", ours), ("cudnn", cudnn)):
            times = per_kernel(attn, q, k, v, dout, causal)
            total = sum(times.values())
            top = sorted(times.items(), key=lambda kv: -kv[1])[:5]
            print(f"{label:22s} {side:9s} {total:8.3f}  " +
                  ", ".join(f"{name[:48]} {t:.3f}" for name, t in top), flush=True)
    del q, k, v, dout
    torch.cuda.empty_cache()
