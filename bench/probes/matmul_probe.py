# hipflash — development probe (not a benchmark of record): the bf16 8192^3 matrix-product rate
# that issue 9's "80% of the matmul rate" target is set against, timed several ways in one
# process, with the SM clock and power the driver reports after each: the benchmark's own way
# (attn_timing.matmul_rate: events per call behind a sleep kernel), calls back to back between
# two events (as a GEMM profiler times them), the same with out= and with all-zero inputs.
# The benchmark measured 687 TFLOP/s where a short warm burst (KINDS.md) saw 769-798: the
# product runs at the power limit when sustained (docs/design-decisions.md#benchmark-method).
# Usage: python3 bench/probes/matmul_probe.py
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attn_timing  # noqa: E402

N = attn_timing.MATMUL_N
FLOP = 2.0 * N ** 3


def smi():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi: {e}"


def back_to_back(a, b, out=None, calls=100, warm_s=2.0):
    """TFLOP/s of `calls` products issued back to back between two events, after warm_s of
    the same products."""
    mm = (lambda: torch.matmul(a, b, out=out)) if out is not None else (lambda: a @ b)
    t0 = time.time()
    while time.time() - t0 < warm_s:
        for _ in range(10):
            mm()
        torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(calls):
        mm()
    e1.record()
    torch.cuda.synchronize()
    return FLOP * calls / (e0.elapsed_time(e1) * 1e-3) / 1e12


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "|", smi())
    attn_timing._warm_gpu()
    timer = attn_timing.Timer("cuda", *attn_timing.BUDGETS["full"])  # the full suite's budget
    print(f"benchmark way (attn_timing.matmul_rate): {attn_timing.matmul_rate(timer):7.1f} TFLOP/s"
          f" | {smi()}")
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(N, N, device="cuda", dtype=torch.bfloat16)
    print(f"back to back, a @ b:                     {back_to_back(a, b):7.1f} TFLOP/s | {smi()}")
    print(f"back to back, matmul(out=):              {back_to_back(a, b, out):7.1f} TFLOP/s"
          f" | {smi()}")
    print(f"back to back, 10 calls after 0.2 s:      {back_to_back(a, b, calls=10, warm_s=0.2):7.1f}"
          f" TFLOP/s | {smi()}")
    z = torch.zeros_like(a)
    print(f"back to back, zeros:                     {back_to_back(z, z):7.1f} TFLOP/s | {smi()}")


if __name__ == "__main__":
    main()
