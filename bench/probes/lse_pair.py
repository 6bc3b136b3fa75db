# hipflash — development probe (not a benchmark of record): one FA-grid cell's forward, LSE off
# or on, called a few times, for Nsight Compute to profile one launch of each (the LSE-on cost
# at short rows: docs/design-decisions.md#lse-cost).
# Usage: python3 bench/probes/lse_pair.py BUILD_DIR/python off|on [B S H D [causal]]
import sys

import torch

sys.path.insert(0, sys.argv[1])
import hipflash as hf  # noqa: E402

mode = sys.argv[2]
B, S, H, D = (int(x) for x in (sys.argv[3:7] if len(sys.argv) > 6 else (16, 1024, 32, 64)))
causal = len(sys.argv) <= 7 or sys.argv[7] == "causal"
torch.manual_seed(0)
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(4):
    hf.flash_attn_func(q, k, v, causal=causal, return_lse=mode == "on")
torch.cuda.synchronize()
print(mode, hf.last_kernel_name())
