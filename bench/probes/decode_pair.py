# hipflash — development probe (not a benchmark of record): one decode cell (Sq = 1, GQA 32/8,
# D = 128, bf16) called a few times by hipflash (LSE on, [B, Sk, Hkv, D]) or by cuDNN
# (F.scaled_dot_product_attention with enable_gqa on its [B, Hkv, Sk, D] copy), for Nsight
# Compute to profile one launch of each: where the last percent against cuDNN at B = 32 goes
# (docs/design-decisions.md#decode). HIPFLASH_DECODE_HEADS picks hipflash's kernel.
# The calls run inside the NVTX range "decode" (ncu --nvtx --nvtx-include "decode/" profiles
# them and not the inputs' set-up).
# Usage: python3 bench/probes/decode_pair.py BUILD_DIR/python hipflash|cudnn B SK
import sys

import torch

sys.path.insert(0, sys.argv[1])
import hipflash as hf  # noqa: E402

who, B, Sk = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
Hq, Hkv, D = 32, 8, 128
torch.manual_seed(0)
q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
if who == "hipflash":
    call = lambda: hf.flash_attn_func(q, k, v, return_lse=True)  # noqa: E731
elif who == "cudnn":
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def call():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)
else:
    sys.exit(f"decode_pair.py: who must be hipflash or cudnn, not {who!r}")
call()  # the first call (cuDNN builds its plan) outside the range
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("decode")
for _ in range(4):
    call()
torch.cuda.nvtx.range_pop()
name = hf.last_kernel_name() if who == "hipflash" else "cudnn sdpa (enable_gqa)"
torch.cuda.synchronize()
print(who, B, Sk, name)
