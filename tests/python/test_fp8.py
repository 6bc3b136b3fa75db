"""fp8 (FlashAttention 3's): float8_e4m3fn q, k, v with fp32 descale factors, per tensor or per
(batch, kv head); the scores are q.k * q_descale * k_descale * softmax_scale, out (bfloat16) is
softmax . v * v_descale, the LSE that of the descaled scores. The CPU backend dequantises (the
reference); GPU calls raise NotImplementedError before anything is written. Needs a PyTorch
with torch.float8_e4m3fn (2.1+)."""
import pytest
import torch

import hipflash
import hipflash.compat.flash_attn_interface as fa3
from reference import assert_bitwise_equal, check_attention, make_qkv

E4M3 = getattr(torch, "float8_e4m3fn", None)
needs_fp8 = pytest.mark.skipif(
    E4M3 is None, reason=f"this PyTorch ({torch.__version__}) has no torch.float8_e4m3fn (2.1+)")
GPU = torch.cuda.is_available() and hipflash.gpu_available()
BF16 = torch.bfloat16


def fp8_case(b, sq, sk, hq, hkv, d, seed=3):
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, torch.float32, seed=seed)
    return tuple((2 * t).to(E4M3) for t in (q, k, v))


def descales(b, hkv, per_head):
    """Powers of two: every scaling is exact, so the fp8 call equals bf16 on dequantised values."""
    shape = (b, hkv) if per_head else (1,)
    n = b * hkv if per_head else 1
    qd = torch.tensor([2.0 ** (i % 3 - 1) for i in range(n)]).reshape(shape)
    kd = torch.tensor([2.0 ** (2 - i % 4) for i in range(n)]).reshape(shape)
    vd = torch.tensor([2.0 ** (i % 2 + 1) for i in range(n)]).reshape(shape)
    return qd, kd, vd


def dequantised(t, d, hq):
    """t (B, S, H, D) as float32 times its descale, per tensor or per (batch, kv head)."""
    x = t.float()
    if d.numel() == 1:
        return x * d.reshape(())
    rep = t.shape[2] // d.shape[1]
    return x * d.repeat_interleave(rep, 1)[:, None, :, None]


@needs_fp8
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_kv_head"])
def test_equals_the_bf16_call_on_dequantised_values(per_head, causal, num_splits):
    b, sq, sk, hq, hkv, d = 2, 29, 113, 4, 2, 64
    q, k, v = fp8_case(b, sq, sk, hq, hkv, d)
    qd, kd, vd = descales(b, hkv, per_head)
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, num_splits=num_splits,
                                        return_lse=True, q_descale=qd, k_descale=kd,
                                        v_descale=vd)
    assert out.dtype == BF16 and lse.dtype == torch.float32
    qb, kb, vb = (dequantised(t, s, hq).to(BF16) for t, s in ((q, qd), (k, kd), (v, vd)))
    want, want_lse = hipflash.flash_attn_func(qb, kb, vb, causal=causal, num_splits=num_splits,
                                              return_lse=True)
    assert_bitwise_equal(out, want, "out")
    assert_bitwise_equal(lse, want_lse, "lse")
    check_attention(out, lse, qb, kb, vb, "fp8", causal=causal)


@needs_fp8
def test_out_buffer_and_fa3_spelling():
    q, k, v = fp8_case(1, 16, 40, 2, 1, 64)
    qd, kd, vd = descales(1, 1, True)
    want = hipflash.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    out = torch.full(want.shape, float("nan"), dtype=BF16)
    assert hipflash.flash_attn_func(q, k, v, out=out, q_descale=qd, k_descale=kd,
                                    v_descale=vd) is out
    assert_bitwise_equal(out, want, "out=")
    assert_bitwise_equal(fa3.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd),
                         want, "fa3")
    # No descales: factors of 1.
    assert_bitwise_equal(hipflash.flash_attn_func(q, k, v),
                         hipflash.flash_attn_func(q, k, v, q_descale=torch.ones(1)), "ones")


def test_descales_on_other_dtypes_are_refused():
    # Runs on any PyTorch: the descales reach the launcher, which refuses them for bfloat16.
    q, k, v = make_qkv(1, 8, 8, 2, 2, 64, BF16)
    out = torch.full_like(q, float("nan"))
    for name in ("q_descale", "k_descale", "v_descale"):
        with pytest.raises(ValueError, match=f"{name} applies to float8_e4m3fn inputs only"):
            hipflash.flash_attn_func(q, k, v, out=out, **{name: torch.ones(1)})
        with pytest.raises(ValueError, match=f"{name} applies to float8_e4m3fn inputs only"):
            fa3.flash_attn_func(q, k, v, **{name: torch.ones(1)})
    assert torch.isnan(out).all()
    with pytest.raises(NotImplementedError, match="q_descale"):
        cu = torch.tensor([0, 8], dtype=torch.int32)
        fa3.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, q_descale=torch.ones(1))


@needs_fp8
@pytest.mark.parametrize("breaks, error, match", [
    (lambda q, k, v, kw: (q, k.to(BF16), v, kw), TypeError, "k must have dtype float8_e4m3fn"),
    (lambda q, k, v, kw: (q, k, v, dict(kw, q_descale=torch.ones(3))), ValueError,
     "q_descale must have shape"),
    (lambda q, k, v, kw: (q, k, v, dict(kw, k_descale=torch.ones(1, dtype=BF16))), TypeError,
     "k_descale must have dtype float32"),
    (lambda q, k, v, kw: (q.float().to(BF16), k.float().to(BF16), v.float().to(BF16), kw),
     ValueError, "q_descale applies to float8_e4m3fn inputs only"),
])
def test_bad_calls_are_refused_and_nothing_is_written(breaks, error, match):
    q, k, v = fp8_case(1, 8, 8, 2, 2, 64)
    q, k, v, kw = breaks(q, k, v, dict(q_descale=torch.ones(1)))
    out = torch.full((1, 8, 2, 64), float("nan"), dtype=BF16)
    with pytest.raises(error, match=match):
        hipflash.flash_attn_func(q, k, v, out=out, **kw)
    assert torch.isnan(out).all()


@needs_fp8
@pytest.mark.skipif(not GPU, reason="needs a GPU visible to torch and a hipflash built with GPU "
                    f"kernels (this build: {hipflash.build_info()!r})")
def test_the_gpu_refuses_it_before_writing():
    q, k, v = (t.cuda() for t in fp8_case(1, 8, 8, 2, 2, 64))
    out = torch.full((1, 8, 2, 64), float("nan"), dtype=BF16, device="cuda")
    with pytest.raises(NotImplementedError, match="float8_e4m3fn inputs and KV caches run on the CPU backend"):
        hipflash.flash_attn_func(q, k, v, out=out, q_descale=torch.ones(1, device="cuda"))
    assert torch.isnan(out).all()


def test_cache_scales_need_an_fp8_cache():
    # Runs on any PyTorch: the scales reach the launcher, which refuses them for a bf16 cache.
    q = torch.randn(1, 1, 2, 64).to(BF16)
    cache = torch.zeros(1, 16, 2, 64, dtype=BF16)
    for name in ("k_scale", "v_scale"):
        with pytest.raises(ValueError, match=f"{name} applies to float8_e4m3fn caches only"):
            hipflash.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=4,
                                             **{name: torch.ones(1)})


@needs_fp8
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_fp8_cache_equals_the_bf16_cache_of_its_dequantised_values(paged):
    # vLLM's kv_cache_dtype="fp8": the cache holds K / k_scale; appended rows are quantised in
    # place (saturating at 448). Power-of-two scales: bitwise the bf16 cache of the same values.
    torch.manual_seed(4)
    b, hq, hkv, d, cap, ks, vs = 2, 8, 2, 64, 64, 0.5, 0.25
    q = torch.randn(b, 2, hq, d).to(BF16)
    k_new, v_new = torch.randn(b, 2, hkv, d).to(BF16), torch.randn(b, 2, hkv, d).to(BF16)
    k_new[0, 0, 0, 0] = 1000.0  # 2000 after the scale: saturates to 448
    k8 = (torch.randn(b, cap, hkv, d) / ks).to(E4M3)
    v8 = (torch.randn(b, cap, hkv, d) / vs).to(E4M3)
    lens = torch.tensor([37, 5], dtype=torch.int32)
    table = None
    if paged:  # pages of 16 rows, in reverse order
        table = torch.arange(b * cap // 16, dtype=torch.int32).flip(0).reshape(b, cap // 16)
        order = table.flatten().argsort()  # (indexing as bytes: few ops take float8)
        k8 = k8.view(torch.uint8).reshape(-1, 16, hkv, d)[order].view(E4M3)
        v8 = v8.view(torch.uint8).reshape(-1, 16, hkv, d)[order].view(E4M3)
    kb, vb = (k8.float() * ks).to(BF16), (v8.float() * vs).to(BF16)

    def deq(x, s):
        return (x.float() / s).clamp(-448, 448).to(E4M3).float().mul(s).to(BF16)

    kw = dict(cache_seqlens=lens, block_table=table, causal=True, return_lse=True)
    out8, lse8 = hipflash.flash_attn_with_kvcache(q, k8, v8, k_new, v_new, **kw,
                                                  k_scale=torch.tensor(ks),
                                                  v_scale=torch.tensor([vs]))
    out, lse = hipflash.flash_attn_with_kvcache(q, kb, vb, deq(k_new, ks), deq(v_new, vs), **kw)
    assert out8.dtype == BF16
    assert_bitwise_equal(out8, out, "out")
    assert_bitwise_equal(lse8, lse, "lse")
    assert_bitwise_equal((k8.float() * ks).to(BF16), kb, "k_cache after the append")
    assert_bitwise_equal((v8.float() * vs).to(BF16), vb, "v_cache after the append")
    first_new = k8[table[0, 2], 37 - 32] if paged else k8[0, 37]
    assert first_new[0, 0].float() == 448.0
