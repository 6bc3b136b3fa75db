# hipflash — development probe (not a benchmark of record): where does LSE-on time go?
# 1) interleaved event timing, LSE off/on alternating, sleep pre-fill; 2) torch.profiler per-kernel
# device durations for each mode.
# Usage: python3 bench/probes/lse_probe.py BUILD_DIR/python [CELL_REGEX]
import re
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, sys.argv[1])
import hipflash as hf  # noqa: E402

torch.manual_seed(0)
dev = "cuda"
cells = [
    ("decode B=1 Sk=8k", 1, 1, 8192, 32, 8, 128, False),
    ("decode B=1 Sk=16k", 1, 1, 16384, 32, 8, 128, False),
    ("decode B=1 Sk=128k", 1, 1, 131072, 32, 8, 128, False),
    ("decode B=8 Sk=16k", 8, 1, 16384, 32, 8, 128, False),
    ("fa hd64 S=512", 32, 512, 512, 32, 32, 64, False),
    ("fa hd128 S=512", 32, 512, 512, 16, 16, 128, False),
    ("fa hd64 S=512 causal", 32, 512, 512, 32, 32, 64, True),
    ("fa hd64 S=1k causal", 16, 1024, 1024, 32, 32, 64, True),
    ("fa hd128 S=512 causal", 32, 512, 512, 16, 16, 128, True),
    ("fa hd128 S=2k causal", 8, 2048, 2048, 16, 16, 128, True),
    ("fa hd96 S=1k causal", 16, 1024, 1024, 21, 21, 96, True),
    ("fa hd256 S=1k causal", 16, 1024, 1024, 8, 8, 256, True),
]
if len(sys.argv) > 2:
    cells = [c for c in cells if re.search(sys.argv[2], c[0])]
cyc = None
def calib():
    global cyc
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda._sleep(1000000); a.record(); torch.cuda._sleep(2000000); b.record(); torch.cuda.synchronize()
    cyc = 2000000 / a.elapsed_time(b)
calib()

def timed(fn, n=60):
    torch.cuda.synchronize()
    torch.cuda._sleep(int(cyc * 20))
    s = [torch.cuda.Event(True) for _ in range(n)]; e = [torch.cuda.Event(True) for _ in range(n)]
    for j in range(n):
        s[j].record(); fn(); e[j].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(s, e)) * 1e3

for name, B, Sq, Sk, Hq, Hkv, D, causal in cells:
    q = torch.randn(B, Sq, Hq, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, Sk, Hkv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, Sk, Hkv, D, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, Sq, device=dev, dtype=torch.float32)
    splits = hf.resolve_num_splits(q, k, causal=causal)
    fns = {
        "off": lambda: hf.flash_attn_func(q, k, v, causal=causal, out=out),
        "on": lambda: hf.flash_attn_func(q, k, v, causal=causal, return_lse=True, out=out),
    }
    for f in fns.values():
        for _ in range(5): f()
    res = {"off": [], "on": []}
    for r in range(4):
        for m in (("off", "on") if r % 2 == 0 else ("on", "off")):
            res[m].append(timed(fns[m]))
    print(f"{name}: splits={splits} kernel(on)={hf.last_kernel_name()}")
    for m in ("off", "on"):
        print(f"  events {m:3s}: " + " ".join(f"{t:8.2f}" for t in res[m]) + " us")
    for m in ("off", "on"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(30): fns[m]()
            torch.cuda.synchronize()
        rows = []
        for ev in prof.key_averages():
            if ev.device_type == torch.autograd.DeviceType.CUDA or getattr(ev, "device_time_total", 0) > 0:
                t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                if t > 0:
                    rows.append((ev.key[:70], ev.count, t / max(ev.count, 1)))
        for k_, c, t in sorted(rows, key=lambda x: -x[2]):
            print(f"  prof {m:3s}: {k_:70s} n={c:3d} avg={t:8.2f} us")
    del q, k, v, out, lse
    torch.cuda.empty_cache()
