"""CUDA/HIP tensors given to a hipflash built without GPU kernels (HIPFLASH_GPU=none)."""
import pytest
import torch

import hipflash
from reference import make_qkv, make_varlen


@pytest.mark.skipif(not torch.cuda.is_available() or hipflash.gpu_available(),
                    reason="needs a GPU visible to torch and a hipflash built without GPU kernels")
def test_cuda_tensors_raise_not_implemented():
    q, k, v = make_qkv(1, 8, 8, 2, 2, 64, torch.bfloat16, device="cuda")
    out = torch.full_like(q, float("nan"))
    with pytest.raises(NotImplementedError, match="HIPFLASH_GPU"):
        hipflash.flash_attn_func(q, k, v, out=out, return_lse=True)
    qv, kv, vv, cu_q, cu_k = make_varlen([3, 5], [4, 4], 2, 2, 64, torch.bfloat16, device="cuda")
    with pytest.raises(NotImplementedError, match="HIPFLASH_GPU"):
        hipflash.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 5, 4)
    with pytest.raises(NotImplementedError, match="HIPFLASH_GPU"):
        hipflash.resolve_num_splits(q, k)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()
