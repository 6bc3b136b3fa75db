# hipflash — development probe (not a benchmark of record): decode against cuDNN, split count by
# split count. For each decode cell (Sq = 1, GQA 32/8, D = 128, bf16, LSE on): the split count
# the heuristic picks, the time of every count in a sweep (attn_timing.Timer: CUDA events, warm-up,
# median, queue held by a sleep kernel; inputs rotated past 4x L2) as GB/s of K/V read, cuDNN's
# (SDPA cuDNN backend, native GQA) in the same run, and — torch.profiler — how the heuristic's
# call splits between the decode kernel and the combine kernel. Every configuration is checked
# against the unsplit call first (within SPEC's tolerance; a mismatch is reported, not timed).
# Usage (GPU machine, after scripts/gpu-check build): python3 bench/probes/decode_splits_probe.py
#   build-gpu/python [--cells B:Sk,B:Sk,...] [--splits 1,8,16,...] [--heads Hq:Hkv] [--paged P]
# --paged P also times every count on a paged copy of the same K/V (pages of P rows scattered by a
# random permutation, flash_attn_with_kvcache) and prints paged / contiguous.
# --heads 4:1 reads the same K/V bytes as 32:8 with each block's keys contiguous (one kv head:
# whole rows), where 32:8 gives a block a 256-byte slice of every 2 KiB row.
# --kv-layout bhsd keeps K and V as [B, Hkv, Sk, D] in memory for every side (hipflash reads a
# [B, Sk, Hkv, D] view of it, cuDNN the tensor itself): the layout the decode suite gives cuDNN.
import argparse
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import attn_timing as timing  # noqa: E402  (Timer, the benchmark's timing method)
import attn_backends as backends  # noqa: E402  (paged_copy, the serving suite's paged cache)

ap = argparse.ArgumentParser()
ap.add_argument("hipflash_path")
ap.add_argument("--cells", default="1:4096,1:32768,1:131072,8:32768,8:131072,32:131072")
ap.add_argument("--splits", default="1,4,8,16,24,29,33,40,48,64,96")
ap.add_argument("--heads", default="32:8", help="Hq:Hkv (D = 128)")
ap.add_argument("--paged", type=int, default=0, help="page size of a paged copy to time too")
ap.add_argument("--kv-layout", choices=("bshd", "bhsd"), default="bshd",
                help="memory layout of K and V for every side")
args = ap.parse_args()
sys.path.insert(0, args.hipflash_path)
import hipflash as hf  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
timer = timing.Timer(dev, *timing.BUDGETS["quick"])
l2 = torch.cuda.get_device_properties(0).L2_cache_size if dev == "cuda" else 0
Hq, Hkv = (int(x) for x in args.heads.split(":"))
D = 128
F = torch.nn.functional
for spec in args.cells.split(","):
    B, Sk = (int(x) for x in spec.split(":"))
    kv_bytes = 2 * B * Hkv * Sk * D * 2
    nsets = max(1, min(32, math.ceil(4 * l2 / kv_bytes))) if dev == "cuda" else 1
    g = torch.Generator(device=dev).manual_seed(B * 1_000_003 + Sk)
    sets = [[torch.randn(B, s, h, D, device=dev, dtype=torch.bfloat16, generator=g)
             for s, h in ((1, Hq), (Sk, Hkv), (Sk, Hkv))] for _ in range(nsets)]
    if args.kv_layout == "bhsd":
        sets = [[q] + [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v)]
                for q, k, v in sets]
    q0, k0, v0 = sets[0]
    paged = []
    if args.paged:
        P = args.paged
        nblk = B * Sk // P
        for q, k, v in sets:
            perm = torch.randperm(nblk, device=dev, generator=g)
            table = perm.view(B, Sk // P).to(torch.int32)
            paged.append((q, backends.paged_copy(k, P, perm), backends.paged_copy(v, P, perm),
                          table))
    heuristic = hf.resolve_num_splits(q0, k0)
    ref_out, ref_lse = hf.flash_attn_func(q0, k0, v0, return_lse=True, num_splits=1)
    print(f"B={B} Sk={Sk}: heuristic {heuristic} splits, {nsets} input sets, "
          f"K/V {kv_bytes / 1e6:.0f} MB")
    counts = sorted({int(x) for x in args.splits.split(",")} | {heuristic})
    for s in counts:
        out, lse = hf.flash_attn_func(q0, k0, v0, return_lse=True, num_splits=s)
        err = (out.float() - ref_out.float()).abs().max().item()
        lerr = (lse - ref_lse).abs().max().item()
        if not (err <= 2e-2 and lerr <= 1e-3):
            print(f"  splits {s:3d}: MISMATCH against the unsplit call (out {err:.3g}, lse "
                  f"{lerr:.3g}); not timed")
            continue
        t = timer.time(lambda i, s=s: hf.flash_attn_func(*sets[i], return_lse=True,
                                                          num_splits=s), nsets)["time_ms"]
        mark = "  <- heuristic" if s == heuristic else ""
        if paged:
            qp, kc, vc, table = paged[0]
            pout, plse = hf.flash_attn_with_kvcache(qp, kc, vc, block_table=table,
                                                    num_splits=s, return_lse=True)
            if not (torch.equal(pout, out) and torch.equal(plse, lse)):
                mark += "  paged MISMATCH (not bitwise the contiguous result)"
            tp = timer.time(lambda i, s=s: hf.flash_attn_with_kvcache(
                paged[i][0], paged[i][1], paged[i][2], block_table=paged[i][3], num_splits=s,
                return_lse=True), nsets)["time_ms"]
            mark = (f"  paged{args.paged} {tp * 1e3:9.2f} us  {kv_bytes / tp / 1e6:7.0f} GB/s"
                    f"  {t / tp:.2f}x{mark}")
        print(f"  splits {s:3d}: {t * 1e3:9.2f} us  {kv_bytes / t / 1e6:7.0f} GB/s{mark}")
    if dev == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        bhsd = [[x.transpose(1, 2) for x in st] for st in sets]

        def cudnn(i):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(*bhsd[i], enable_gqa=True)
        t = timer.time(cudnn, nsets)["time_ms"]
        print(f"  cudnn     : {t * 1e3:9.2f} us  {kv_bytes / t / 1e6:7.0f} GB/s")
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(10):
                hf.flash_attn_func(*sets[i % nsets], return_lse=True)
            torch.cuda.synchronize()
        for e in prof.key_averages():
            us = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 10
            if us > 0:
                print(f"    profile (heuristic): {us:8.2f} us per call  {e.key[:80]}")
    del sets
