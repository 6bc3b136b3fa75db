"""hipflash on CUDA/HIP tensors (the GPU kernels) against the reference of SPEC §3.

Skipped unless torch sees a GPU and this hipflash was built with GPU kernels. The reference runs
on the GPU too (fp32, TF32 off: see conftest.py). Budget: about three minutes on an H200.

HIPFLASH_TEST_DEVICE=cpu runs the same checks on CPU tensors (the large cases are skipped):
a way to check this file itself on a machine without a GPU.
"""
import math
import os

import pytest
import torch

import hipflash
from reference import (
    assert_bitwise_equal,
    check_attention,
    check_lse,
    check_kv_per_sequence,
    check_out,
    head_major,
    make_chunked_prefill,
    make_kv_cache,
    make_qkv,
    make_varlen,
    varlen_attention_ref,
    view_in_nan_storage,
)

DEVICE = os.environ.get("HIPFLASH_TEST_DEVICE", "cuda")
ON_CPU = DEVICE == "cpu"

pytestmark = pytest.mark.skipif(
    not ON_CPU and not (torch.cuda.is_available() and hipflash.gpu_available()),
    reason="needs a GPU visible to torch and a hipflash built with GPU kernels "
    f"(HIPFLASH_GPU=cuda or hip); this build: {hipflash.build_info()!r}, "
    f"torch.cuda.is_available()={torch.cuda.is_available()}",
)
large = pytest.mark.skipif(ON_CPU, reason="too large for the CPU backend")

DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [32, 64, 96, 128, 256]
# (Sq, Sk): single row/key, odd lengths, one-off block edges both ways, cross-attention.
SEQLENS = [(1, 1), (113, 203), (128, 217), (1023, 1024), (1024, 1023), (239, 1), (799, 3),
           (2, 5), (5, 2)]


def dtype_id(d):
    return str(d).replace("torch.", "")


def seq_id(s):
    return f"sq{s[0]}_sk{s[1]}"


def qkv(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16, seed=0):
    return make_qkv(b, sq, sk, hq, hkv, d, dtype, device=DEVICE, seed=seed)


def sync():
    if not ON_CPU:
        torch.cuda.synchronize()


# ---- Correctness grids -----------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=seq_id)
@pytest.mark.parametrize("dim", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_grid(dtype, dim, seqlens, causal):
    sq, sk = seqlens
    q, k, v = qkv(2, sq, sk, 6, 2, dim, dtype)
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal)
    if not ON_CPU:
        assert hipflash.last_kernel_name().startswith("fwd_"), hipflash.last_kernel_name()


@large
@pytest.mark.parametrize("dtype,dim,heads,causal", [
    (torch.bfloat16, 128, (6, 6), True),
    (torch.float16, 64, (6, 2), False),
], ids=["bf16_d128_causal", "f16_d64_gqa"])
def test_long_square(dtype, dim, heads, causal):
    q, k, v = qkv(1, 4224, 4224, heads[0], heads[1], dim, dtype, seed=1)
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(128, 217), (1, 1000)], ids=seq_id)
@pytest.mark.parametrize("dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("heads", [(6, 6), (6, 2), (6, 1), (32, 8)], ids=lambda h: f"h{h[0]}_{h[1]}")
def test_heads(heads, dim, seqlens, causal):
    sq, sk = seqlens
    q, k, v = qkv(2, sq, sk, heads[0], heads[1], dim, seed=2)
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal)


WINDOWS = [(0, 0), (16, -1), (-1, 8), (64, 64), (256, 0)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("seqlens", [(113, 203), (1024, 1023), (799, 3)], ids=seq_id)
@pytest.mark.parametrize("dtype,dim", [(torch.bfloat16, 128), (torch.float16, 64)],
                         ids=["bf16_d128", "f16_d64"])
def test_windows(dtype, dim, seqlens, window, causal):
    sq, sk = seqlens
    q, k, v = qkv(1, sq, sk, 6, 2, dim, dtype, seed=3)
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                        return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal, window_size=window)


# ---- Varlen ----------------------------------------------------------------------------------

# Zero-length sequences on both sides, a long one, and one of each length class.
LENS_Q = [0, 113, 1, 1023, 0, 64, 5]
LENS_K = [5, 203, 0, 1024, 0, 300, 2]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (32, 16))],
                         ids=["full", "causal", "w32_16"])
@pytest.mark.parametrize("dtype,dim", [(torch.bfloat16, 128), (torch.float16, 64),
                                       (torch.bfloat16, 256)], ids=["bf16_d128", "f16_d64", "bf16_d256"])
def test_varlen(dtype, dim, causal, window, num_splits):
    q, k, v, cu_q, cu_k = make_varlen(LENS_Q, LENS_K, 6, 2, dim, dtype, device=DEVICE, seed=4)
    max_q, max_k = max(LENS_Q), max(LENS_K)
    kw = dict(causal=causal, window_size=window)
    out_ref, lse_packed_ref, lse_padded_ref = varlen_attention_ref(q, k, v, cu_q, cu_k, max_q, **kw)
    out_lp, _, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, max_q, lowp=True, **kw)

    out, lse = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                               num_splits=num_splits, return_lse=True, **kw)
    check_out(out, out_ref, out_lp, "padded")
    check_lse(lse, lse_padded_ref, "padded")  # includes the -inf padding rows

    out_k, lse_k = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                   num_splits=num_splits, return_lse=True,
                                                   lse_layout="packed", **kw)
    check_out(out_k, out_ref, out_lp, "packed")
    check_lse(lse_k, lse_packed_ref, "packed")
    out_n = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                            num_splits=num_splits, **kw)
    assert_bitwise_equal(out, out_n, "with vs without lse")


# ---- Split-K ---------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 4096, 8, 8), (16, 8192, 32, 8), (128, 2048, 6, 2)],
                         ids=lambda s: "sq{}_sk{}_h{}_{}".format(*s))
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 17, 40, 0])
def test_num_splits(num_splits, shape, causal):
    sq, sk, hq, hkv = shape
    q, k, v = qkv(1, sq, sk, hq, hkv, 128, seed=5)
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, num_splits=num_splits,
                                        return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal)
    _, lse_1 = hipflash.flash_attn_func(q, k, v, causal=causal, num_splits=1, return_lse=True)
    finite = torch.isfinite(lse_1)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - lse_1[finite]).abs().max().item() <= 1e-4
    if num_splits == 0:
        resolved = hipflash.resolve_num_splits(q, k, causal=causal)
        out_n, lse_n = hipflash.flash_attn_func(q, k, v, causal=causal, num_splits=resolved,
                                                return_lse=True)
        assert_bitwise_equal(out, out_n, f"num_splits=0 vs {resolved}")
        assert_bitwise_equal(lse, lse_n, f"num_splits=0 vs {resolved}")


@large
@pytest.mark.parametrize("seqlens,causal", [((1, 100_000), False), ((3, 32_768), True),
                                            ((16, 100_000), True), ((1, 4096), False)],
                         ids=["sq1_sk100k", "sq3_sk32k_causal", "sq16_sk100k_causal", "sq1_sk4k"])
def test_decode(seqlens, causal):
    """Decode shapes (few query rows, long KV cache) where split-K matters; GQA 32/8."""
    sq, sk = seqlens
    q, k, v = qkv(2, sq, sk, 32, 8, 128, seed=6)
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal)
    _, lse_1 = hipflash.flash_attn_func(q, k, v, causal=causal, num_splits=1, return_lse=True)
    assert (lse - lse_1).abs().max().item() <= 1e-4


@large
@pytest.mark.parametrize("b,sk", [(8, 32_768), (8, 16_384), (1, 65_536)],
                         ids=["b8_sk32k", "b8_sk16k", "b1_sk64k"])
def test_long_gqa_decode_kernel(b, sk):
    """Packed GQA decode with eight kv heads, hd128, long keys, checked against the reference.
    On sm_90 by default the decode kernel takes these calls (the head-group decode kernel only
    from 32 head groups x batches and 128k keys, 8 GiB of K a call: the selector's gtest checks
    that rule); under HIPFLASH_DECODE_HEADS=1 (scripts/gpu-check runs this test so too) the
    head-group kernel takes them, under =0 the decode kernel."""
    q, k, v = qkv(b, 1, sk, 16, 8, 128, seed=7)
    out, lse = hipflash.flash_attn_func(q, k, v, return_lse=True)
    name = hipflash.last_kernel_name()
    check_attention(out, lse, q, k, v)
    sm90 = torch.cuda.get_device_capability() == (9, 0) and "sm90" in hipflash.build_info()
    if sm90:
        heads = os.environ.get("HIPFLASH_DECODE_HEADS", "")[:1] == "1"
        assert name.startswith("fwd_decode_heads_" if heads else "fwd_decode_"), name
        assert heads or not name.startswith("fwd_decode_heads_"), name


@large
def test_long_gqa_decode_kernel_follows_the_cache_layout():
    """B = 32, Sk = 128k, GQA 32/8, hd128 (16 GiB of K and V a layout): by default on sm_90 the
    head-group decode kernel takes the [B, Sk, Hkv, D] cache, whose key rows hold every kv head,
    and the decode kernel the same keys kept head-major ([B, Hkv, Sk, D], passed as a view).
    K = 0 and V = b * Hkv + h + 1 (whole numbers, exact in bf16) make the result exact whatever
    the splits: out = the value of the query head's kv head, LSE = log(Sk) to rounding."""
    if not (torch.cuda.get_device_capability() == (9, 0) and "sm90" in hipflash.build_info()):
        pytest.skip("the head-group decode kernel is an sm_90 kernel of sm_90a builds")
    if torch.cuda.mem_get_info()[0] < 20 * 2**30:
        pytest.skip("needs 20 GiB of free GPU memory")
    b, sk, hq, hkv, d = 32, 131072, 32, 8, 128
    setting = os.environ.get("HIPFLASH_DECODE_HEADS", "")[:1]  # as src/gpu/gpu_backend.cu
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    value = torch.arange(1, b * hkv + 1, device="cuda", dtype=torch.float32).view(b, hkv)
    want = value.repeat_interleave(hq // hkv, 1)[:, None, :, None].expand(b, 1, hq, d)
    for head_major in (False, True):
        shape = (b, hkv, sk, d) if head_major else (b, sk, hkv, d)
        k = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
        per_head = value.view(b, hkv, 1, 1) if head_major else value.view(b, 1, hkv, 1)
        v = per_head.to(torch.bfloat16).expand(shape).contiguous()
        if head_major:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        out, lse = hipflash.flash_attn_func(q, k, v, return_lse=True)
        name = hipflash.last_kernel_name()
        del k, v
        assert torch.equal(out.float(), want), "out"
        torch.testing.assert_close(lse, torch.full_like(lse, math.log(sk)), rtol=0, atol=1e-5)
        heads = setting == "1" or (setting == "" and not head_major)
        assert name.startswith("fwd_decode_heads_" if heads else "fwd_decode_"), (head_major, name)
        assert heads or not name.startswith("fwd_decode_heads_"), (head_major, name)


# ---- Determinism, poisoned buffers, streams --------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 4, 0])
def test_deterministic(num_splits):
    q, k, v = qkv(2, 300, 2000, 8, 2, 128, seed=7)
    first = hipflash.flash_attn_func(q, k, v, causal=True, num_splits=num_splits, return_lse=True)
    for _ in range(3):
        again = hipflash.flash_attn_func(q, k, v, causal=True, num_splits=num_splits,
                                         return_lse=True)
        assert_bitwise_equal(first[0], again[0], "out")
        assert_bitwise_equal(first[1], again[1], "lse")


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dim", [64, 96, 256], ids=lambda d: f"d{d}")
def test_nan_poisoned_out_and_kv_views_in_nan_storage(dim, num_splits):
    """out starts as NaN (every element must be written) and q/k/v are views inside NaN-filled
    buffers (no element outside a view may be read, padding of the head dim included)."""
    q, k, v = qkv(2, 129, 517, 6, 2, dim, torch.float16, seed=8)
    qn, kn, vn = view_in_nan_storage(q), view_in_nan_storage(k), view_in_nan_storage(v)
    out = torch.full_like(q, float("nan"))
    res, lse = hipflash.flash_attn_func(qn, kn, vn, causal=True, num_splits=num_splits,
                                        return_lse=True, out=out)
    assert res is out
    check_attention(out, lse, q, k, v, causal=True)


def test_varlen_nan_poisoned_out():
    q, k, v, cu_q, cu_k = make_varlen(LENS_Q, LENS_K, 4, 4, 128, torch.bfloat16, device=DEVICE,
                                      seed=9)
    out = torch.full_like(q, float("nan"))
    hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), out=out)
    out_ref, _, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, max(LENS_Q))
    out_lp, _, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, max(LENS_Q), lowp=True)
    check_out(out, out_ref, out_lp)


@pytest.mark.skipif(ON_CPU, reason="streams are a GPU matter")
def test_runs_on_the_current_stream():
    q, k, v = qkv(2, 257, 1500, 8, 2, 128, seed=10)
    expected, lse_expected = hipflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out, lse = hipflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    stream.synchronize()
    assert_bitwise_equal(out, expected)
    assert_bitwise_equal(lse, lse_expected)


@pytest.mark.parametrize("shape", [(0, 5, 7), (2, 0, 7), (2, 5, 0)], ids=["b0", "sq0", "sk0"])
def test_empty(shape):
    b, sq, sk = shape
    q, k, v = qkv(b, sq, sk, 4, 2, 64)
    out = torch.full_like(q, float("nan"))
    res, lse = hipflash.flash_attn_func(q, k, v, causal=True, return_lse=True, out=out)
    sync()
    assert lse.shape == (b, 4, sq)
    if sk == 0:
        assert (out == 0).all() and torch.isneginf(lse).all()


# ---- Limits: 64-bit offsets, large grids -----------------------------------------------------


def _free_gib():
    return torch.cuda.mem_get_info()[0] / 2**30


@large
def test_more_than_2_31_elements():
    """q and out of more than 2^31 elements: 64-bit offsets (rows past 2^31 elements checked)."""
    if _free_gib() < 24:
        pytest.skip("needs about 20 GiB of free GPU memory")
    rows = 2**31 // 128 + 64
    q = torch.empty(1, rows, 1, 128, dtype=torch.bfloat16, device=DEVICE).normal_()
    _, k, v = qkv(1, 1, 16, 1, 1, 128, seed=11)
    out, lse = hipflash.flash_attn_func(q, k, v, return_lse=True)
    for sl in (slice(0, 64), slice(rows - 64, rows)):
        check_attention(out[:, sl], lse[:, :, sl].contiguous(), q[:, sl], k, v, what=f"rows {sl}")
    del q, out, lse


@large
@pytest.mark.parametrize("shape", [(65536, 1, 2, 2), (1, 2, 65536, 1)],
                         ids=["batch65536", "heads65536"])
def test_large_grid_works_or_fails_cleanly(shape):
    """B >= 65536 or Hq >= 65536: the right answer, or a clear error before launch."""
    b, sq, hq, hkv = shape
    q, k, v = qkv(b, sq, 4, hq, hkv, 64, seed=12)
    out = torch.full_like(q, float("nan"))
    try:
        _, lse = hipflash.flash_attn_func(q, k, v, return_lse=True, out=out)
    except (ValueError, NotImplementedError) as e:
        assert "65536" in str(e) or "grid" in str(e) or "limit" in str(e), str(e)
        sync()
        assert torch.isnan(out).all(), "a rejected call wrote into out"
        return
    check_attention(out, lse, q, k, v)


# ---- Errors ----------------------------------------------------------------------------------


@pytest.mark.skipif(ON_CPU, reason="device mismatch needs a GPU")
def test_device_mismatch():
    q, k, v = qkv(1, 8, 8, 2, 2, 64)
    with pytest.raises(ValueError, match="k is on cpu but q is on cuda"):
        hipflash.flash_attn_func(q, k.cpu(), v)
    out = torch.full_like(q, float("nan")).cpu()
    with pytest.raises(ValueError, match="out is on cpu"):
        hipflash.flash_attn_func(q, k, v, out=out)
    qv, kv, vv, cu_q, cu_k = make_varlen([3, 5], [4, 4], 2, 2, 64, torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens_q is on cpu"):
        hipflash.flash_attn_varlen_func(qv, kv, vv, cu_q.cpu(), cu_k, 5, 4)


@pytest.mark.parametrize("make,exc,match", [
    (lambda q, k, v: (q, k.half(), v.half()), TypeError, "k must have dtype bfloat16"),
    (lambda q, k, v: (q.float(), k.float(), v.float()), TypeError, "float16, bfloat16 or float8_e4m3fn"),
    (lambda q, k, v: (q[..., :48], k[..., :48], v[..., :48]), ValueError, "supported head dims"),
    (lambda q, k, v: (q[:, :, :3], k, v), ValueError, "must divide"),
    (lambda q, k, v: (torch.cat([q, q], -1)[..., ::2], k, v), ValueError, "contiguous last dimension"),
], ids=["dtype_mismatch", "float32", "headdim48", "heads", "last_dim_stride"])
def test_errors_write_nothing(make, exc, match):
    q, k, v = make(*qkv(2, 8, 8, 4, 2, 64))
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(exc, match=match):
        hipflash.flash_attn_func(q, k, v, out=out, return_lse=True)
    sync()
    assert torch.isnan(out).all()


def test_varlen_errors_on_device():
    """cu_seqlens live on the device: bad ones are still caught before anything runs."""
    q, k, v, cu_q, cu_k = make_varlen([3, 5], [4, 6], 2, 2, 64, torch.bfloat16, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    bad_q = torch.tensor([0, 5, 3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="non-decreasing"):
        hipflash.flash_attn_varlen_func(q, k, v, bad_q, cu_k, 5, 6, out=out)
    with pytest.raises(ValueError, match="max_seqlen_k = 5 is too small"):
        hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, out=out)
    with pytest.raises(ValueError, match="int32"):
        hipflash.flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, 5, 6, out=out)
    sync()
    assert torch.isnan(out).all()


# ---- merge_attn_states (SPEC §7) -------------------------------------------------------------


def _merge_inputs(n, shape, dtype, dense, seed=0):
    """n parts: outs [n, *shape] and lses [n, B, H, S] (dense, shape [B, S, H, D]) or [n, H, T]
    (packed, shape [T, H, D]); LSEs in [-6, 6] with empty (-inf) parts and all-empty rows."""
    g = torch.Generator().manual_seed(seed)
    outs = (torch.rand((n,) + shape, generator=g) * 4 - 2).to(dtype)
    lshape = (n, shape[0], shape[2], shape[1]) if dense else (n, shape[1], shape[0])
    lses = torch.rand(lshape, generator=g) * 12 - 6
    lses[torch.rand(lshape, generator=g) < 0.15] = float("-inf")
    lses[..., 3] = float("-inf")  # one row/column empty in every part
    return outs.to(DEVICE), lses.to(DEVICE)


def _merge_close(out, lse, out_ref, lse_ref):
    """GPU merge vs CPU merge: the same softmax-state math, so NaN/inf at the same places and
    values within a rounding step of the dtype (the device's exp2/log2 and FMAs differ)."""
    tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}[out.dtype]
    out, out_ref = out.cpu().float(), out_ref.float()
    lse = lse.cpu()
    for a, b, t in ((out, out_ref, tol), (lse, lse_ref, 1e-5)):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.equal(a[torch.isinf(a)], b[torch.isinf(b)])
        fin = torch.isfinite(b)
        assert ((a[fin] - b[fin]).abs() <= t * b[fin].abs().clamp(min=1)).all(), \
            (a[fin] - b[fin]).abs().max().item()


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "packed"])
@pytest.mark.parametrize("n", [2, 3, 9])
@pytest.mark.parametrize("dtype,dim", [(torch.bfloat16, 128), (torch.float16, 64),
                                       (torch.float32, 96), (torch.bfloat16, 36)],
                         ids=["bf16_d128", "f16_d64", "f32_d96", "bf16_d36"])
def test_merge_matches_the_cpu_merge(dtype, dim, n, dense):
    shape = (2, 37, 4, dim) if dense else (75, 4, dim)
    outs, lses = _merge_inputs(n, shape, dtype, dense, seed=n)
    if n == 2:
        out, lse = hipflash.merge_attn_states(outs[0], lses[0], outs[1], lses[1])
    else:
        out, lse = hipflash.merge_attn_states(outs, lses)
    assert out.device == outs.device and out.dtype == dtype and out.shape == shape
    out_ref, lse_ref = hipflash.merge_attn_states(outs.cpu(), lses.cpu())
    _merge_close(out, lse, out_ref, lse_ref)
    empty = lse[..., 3] if dense else lse[:, 3]
    assert (empty == float("-inf")).all()


def test_merge_nan_and_empty_parts():
    out_a = torch.full((3, 1, 8), float("nan"))
    out_b = torch.arange(24, dtype=torch.float32).reshape(3, 1, 8)
    lse_a = torch.tensor([[float("-inf"), float("-inf"), float("nan")]])
    lse_b = torch.tensor([[0.5, float("-inf"), 0.0]])
    out, lse = hipflash.merge_attn_states(*(t.to(DEVICE) for t in (out_a, lse_a, out_b, lse_b)))
    out, lse = out.cpu(), lse.cpu()
    assert torch.equal(out[0], out_b[0]) and abs(lse[0, 0].item() - 0.5) <= 1e-6  # a empty
    assert torch.equal(out[1], torch.zeros(1, 8)) and lse[0, 1].item() == float("-inf")
    assert torch.isnan(out[2]).all() and torch.isnan(lse[0, 2])


def test_merge_halves_of_a_forward():
    q, k, v = qkv(2, 37, 300, 4, 2, 64, torch.bfloat16, seed=4)
    oa, la = hipflash.flash_attn_func(q, k[:, :150], v[:, :150], return_lse=True)
    ob, lb = hipflash.flash_attn_func(q, k[:, 150:], v[:, 150:], return_lse=True)
    out, lse = hipflash.merge_attn_states(oa, la, ob, lb)
    check_attention(out, lse, q, k, v)


def test_merge_misaligned_view_and_bad_calls():
    outs, lses = _merge_inputs(2, (33, 2, 64), torch.bfloat16, False, seed=9)
    storage = torch.empty(outs.numel() + 1, dtype=outs.dtype, device=DEVICE)
    view = storage[1:].view(outs.shape)  # 2-byte offset: the scalar path
    view.copy_(outs)
    out, lse = hipflash.merge_attn_states(view, lses)
    out_ref, lse_ref = hipflash.merge_attn_states(outs.cpu(), lses.cpu())
    _merge_close(out, lse, out_ref, lse_ref)
    with pytest.raises(ValueError, match="does not match outs"):
        hipflash.merge_attn_states(outs, lses[:, :, :32])
    with pytest.raises(TypeError, match="lses must have dtype float32"):
        hipflash.merge_attn_states(outs, lses.half())


# ---- KV cache (SPEC §7) ----------------------------------------------------------------------


@pytest.mark.parametrize("append", [0, 1, 5], ids=["attend", "append1", "append5"])
@pytest.mark.parametrize("sq,causal", [(1, False), (1, True), (7, True)], ids=["decode", "decode_causal", "chunk7"])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8), (16, 1)], ids=lambda h: f"h{h[0]}_{h[1]}")
@pytest.mark.parametrize("page", [1, 5, 16, 48, 256, 512])  # any size: gathered rows, or groups
def test_kvcache_paged_equals_contiguous(page, heads, sq, causal, append):
    hq, hkv = heads
    lens = [3 * page + 7, 0, page, 100]
    capacity = ((max(lens) + append + page - 1) // page) * page
    k, v, k_pages, v_pages, table = make_kv_cache(lens, capacity, hkv, 128, torch.bfloat16, page,
                                                  seed=page + hq, device=DEVICE)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, sq, hq, 128, generator=g).bfloat16().to(DEVICE)
    k_new = torch.randn(4, append, hkv, 128, generator=g).bfloat16().to(DEVICE) if append else None
    v_new = torch.randn(4, append, hkv, 128, generator=g).bfloat16().to(DEVICE) if append else None
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kw = dict(causal=causal, return_lse=True)
    out_c, lse_c = hipflash.flash_attn_with_kvcache(q, k, v, k_new, v_new, seqlens, **kw)
    out_p, lse_p = hipflash.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, seqlens,
                                                    block_table=table, **kw)
    sync()
    assert_bitwise_equal(out_p, out_c, "out")
    assert_bitwise_equal(lse_p, lse_c, "lse")
    check_kv_per_sequence(out_c, lse_c, q, k, v, [n + append for n in lens], causal=causal)
    if append:
        for i, n in enumerate(lens):
            assert torch.equal(k[i, n:n + append], k_new[i])
            pos = n + append - 1
            assert torch.equal(v_pages[table[i, pos // page], pos % page], v_new[i, -1])
    if not ON_CPU:
        name = hipflash.last_kernel_name()  # only these kernels read K/V through a row source
        assert name.startswith(("fwd_decode_", "fwd_generic_")), name


@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_kvcache_splits_match(num_splits):
    k, v, k_pages, v_pages, table = make_kv_cache([5000, 17], 5120, 2, 64, torch.float16, 64,
                                                  seed=1, device=DEVICE)
    q = torch.randn(2, 1, 8, 64).half().to(DEVICE)
    seqlens = torch.tensor([5000, 17], dtype=torch.int32, device=DEVICE)
    out, lse = hipflash.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,
                                                block_table=table, num_splits=num_splits,
                                                return_lse=True)
    check_kv_per_sequence(out, lse, q, k, v, [5000, 17])


@pytest.mark.skipif(ON_CPU, reason="the head-group decode kernel: a GPU kernel (the CPU backend "
                    "takes every page size in test_kvcache.py)")
@pytest.mark.parametrize("page", [1, 3, 16])
def test_kvcache_head_group_decode_reads_any_page_size(page):
    # B = 32, GQA 32/8, 4200 keys a sequence, pages of one and three rows (each row gathered
    # through the block table) and of 16 (a 16-row group at once): bitwise the contiguous
    # cache, after appending one row in place, and against the reference. Under
    # HIPFLASH_DECODE_HEADS=1 (scripts/gpu-check runs the KV-cache tests so too) the head-group
    # decode kernel reads them; by default, at these lengths, the decode kernel.
    lens = [4200 - 37 * (i % 5) for i in range(32)]
    capacity = ((max(lens) + 1 + page - 1) // page) * page
    k, v, k_pages, v_pages, table = make_kv_cache(lens, capacity, 8, 128, torch.bfloat16, page,
                                                  seed=page, device=DEVICE)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(32, 1, 32, 128, generator=g).bfloat16().to(DEVICE)
    k_new = torch.randn(32, 1, 8, 128, generator=g).bfloat16().to(DEVICE)
    v_new = torch.randn(32, 1, 8, 128, generator=g).bfloat16().to(DEVICE)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out_c, lse_c = hipflash.flash_attn_with_kvcache(q, k, v, k_new, v_new, seqlens,
                                                    return_lse=True)
    out_p, lse_p = hipflash.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, seqlens,
                                                    block_table=table, return_lse=True)
    name = hipflash.last_kernel_name()
    sync()
    assert_bitwise_equal(out_p, out_c, "out")
    assert_bitwise_equal(lse_p, lse_c, "lse")
    check_kv_per_sequence(out_c[:4], lse_c[:4], q[:4], k[:4], v[:4], [n + 1 for n in lens[:4]])
    for i, n in enumerate(lens):
        assert torch.equal(k_pages[table[i, n // page], n % page], k_new[i, 0])
    if torch.cuda.get_device_capability() == (9, 0) and "sm90" in hipflash.build_info():
        heads = os.environ.get("HIPFLASH_DECODE_HEADS", "")[:1] == "1"
        assert name.startswith("fwd_decode_heads_" if heads else "fwd_decode_"), name
        assert heads or not name.startswith("fwd_decode_heads_"), name


@pytest.mark.parametrize("sq", [1, 5, 33])
@pytest.mark.parametrize("append", [0, 3], ids=["attend", "append3"])
@pytest.mark.parametrize("page", [0, 16, 256], ids=lambda p: f"page{p}" if p else "contiguous")
def test_kvcache_head_major_equals_row_major(page, append, sq):
    """A head-major cache (contiguous [B, Hkv, S, D] or pages [num_blocks, Hkv, page, D], as
    FlashInfer's "HND") passed as a [.., S or page, Hkv, D] view: bitwise the row-major cache's
    out and LSE, and the appended rows land in the head-major storage (GQA 32/8: Sq = 1 runs
    the packed decode kernel, Sq = 5 the decode kernel unpacked, Sq = 33 the generic one)."""
    lens = [3 * 256 + 7, 0, 256, 100]
    pg = page or 256
    capacity = ((max(lens) + append + pg - 1) // pg) * pg
    k, v, k_pages, v_pages, table = make_kv_cache(lens, capacity, 8, 128, torch.bfloat16, pg,
                                                  seed=11 + pg, device=DEVICE)
    if not page:
        k_pages, v_pages, table = k, v, None
    k_hm, v_hm = head_major(k_pages), head_major(v_pages)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(4, sq, 32, 128, generator=g).bfloat16().to(DEVICE)
    k_new = torch.randn(4, append, 8, 128, generator=g).bfloat16().to(DEVICE) if append else None
    v_new = torch.randn(4, append, 8, 128, generator=g).bfloat16().to(DEVICE) if append else None
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kw = dict(causal=True, return_lse=True, block_table=table)
    out, lse = hipflash.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, seqlens, **kw)
    name = hipflash.last_kernel_name()
    out_hm, lse_hm = hipflash.flash_attn_with_kvcache(q, k_hm, v_hm, k_new, v_new, seqlens, **kw)
    name_hm = hipflash.last_kernel_name()
    sync()
    if not ON_CPU:
        assert name == name_hm, (name, name_hm)
        assert name.startswith("fwd_generic_" if sq > 16 else "fwd_decode_"), name
    assert_bitwise_equal(out_hm, out, "out")
    assert_bitwise_equal(lse_hm, lse, "lse")
    for a, b in ((k_hm, k_pages), (v_hm, v_pages)):
        assert_bitwise_equal(a.contiguous(), b, "cache")
    if table is None:
        check_kv_per_sequence(out, lse, q, k, v, [n + append for n in lens], causal=True)


@pytest.mark.parametrize("page", [1, 8, 16, 256])  # 1 and 8: rows gathered
def test_kvcache_full_caches_without_cache_seqlens(page):
    # cache_seqlens=None: every sequence fills its cache, and no lengths are copied back to the
    # host (the serving benchmark's paged calls). Decode shape (GQA 32/8 packed), bitwise the
    # contiguous cache with lengths and the plain forward.
    k, v, k_pages, v_pages, table = make_kv_cache([512, 512], 512, 8, 128, torch.bfloat16, page,
                                                  seed=page, device=DEVICE)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 32, 128, generator=g).bfloat16().to(DEVICE)
    paged = hipflash.flash_attn_with_kvcache(q, k_pages, v_pages, block_table=table,
                                             return_lse=True)
    name = hipflash.last_kernel_name()
    with_lengths = hipflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=512, return_lse=True)
    dense = hipflash.flash_attn_func(q, k, v, return_lse=True)
    sync()
    for what, a, b in (("out", paged[0], dense[0]), ("lse", paged[1], dense[1]),
                       ("out", with_lengths[0], dense[0]), ("lse", with_lengths[1], dense[1])):
        assert_bitwise_equal(a, b, what)
    check_kv_per_sequence(*dense, q, k, v, [512, 512])
    if not ON_CPU:
        assert name.startswith(("fwd_decode_", "fwd_generic_")), name


@pytest.mark.parametrize("lse_layout", ["padded", "packed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lens_q", [[7, 0, 3, 1], [70, 0, 40, 17]], ids=["decode_rows", "chunk70"])
@pytest.mark.parametrize("heads,d", [((8, 2), 128), ((4, 4), 64)], ids=["h8_2_d128", "h4_4_d64"])
@pytest.mark.parametrize("page", [16, 256])
def test_chunked_prefill_equals_packed_keys(page, heads, d, lens_q, causal, lse_layout):
    # flash_attn_varlen_func with a block_table (varlen queries against a paged cache): the
    # reference sequence by sequence, and bitwise the call on the same keys packed contiguously
    # where both run the same kernel (on Hopper a long chunk of packed keys runs an sm90
    # kernel, the paged call the generic one: then the packed call is checked too).
    q, cu_q, cu_k, mq, mk, k_pages, v_pages, table, k_packed, v_packed = make_chunked_prefill(
        page, *heads, d=d, lens_q=lens_q, seed=page + d, device=DEVICE)
    kw = dict(causal=causal, return_lse=True, lse_layout=lse_layout)
    out_p, lse_p = hipflash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, mq, mk,
                                                   block_table=table, **kw)
    name = hipflash.last_kernel_name()
    out_c, lse_c = hipflash.flash_attn_varlen_func(q, k_packed, v_packed, cu_q, cu_k, mq, mk, **kw)
    same_kernel = hipflash.last_kernel_name() == name
    sync()
    if same_kernel:
        assert_bitwise_equal(out_p, out_c, "out")
        assert_bitwise_equal(lse_p, lse_c, "lse")
    for what, out, lse in (("paged", out_p, lse_p), ("packed", out_c, lse_c))[:1 if same_kernel else 2]:
        for b in range(len(cu_q) - 1):
            qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            if qs.stop == qs.start:
                continue
            lse_b = lse[:, qs] if lse_layout == "packed" else lse[b, :, :qs.stop - qs.start]
            check_attention(out[qs][None], lse_b.contiguous()[None], q[qs][None],
                            k_packed[ks][None], v_packed[ks][None], causal=causal,
                            what=f"{what}, sequence {b}")
    if not ON_CPU:  # only these kernels read K/V through a row source
        assert name.startswith(("fwd_decode_", "fwd_generic_")), name
