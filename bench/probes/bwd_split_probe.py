# hipflash — development probe (not a benchmark of record): where a backward call's device
# time goes. For each train-suite cell (bf16, [B, S, H, D], B * S = 16k, H * D = 2048): the
# gradients checked against fp32 SDPA on two heads, then torch.profiler over a few calls of
# hipflash's backward (a saved forward's graph reused) and of cuDNN's (SDPA cuDNN backend) in
# the same run: each kernel's device time per call (preprocess, dk/dv, dq conversion or dq
# pass), the sum, and cuDNN's sum beside it — the fixed passes' share at short rows, before
# and after a kernel change. --sides picks what is profiled side by side: hipflash,
# hipflash-det (deterministic=True) and cudnn (dense cells only).
# Beside the profiler's per-kernel sum, "events ms" is the backward call's device time by CUDA
# events over the same calls (the passes overlap where a programmatic dependent's blocks are
# placed before its prerequisite ends, so the sum can exceed it).
# Usage (GPU machine, after scripts/gpu-check build):
#   python3 bench/probes/bwd_split_probe.py build-gpu/python [--cells S:D[:c],...] [--calls N]
#     [--sides hipflash,hipflash-det,cudnn] [--ncu]
# --ncu: after each cell's check, three untimed backward calls a side, no profiler, for Nsight
# Compute (e.g. ncu --kernel-name regex:'dkdv|bprop' --launch-skip 2 --launch-count 1 ...).
# A cell S:D is B = 16k / S, H = 2048 / D; a trailing :c makes it causal. S = varlen is the train
# suite's varlen cell (16k tokens packed, sequences of 512..4k, bench/train_bench.py), varlen-desc
# / varlen-asc its lengths sorted, RxN a varlen call of N sequences of R tokens.
import argparse
import pathlib
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("hipflash_path")
ap.add_argument("--cells", default="512:128:c,1024:128:c,4096:128:c,16384:128:c,512:64:c,512:128")
ap.add_argument("--calls", type=int, default=5, help="profiled backward calls per side")
ap.add_argument("--ncu", action="store_true",
                help="untimed backward calls (three a side) for Nsight Compute, no profiler")
ap.add_argument("--sides", default="hipflash,cudnn",
                help="comma-separated: hipflash, hipflash-det, cudnn (dense cells)")
args = ap.parse_args()
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from attn_cells import varlen_lengths  # noqa: E402
sys.path.insert(0, args.hipflash_path)
import hipflash as hf  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("bwd_split_probe: needs a CUDA GPU (torch.cuda.is_available() is False)")


def cells():
    for spec in args.cells.split(","):
        parts = spec.split(":")
        yield parts[0], int(parts[1]), len(parts) > 2 and parts[2] == "c"


def cudnn(q, k, v, causal, lens):
    del lens  # dense cells only
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=causal).transpose(1, 2)


def ours(deterministic):
    def attn(q, k, v, causal, lens):
        if lens is None:
            return hf.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        out = hf.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, max(lens), max(lens),
                                        causal=causal, deterministic=deterministic)
        return out.unsqueeze(0)
    return attn


def per_kernel(attn, q, k, v, dout, causal, lens):
    """Device time per backward call of each kernel (ms), from torch.profiler."""
    out = attn(q, k, v, causal, lens)
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
    # The same calls by CUDA events, back to back after the first.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    start.record()
    for _ in range(args.calls):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    end.record()
    torch.cuda.synchronize()
    return times, start.elapsed_time(end) / args.calls


torch.manual_seed(0)
print(f"{'cell':22s} {'side':12s} {'ms/call':>8s} {'events':>8s}  kernels (ms/call)")
sides = {"hipflash": ours(False), "hipflash-det": ours(True), "cudnn": cudnn}
def varlen_cell(spec, d):
    """A varlen cell's sequence lengths: varlen (the train suite's mix), varlen-desc /
    varlen-asc (the same lengths sorted), RxN (N sequences of R tokens); else None (dense)."""
    if spec.startswith("varlen"):
        lens = varlen_lengths(16384, 512, 4096, seed=d)
        order = spec.partition("-")[2]
        return sorted(lens, reverse=order == "desc") if order else lens
    if "x" in spec:
        r, n = spec.split("x")
        return [int(r)] * int(n)
    return None


for spec, d, causal in cells():
    lens = varlen_cell(spec, d)
    b, h, s = (16384 // int(spec), 2048 // d, int(spec)) if lens is None else (1, 2048 // d, sum(lens))
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    label = f"{spec if lens else f'S={s}'} D={d}{' causal' if causal else ''}"
    # Correct first: hipflash's gradients against PyTorch's fp32 math on a slice of the heads
    # (varlen: of the first sequence's rows).
    hs, rows = slice(0, 2), slice(0, lens[0] if lens else s)
    qs, ks, vs = (t[:, rows, hs].detach().float().requires_grad_() for t in (q, k, v))
    ref_out = F.scaled_dot_product_attention(qs.transpose(1, 2), ks.transpose(1, 2),
                                             vs.transpose(1, 2), is_causal=causal).transpose(1, 2)
    ref = torch.autograd.grad(ref_out, (qs, ks, vs), dout[:, rows, hs].float())
    bad = None
    for side in args.sides.split(","):
        if side != "cudnn":
            got = torch.autograd.grad(sides[side](q, k, v, causal, lens), (q, k, v), dout)
            for name, g, r in zip("qkv", got, ref):
                err = (g[:, rows, hs].float() - r).abs().max().item()
                if not err <= 2e-2 * r.abs().max().item() + 1e-3:
                    bad = f"{side} d{name} max|err| {err:.3g}"
    here = [s for s in args.sides.split(",") if not (s == "cudnn" and lens)]  # cuDNN: dense
    if bad:
        print(f"{label:22s} {bad}: not timed")
    elif args.ncu:
        for side in here:
            out = sides[side](q, k, v, causal, lens)
            for _ in range(3):
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            torch.cuda.synchronize()
            print(f"{label:22s} {side:12s} three backward calls made", flush=True)
    else:
        for side in here:
            times, events = per_kernel(sides[side], q, k, v, dout, causal, lens)
            total = sum(times.values())
            top = sorted(times.items(), key=lambda kv: -kv[1])[:5]
            print(f"{label:22s} {side:12s} {total:8.3f} {events:8.3f}  " +
                  ", ".join(f"{name[:60]} {t:.3f}" for name, t in top), flush=True)
    del q, k, v, dout
    torch.cuda.empty_cache()
