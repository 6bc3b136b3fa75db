"""Development probe (not a benchmark of record): generation at batch 1 with Hugging Face
transformers, hipflash's attention ("hipfa") against SDPA on generate_bench.py's model and
prompts: ms per token (best of three 64-token generations, wall clock) and torch.profiler's
CPU self time per op over a 32-token generation, to see where a host-bound decode step spends
its time (design-decisions.md#flashattention-surface-in-python-on-measured-kernels)."""
import os
import sys
import types

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import generate_bench as gb  # noqa: E402
import transformers  # noqa: E402

import hipflash.integrations.transformers as hf  # noqa: E402

name = hf.register()
args = types.SimpleNamespace(tiny=False, device="cuda", kv_heads=4)
torch.manual_seed(0)
sdpa = gb._model(transformers, "sdpa", None, args)
models = {"sdpa": sdpa, name: gb._model(transformers, name, sdpa.state_dict(), args)}
ids, mask = gb._prompts(1, 512, 32000, "cuda", seed=1)
for n, m in models.items():
    gb._generate(m, ids, mask, 8)
    t = [gb._generate(m, ids, mask, 64) for _ in range(3)]
    print(f"{n}: {min(t) / 64 * 1e3:.2f} ms/token")
for n, m in models.items():
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        gb._generate(m, ids, mask, 32)
    print(f"===== {n}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
