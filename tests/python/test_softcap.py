"""Logit soft-capping (FlashAttention 2's softcap, Gemma 2's attn_logit_softcapping): each
scaled score s becomes softcap * tanh(s / softcap) before the softmax, and the LSE is that of the
capped scores. The CPU backend runs it in the forward (dense, varlen, KV cache) and the
backward, the NVIDIA GPU kernels in the forward, checked here against the fp64 / fp32
references, the GPU backward too."""
import math

import pytest
import torch

import hipflash
import hipflash.compat.flash_attn as fa2
import hipflash.compat.flash_attn_interface as fa3
from reference import (assert_bitwise_equal, check_attention, check_lse, check_out, make_qkv,
                       make_varlen, varlen_attention_ref)
from test_backward import assert_flash_rule, case_id, grads, torch_attention
from test_kvcache import assert_kvcache_equals_dense_per_sequence

GPU = torch.cuda.is_available() and hipflash.gpu_available()
BF16 = torch.bfloat16

# (B, Sq, Sk, Hq, Hkv, D, causal, window); a softmax_scale of 1 gives |scores| of several units,
# where tanh is far from linear for the caps below.
CASES = [
    (2, 37, 50, 4, 2, 64, False, (-1, -1)),
    (1, 64, 64, 2, 1, 128, True, (-1, -1)),
    (1, 50, 70, 2, 2, 32, False, (10, 5)),
]


@pytest.mark.parametrize("softcap", [1.0, 5.0, 50.0])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_matches_the_reference(case, num_splits, softcap):
    b, sq, sk, hq, hkv, d, causal, window = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, BF16, seed=5)
    out, lse = hipflash.flash_attn_func(q, k, v, softmax_scale=1.0, causal=causal,
                                        window_size=window, num_splits=num_splits,
                                        return_lse=True, softcap=softcap)
    check_attention(out, lse, q, k, v, f"softcap {softcap}", softmax_scale=1.0, causal=causal,
                    window_size=window, softcap=softcap)


def test_the_cap_bends_the_scores():
    # Not a no-op the reference would share: a small cap changes out and bounds the LSE by
    # log(Sk) + cap.
    q, k, v = make_qkv(1, 16, 64, 2, 2, 64, BF16, seed=9)
    out, lse = hipflash.flash_attn_func(q, k, v, softmax_scale=1.0, return_lse=True)
    out_c, lse_c = hipflash.flash_attn_func(q, k, v, softmax_scale=1.0, return_lse=True,
                                            softcap=1.0)
    assert not torch.equal(out, out_c)
    assert (lse_c <= math.log(64) + 1.0 + 1e-4).all() and (lse > math.log(64) + 1.0).any()
    # softcap=0 (and None through the compatibility modules) is off: bitwise the plain call.
    assert_bitwise_equal(hipflash.flash_attn_func(q, k, v, softcap=0.0),
                         hipflash.flash_attn_func(q, k, v), "softcap=0")


def test_varlen_matches_the_reference():
    q, k, v, cu_q, cu_k = make_varlen([5, 0, 33], [9, 4, 40], 4, 2, 64, BF16, seed=4)
    for layout in ("padded", "packed"):
        out, lse = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 40,
                                                   softmax_scale=1.0, causal=True,
                                                   return_lse=True, lse_layout=layout,
                                                   softcap=3.0)
        kw = dict(softmax_scale=1.0, causal=True, softcap=3.0)
        out_ref, lse_packed, lse_padded = varlen_attention_ref(q, k, v, cu_q, cu_k, 33, **kw)
        out_lp, _, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, 33, lowp=True, **kw)
        check_out(out, out_ref, out_lp, f"varlen {layout}")
        check_lse(lse, lse_packed if layout == "packed" else lse_padded, f"varlen {layout}")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_equals_the_dense_call_on_its_keys(paged):
    assert_kvcache_equals_dense_per_sequence(paged, dict(softmax_scale=1.0, softcap=2.0))


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("softcap", [2.0, 30.0])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gradients_match_fp64_autograd(case, softcap, deterministic):
    b, sq, sk, hq, hkv, d, causal, window = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, BF16, seed=7)
    dout = torch.randn(b, sq, hq, d, generator=torch.Generator().manual_seed(8)).to(BF16)
    kw = dict(causal=causal, window=window, scale=1.0, softcap=softcap)
    _, g64 = grads(lambda *a: torch_attention(*a, torch.float64, **kw), q, k, v, dout)
    _, glp = grads(lambda *a: torch_attention(*a, BF16, **kw), q, k, v, dout)
    _, ghf = grads(lambda *a: hipflash.flash_attn_func(
        *a, softmax_scale=1.0, causal=causal, window_size=window, softcap=softcap,
        deterministic=deterministic), q, k, v, dout)
    _, gplain = grads(lambda *a: hipflash.flash_attn_func(
        *a, softmax_scale=1.0, causal=causal, window_size=window), q, k, v, dout)
    for name, ours, low, ref, plain in zip("qkv", ghf, glp, g64, gplain):
        assert_flash_rule(name, ours, low, ref)
        assert not torch.equal(ours, plain), f"d{name}: the cap changed nothing"


def test_varlen_gradients_match_the_dense_per_sequence():
    q, k, v, cu_q, cu_k = make_varlen([6, 20], [9, 20], 2, 2, 64, BF16, seed=3)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(BF16)
    _, g = grads(lambda *a: hipflash.flash_attn_varlen_func(
        *a, cu_q, cu_k, 20, 20, softmax_scale=1.0, causal=True, softcap=4.0), q, k, v, dout)
    for i in range(2):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        _, gd = grads(lambda *a: hipflash.flash_attn_func(
            *a, softmax_scale=1.0, causal=True, softcap=4.0), q[None, q0:q1], k[None, k0:k1],
            v[None, k0:k1], dout[None, q0:q1])
        assert_bitwise_equal(g[0][q0:q1], gd[0][0], f"dq of sequence {i}")
        assert_bitwise_equal(g[1][k0:k1], gd[1][0], f"dk of sequence {i}")
        assert_bitwise_equal(g[2][k0:k1], gd[2][0], f"dv of sequence {i}")


@pytest.mark.parametrize("softcap, error", [(-1.0, ValueError), (float("nan"), ValueError),
                                            (float("inf"), ValueError), (1e300, ValueError),
                                            ("2", TypeError), (True, TypeError)])
def test_bad_softcap_is_refused_and_nothing_is_written(softcap, error):
    q, k, v = make_qkv(1, 4, 4, 2, 2, 64, BF16)
    out = torch.full_like(q, float("nan"))
    with pytest.raises(error, match="softcap"):
        hipflash.flash_attn_func(q, k, v, out=out, softcap=softcap)
    assert torch.isnan(out).all()


def test_the_compatibility_modules_pass_it_through():
    q, k, v = make_qkv(1, 8, 8, 2, 2, 64, BF16, seed=6)
    want = hipflash.flash_attn_func(q, k, v, causal=True, softcap=5.0)
    assert_bitwise_equal(fa2.flash_attn_func(q, k, v, causal=True, softcap=5.0), want, "fa2")
    assert_bitwise_equal(fa3.flash_attn_func(q, k, v, causal=True, softcap=5.0), want, "fa3")
    with pytest.raises(NotImplementedError, match="softcap"):
        fa2.flash_attn_func(q, k, v, softcap=torch.tensor(5.0))


needs_gpu = pytest.mark.skipif(
    not GPU, reason="needs a GPU visible to torch and a hipflash built with GPU kernels "
    f"(this build: {hipflash.build_info()!r})")

# The GPU forward's kernels: (B, Sq, Sk, Hq, Hkv, D, causal, window, num_splits) — the sm90_ws
# and sm90 tiles (long rows, hd 64 / 128 / 256), the generic kernel (hd 96, split), the decode
# kernels (one query row, GQA packed or not).
GPU_CASES = [
    (2, 300, 300, 4, 4, 64, False, (-1, -1), 1),
    (1, 700, 900, 4, 2, 128, True, (-1, -1), 1),
    (1, 257, 513, 2, 2, 256, False, (64, 32), 1),
    (2, 100, 333, 4, 2, 96, True, (-1, -1), 3),
    (4, 1, 1000, 8, 2, 128, False, (-1, -1), 0),
    (2, 1, 700, 4, 4, 64, True, (-1, -1), 2),
]


@needs_gpu
@pytest.mark.parametrize("softcap", [2.0, 50.0])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: case_id(c[:8]) + f"_s{c[8]}")
def test_gpu_forward_matches_the_reference(case, softcap):
    b, sq, sk, hq, hkv, d, causal, window, splits = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, BF16, seed=11)
    out, lse = hipflash.flash_attn_func(q.cuda(), k.cuda(), v.cuda(), softmax_scale=0.5,
                                        causal=causal, window_size=window, num_splits=splits,
                                        return_lse=True, softcap=softcap)
    check_attention(out.cpu(), lse.cpu(), q, k, v, f"gpu softcap {softcap}", softmax_scale=0.5,
                    causal=causal, window_size=window, softcap=softcap)


@needs_gpu
def test_gpu_varlen_and_kvcache_match_the_cpu():
    q, k, v, cu_q, cu_k = make_varlen([5, 0, 300], [9, 4, 400], 4, 2, 128, BF16, seed=4)
    kw = dict(softmax_scale=1.0, causal=True, return_lse=True, lse_layout="packed", softcap=3.0)
    out, lse = hipflash.flash_attn_varlen_func(*(t.cuda() for t in (q, k, v, cu_q, cu_k)), 300,
                                               400, **kw)
    out_ref, lse_packed, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, 300, softmax_scale=1.0,
                                                  causal=True, softcap=3.0)
    out_lp, _, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, 300, lowp=True, softmax_scale=1.0,
                                        causal=True, softcap=3.0)
    check_out(out.cpu(), out_ref, out_lp, "gpu varlen")
    check_lse(lse.cpu(), lse_packed, "gpu varlen")
    # decode against a paged cache, with an append: the CPU backend's result within tolerance
    torch.manual_seed(2)
    qd = torch.randn(2, 1, 8, 128).to(BF16)
    k_cache = torch.randn(4, 256, 2, 128).to(BF16)
    v_cache = torch.randn(4, 256, 2, 128).to(BF16)
    k_new, v_new = torch.randn(2, 1, 2, 128).to(BF16), torch.randn(2, 1, 2, 128).to(BF16)
    table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    lens = torch.tensor([300, 17], dtype=torch.int32)
    args = dict(cache_seqlens=lens, block_table=table, return_lse=True, softcap=20.0)
    kc, vc = k_cache.clone(), v_cache.clone()
    want, want_lse = hipflash.flash_attn_with_kvcache(qd, kc, vc, k_new, v_new, **args)
    got, got_lse = hipflash.flash_attn_with_kvcache(
        qd.cuda(), k_cache.cuda(), v_cache.cuda(), k_new.cuda(), v_new.cuda(),
        **{n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in args.items()})
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_lse.cpu(), want_lse, atol=2e-3, rtol=2e-3)


@needs_gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gpu_gradients_match_fp64_autograd(case, deterministic):
    """The GPU backward (the portable kernels, which recompute the capped scores) within
    FlashAttention's rule of fp64 autograd, and not the plain gradients."""
    b, sq, sk, hq, hkv, d, causal, window = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, BF16, seed=7)
    dout = torch.randn(b, sq, hq, d, generator=torch.Generator().manual_seed(8)).to(BF16)
    kw = dict(causal=causal, window=window, scale=1.0, softcap=4.0)
    _, g64 = grads(lambda *a: torch_attention(*a, torch.float64, **kw), q, k, v, dout)
    _, glp = grads(lambda *a: torch_attention(*a, BF16, **kw), q, k, v, dout)

    def on_gpu(softcap):
        _, g = grads(lambda *a: hipflash.flash_attn_func(
            *a, softmax_scale=1.0, causal=causal, window_size=window, softcap=softcap,
            deterministic=deterministic), q, k, v, dout, device="cuda")
        return [t.cpu() for t in g]
    ghf, gplain = on_gpu(4.0), on_gpu(0.0)
    for name, ours, low, ref, plain in zip("qkv", ghf, glp, g64, gplain):
        assert_flash_rule(name, ours, low, ref)
        assert not torch.equal(ours, plain), f"d{name}: the cap changed nothing"
