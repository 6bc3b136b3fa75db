"""ALiBi (FlashAttention 2's alibi_slopes; BLOOM, MPT): row i's score of key j gets the bias
-slope[b, h] * |i + Sk - Sq - j| after the softcap, with each sequence's own lengths, and the
LSE includes it. The CPU backend runs it in the forward (dense, varlen, KV cache) and the
backward, checked against the fp64 / fp32 references; the NVIDIA forward kernels add it too
(checked on a GPU against the references), their backward too."""
import pytest
import torch

import hipflash
import hipflash.compat.flash_attn as fa2
from reference import (assert_bitwise_equal, check_attention, check_lse, check_out, make_qkv,
                       make_varlen, varlen_attention_ref)
from test_backward import assert_flash_rule, case_id, grads, torch_attention
from test_kvcache import assert_kvcache_equals_dense_per_sequence
from test_softcap import GPU_CASES

GPU = torch.cuda.is_available() and hipflash.gpu_available()
BF16 = torch.bfloat16

# (B, Sq, Sk, Hq, Hkv, D, causal, window)
CASES = [
    (2, 37, 50, 4, 2, 64, False, (-1, -1)),
    (1, 64, 40, 2, 1, 128, True, (-1, -1)),   # Sq > Sk: first rows see no key
    (1, 50, 70, 2, 2, 32, False, (10, 5)),
]


def bloom_slopes(heads, batch=None):
    """BLOOM's geometric slopes 2^(-8 i / heads), per head, or per (batch, head) scaled by b+1."""
    s = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)])
    if batch is None:
        return s
    return torch.stack([s * (b + 1) for b in range(batch)])


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("per_batch", [False, True], ids=["per_head", "per_batch"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_matches_the_reference(case, num_splits, per_batch, softcap):
    b, sq, sk, hq, hkv, d, causal, window = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, BF16, seed=5)
    slopes = bloom_slopes(hq, b if per_batch else None)
    out, lse = hipflash.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                        num_splits=num_splits, return_lse=True, softcap=softcap,
                                        alibi_slopes=slopes)
    check_attention(out, lse, q, k, v, "alibi", causal=causal, window_size=window,
                    softcap=softcap, alibi_slopes=slopes)


def test_the_bias_changes_the_result_and_zero_slopes_do_not():
    q, k, v = make_qkv(1, 16, 64, 2, 2, 64, BF16, seed=9)
    plain = hipflash.flash_attn_func(q, k, v)
    assert not torch.equal(hipflash.flash_attn_func(q, k, v, alibi_slopes=bloom_slopes(2)), plain)
    assert_bitwise_equal(hipflash.flash_attn_func(q, k, v, alibi_slopes=torch.zeros(2)), plain,
                         "zero slopes")
    # A strided (non-contiguous batch dimension) [B, Hq] view is read where it lies.
    wide = torch.zeros(1, 8)
    wide[:, :2] = bloom_slopes(2)
    assert_bitwise_equal(hipflash.flash_attn_func(q, k, v, alibi_slopes=wide[:, :2]),
                         hipflash.flash_attn_func(q, k, v, alibi_slopes=bloom_slopes(2)), "view")


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if GPU else []))
@pytest.mark.parametrize("num_splits", [1, 2])
def test_non_finite_slopes(device, num_splits):
    # SPEC §3: a NaN slope reaches every row of its head, those that see only their diagonal
    # key (window (0, 0)) included; an infinite one makes rows that see their diagonal key NaN
    # (-slope * 0) and the others rows without a valid key. The other heads are untouched.
    q, k, v = make_qkv(1, 40, 24, 3, 3, 64, BF16, seed=5, device=device)  # rows 0-15: no diagonal
    slopes = torch.tensor([float("nan"), float("inf"), 0.25], device=device)
    for window in ((0, 0), (-1, -1)):
        out, lse = hipflash.flash_attn_func(q, k, v, window_size=window, alibi_slopes=slopes,
                                            num_splits=num_splits, return_lse=True)
        sees_diagonal = torch.arange(40, device=device) >= 16
        assert torch.isnan(lse[0, 0, sees_diagonal]).all() and torch.isnan(out[0, 16:, 0]).all()
        assert torch.isnan(lse[0, 1, sees_diagonal]).all() and torch.isnan(out[0, 16:, 1]).all()
        assert (lse[0, 1, ~sees_diagonal] == float("-inf")).all()
        assert torch.count_nonzero(out[0, :16, 1]) == 0
        assert torch.isfinite(out[0, :, 2]).all() and torch.isfinite(lse[0, 2, sees_diagonal]).all()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_varlen_uses_each_sequences_lengths(layout):
    q, k, v, cu_q, cu_k = make_varlen([5, 0, 33], [9, 4, 40], 4, 2, 64, BF16, seed=4)
    slopes = bloom_slopes(4, 3)
    out, lse = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 40, causal=True,
                                               return_lse=True, lse_layout=layout,
                                               alibi_slopes=slopes)
    kw = dict(causal=True, alibi_slopes=slopes)
    out_ref, lse_packed, lse_padded = varlen_attention_ref(q, k, v, cu_q, cu_k, 33, **kw)
    out_lp, _, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, 33, lowp=True, **kw)
    check_out(out, out_ref, out_lp, f"varlen {layout}")
    check_lse(lse, lse_packed if layout == "packed" else lse_padded, f"varlen {layout}")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_equals_the_dense_call_on_its_keys(paged):
    # Decode against caches of different lengths: the bias is measured from each sequence's
    # own last key.
    slopes = bloom_slopes(4, 2)
    assert_kvcache_equals_dense_per_sequence(paged, {}, dict(alibi_slopes=slopes),
                                             lambda i: dict(alibi_slopes=slopes[i:i + 1]))


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("softcap", [0.0, 20.0])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gradients_match_fp64_autograd(case, softcap, deterministic):
    b, sq, sk, hq, hkv, d, causal, window = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, BF16, seed=7)
    dout = torch.randn(b, sq, hq, d, generator=torch.Generator().manual_seed(8)).to(BF16)
    slopes = bloom_slopes(hq, b) * 4  # strong enough to move the gradients visibly
    kw = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)
    _, g64 = grads(lambda *a: torch_attention(*a, torch.float64, **kw), q, k, v, dout)
    _, glp = grads(lambda *a: torch_attention(*a, BF16, **kw), q, k, v, dout)
    _, ghf = grads(lambda *a: hipflash.flash_attn_func(
        *a, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
        deterministic=deterministic), q, k, v, dout)
    _, gplain = grads(lambda *a: hipflash.flash_attn_func(
        *a, causal=causal, window_size=window, softcap=softcap), q, k, v, dout)
    for name, ours, low, ref, plain in zip("qkv", ghf, glp, g64, gplain):
        assert_flash_rule(name, ours, low, ref)
        assert not torch.equal(ours, plain), f"d{name}: the bias changed nothing"


def test_slopes_that_require_grad_get_none():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 8, 8, 2, 2, 64, BF16, seed=1))
    slopes = bloom_slopes(2).requires_grad_()
    hipflash.flash_attn_func(q, k, v, alibi_slopes=slopes).float().sum().backward()
    assert q.grad is not None and slopes.grad is None


@pytest.mark.parametrize("slopes, error, match", [
    (torch.ones(2, dtype=torch.float64), TypeError, "alibi_slopes must have dtype float32"),
    (torch.ones(2, dtype=BF16), TypeError, "alibi_slopes must have dtype float32"),
    (torch.ones(3), ValueError, "alibi_slopes must have shape"),
    (torch.ones(2, 2), ValueError, "alibi_slopes must have shape"),
    (torch.ones(1, 2, 1), ValueError, "alibi_slopes must have shape"),
    ([0.5, 0.25], TypeError, "alibi_slopes must be a torch.Tensor"),
])
def test_bad_slopes_are_refused_and_nothing_is_written(slopes, error, match):
    q, k, v = make_qkv(1, 4, 4, 2, 2, 64, BF16)
    out = torch.full_like(q, float("nan"))
    with pytest.raises(error, match=match):
        hipflash.flash_attn_func(q, k, v, out=out, alibi_slopes=slopes)
    assert torch.isnan(out).all()


def test_fa2_passes_them_through():
    q, k, v = make_qkv(1, 8, 8, 2, 2, 64, BF16, seed=6)
    slopes = bloom_slopes(2)
    want = hipflash.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    assert_bitwise_equal(fa2.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes), want,
                         "fa2")


needs_gpu = pytest.mark.skipif(
    not GPU, reason="needs a GPU visible to torch and a hipflash built with GPU kernels "
    f"(this build: {hipflash.build_info()!r})")


@needs_gpu
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("per_batch", [False, True], ids=["per_head", "per_batch"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: case_id(c[:8]) + f"_s{c[8]}")
def test_gpu_forward_matches_the_reference(case, per_batch, softcap):
    # Every NVIDIA forward kernel (test_softcap's GPU cases: sm90_ws, sm90, generic, decode);
    # the one-row GQA case packed (a slope a row).
    b, sq, sk, hq, hkv, d, causal, window, splits = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, BF16, seed=13)
    slopes = bloom_slopes(hq, b if per_batch else None)
    out, lse = hipflash.flash_attn_func(q.cuda(), k.cuda(), v.cuda(), causal=causal,
                                        window_size=window, num_splits=splits, return_lse=True,
                                        softcap=softcap, alibi_slopes=slopes.cuda())
    check_attention(out.cpu(), lse.cpu(), q, k, v, f"gpu alibi softcap {softcap}", causal=causal,
                    window_size=window, softcap=softcap, alibi_slopes=slopes)


@needs_gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_long_rows_with_steep_slopes_match_the_reference(causal):
    # Many key blocks wholly left and right of the diagonal (the Hopper kernel splits the bias
    # there into a column part and a row offset the softmax takes), far keys thousands of
    # positions away, slopes up to 0.25 (BLOOM's with 4 heads) and Sk > Sq (the diagonal moved).
    q, k, v = make_qkv(1, 1100, 1800, 4, 2, 128, BF16, seed=19)
    slopes = bloom_slopes(4)
    out, lse = hipflash.flash_attn_func(q.cuda(), k.cuda(), v.cuda(), causal=causal,
                                        return_lse=True, alibi_slopes=slopes.cuda())
    check_attention(out.cpu(), lse.cpu(), q, k, v, "gpu alibi long rows", causal=causal,
                    alibi_slopes=slopes)


@needs_gpu
@pytest.mark.parametrize("hq,hkv", [(8, 2), (32, 8), (32, 1)])
def test_gpu_gqa_decode_has_a_slope_per_query_head(hq, hkv):
    # One query row: the query heads of a kv head packed into a decode block's rows, a slope a
    # row (the head-group kernel's too, under HIPFLASH_DECODE_HEADS=1); 32 heads a kv head are
    # more rows than a decode block holds and run unpacked.
    q, k, v = make_qkv(2, 1, 700, hq, hkv, 128, BF16, seed=17)
    slopes = bloom_slopes(hq, 2)
    out, lse = hipflash.flash_attn_func(q.cuda(), k.cuda(), v.cuda(), return_lse=True,
                                        alibi_slopes=slopes.cuda())
    check_attention(out.cpu(), lse.cpu(), q, k, v, f"gpu alibi decode {hq}/{hkv}",
                    alibi_slopes=slopes)


@needs_gpu
def test_gpu_varlen_and_kvcache_match_the_cpu():
    q, k, v, cu_q, cu_k = make_varlen([5, 0, 300], [9, 4, 400], 4, 2, 128, BF16, seed=4)
    slopes = bloom_slopes(4, 3)
    kw = dict(causal=True, alibi_slopes=slopes)
    out, lse = hipflash.flash_attn_varlen_func(*(t.cuda() for t in (q, k, v, cu_q, cu_k)), 300,
                                               400, causal=True, return_lse=True,
                                               lse_layout="packed", alibi_slopes=slopes.cuda())
    out_ref, lse_packed, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, 300, **kw)
    out_lp, _, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, 300, lowp=True, **kw)
    check_out(out.cpu(), out_ref, out_lp, "gpu varlen")
    check_lse(lse.cpu(), lse_packed, "gpu varlen")
    # GQA decode against a paged cache with an append, and a chunk of 3 rows against a
    # contiguous one: the CPU backend's result within tolerance, the appends equal.
    torch.manual_seed(2)
    for sq, table in ((1, torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)), (3, None)):
        qd = torch.randn(2, sq, 8, 128).to(BF16)
        shape = (4, 256, 2, 128) if table is not None else (2, 512, 2, 128)
        k_cache, v_cache = torch.randn(shape).to(BF16), torch.randn(shape).to(BF16)
        k_new, v_new = torch.randn(2, sq, 2, 128).to(BF16), torch.randn(2, sq, 2, 128).to(BF16)
        args = dict(cache_seqlens=torch.tensor([300, 17], dtype=torch.int32), block_table=table,
                    return_lse=True, causal=True, alibi_slopes=bloom_slopes(8, 2))
        kc, vc = k_cache.clone(), v_cache.clone()
        want, want_lse = hipflash.flash_attn_with_kvcache(qd, kc, vc, k_new, v_new, **args)
        kg, vg = k_cache.cuda(), v_cache.cuda()
        got, got_lse = hipflash.flash_attn_with_kvcache(
            qd.cuda(), kg, vg, k_new.cuda(), v_new.cuda(),
            **{n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in args.items()})
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got_lse.cpu(), want_lse, atol=2e-3, rtol=2e-3)
        assert torch.equal(kg.cpu(), kc) and torch.equal(vg.cpu(), vc), f"sq {sq}: appends"


@needs_gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("softcap", [0.0, 20.0])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gpu_gradients_match_fp64_autograd(case, softcap, deterministic):
    """The GPU backward (the portable kernels, which recompute the biased scores) within
    FlashAttention's rule of fp64 autograd, and not the gradients without the bias."""
    b, sq, sk, hq, hkv, d, causal, window = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, BF16, seed=7)
    dout = torch.randn(b, sq, hq, d, generator=torch.Generator().manual_seed(8)).to(BF16)
    slopes = bloom_slopes(hq, b) * 4
    kw = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)
    _, g64 = grads(lambda *a: torch_attention(*a, torch.float64, **kw), q, k, v, dout)
    _, glp = grads(lambda *a: torch_attention(*a, BF16, **kw), q, k, v, dout)

    def on_gpu(alibi):
        _, g = grads(lambda *a: hipflash.flash_attn_func(
            *a, causal=causal, window_size=window, softcap=softcap,
            alibi_slopes=slopes.cuda() if alibi else None, deterministic=deterministic),
            q, k, v, dout, device="cuda")
        return [t.cpu() for t in g]
    ghf, gplain = on_gpu(True), on_gpu(False)
    for name, ours, low, ref, plain in zip("qkv", ghf, glp, g64, gplain):
        assert_flash_rule(name, ours, low, ref)
        assert not torch.equal(ours, plain), f"d{name}: the bias changed nothing"
