#!/usr/bin/env python3
"""fp8 forward (float8_e4m3fn q, k, v) against bf16 on the same values, one cell at a time:
device time per call (CUDA events, 5 warm-up calls, median of 20), TFLOP/s of the valid pairs,
and the kernel hipflash ran; `--ncu` makes three calls of one cell's fp8 or bf16 forward for
Nsight Compute instead. Not checked for correctness (bench/attn_bench.py --suite fwd-fp8 is the
checked run; an experiment branch may time a kernel that computes the wrong thing on purpose).

    python3 bench/probes/fp8_probe.py build-gpu/python [--ncu fp8|bf16]
"""
import argparse
import statistics
import sys

import torch

CELLS = [(4, 4096, 16, 128, False), (1, 16384, 16, 128, False), (4, 4096, 32, 64, False),
         (4, 4096, 16, 128, True)]  # (B, S, H, D, causal)


def tflops(b, s, h, d, causal, ms):
    pairs = s * (s + 1) // 2 if causal else s * s
    return 4 * b * h * d * pairs / (ms * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("python_dir")
    ap.add_argument("--ncu", choices=["fp8", "bf16"])
    args = ap.parse_args()
    sys.path.insert(0, args.python_dir)
    import hipflash
    torch.manual_seed(0)
    if args.ncu:
        dt = torch.float8_e4m3fn if args.ncu == "fp8" else torch.bfloat16
        q = torch.randn(4, 4096, 16, 128, device="cuda").to(dt)
        for _ in range(3):
            hipflash.flash_attn_func(q, q, q)
        torch.cuda.synchronize()
        return
    for b, s, h, d, causal in CELLS:
        x = [torch.randn(b, s, h, d, device="cuda") for _ in range(3)]
        q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in x)
        qb, kb, vb = (t.to(torch.bfloat16) for t in x)
        res = {}
        for name, fn in (("bf16", lambda: hipflash.flash_attn_func(qb, kb, vb, causal=causal)),
                         ("fp8", lambda: hipflash.flash_attn_func(q8, k8, v8, causal=causal))):
            for _ in range(5):
                fn()
            times = []
            for _ in range(20):
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            res[name] = tflops(b, s, h, d, causal, statistics.median(times))
        print(f"B{b} S{s} H{h} D{d} causal={causal}: bf16 {res['bf16']:.0f} fp8 {res['fp8']:.0f} "
              f"TFLOP/s, fp8/bf16 {res['fp8'] / res['bf16']:.2f} ({hipflash.last_kernel_name()})")


if __name__ == "__main__":
    main()
