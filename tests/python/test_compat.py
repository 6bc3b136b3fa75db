"""hipflash.compat: FlashAttention 2's and 3's Python APIs run by hipflash — the same results as
hipflash's own functions (bitwise), FlashAttention's return conventions and layouts, gradients
through packed inputs, and a NotImplementedError naming every argument hipflash cannot honour."""
import pytest
import torch

import hipflash
import hipflash.compat.flash_attn as fa2
import hipflash.compat.flash_attn_interface as fa3
from reference import assert_bitwise_equal, make_qkv

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and hipflash.gpu_available() else [])
BF16 = torch.bfloat16


def qkv(device, b=2, s=40, hq=4, hkv=2, d=64, seed=0):
    return (t.to(device) for t in make_qkv(b, s, s, hq, hkv, d, BF16, seed=seed))


@pytest.mark.parametrize("device", DEVICES)
def test_fa2_flash_attn_func(device):
    q, k, v = qkv(device)
    want, lse = hipflash.flash_attn_func(q, k, v, causal=True, window_size=(8, 0),
                                         return_lse=True)
    assert_bitwise_equal(fa2.flash_attn_func(q, k, v, 0.0, None, True, (8, 0)), want, "out")
    out, got_lse, probs = fa2.flash_attn_func(q, k, v, causal=True, window_size=(8, 0),
                                              return_attn_probs=True)
    assert_bitwise_equal(out, want, "out")
    assert_bitwise_equal(got_lse, lse, "lse")
    assert probs is None


@pytest.mark.parametrize("device", DEVICES)
def test_fa2_packed_inputs_and_their_gradients(device):
    q, k, v = qkv(device, hq=2, hkv=2)
    qkv_packed = torch.stack([q, k, v], dim=2).requires_grad_()
    out = fa2.flash_attn_qkvpacked_func(qkv_packed, causal=True)
    assert_bitwise_equal(out.detach(), hipflash.flash_attn_func(q, k, v, causal=True), "qkvpacked")
    out.sum().backward()
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    hipflash.flash_attn_func(qq, kk, vv, causal=True).sum().backward()
    assert_bitwise_equal(qkv_packed.grad, torch.stack([qq.grad, kk.grad, vv.grad], dim=2), "grad")

    kv = torch.stack([k, v], dim=2)
    assert_bitwise_equal(fa2.flash_attn_kvpacked_func(q, kv), hipflash.flash_attn_func(q, k, v),
                         "kvpacked")


@pytest.mark.parametrize("device", DEVICES)
def test_fa2_varlen_returns_the_packed_lse(device):
    q, k, v = (t[0] for t in qkv(device, b=1, s=60))
    cu = torch.tensor([0, 25, 25, 60], dtype=torch.int32, device=device)
    out, lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu, cu, 35, 35, causal=True,
                                             return_attn_probs=True)
    want, want_lse = hipflash.flash_attn_varlen_func(q, k, v, cu, cu, 35, 35, causal=True,
                                                     return_lse=True, lse_layout="packed")
    assert lse.shape == (q.shape[1], q.shape[0])
    assert_bitwise_equal(out, want, "out")
    assert_bitwise_equal(lse, want_lse, "lse")
    qkv_packed = torch.stack([q, k[:, :2].repeat(1, 2, 1), v[:, :2].repeat(1, 2, 1)], dim=1)
    assert fa2.flash_attn_varlen_qkvpacked_func(qkv_packed, cu, 35).shape == q.shape


@pytest.mark.parametrize("device", DEVICES)
def test_fa2_kvcache(device):
    q, k, v = qkv(device, s=1)
    kc, vc = (torch.zeros(2, 64, 2, 64, dtype=BF16, device=device) for _ in range(2))
    kc2, vc2 = kc.clone(), vc.clone()
    lens = torch.tensor([5, 9], dtype=torch.int32, device=device)
    out, lse = fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True,
                                           return_softmax_lse=True)
    want, want_lse = hipflash.flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=lens,
                                                      causal=True, return_lse=True)
    assert_bitwise_equal(out, want, "out")
    assert_bitwise_equal(lse, want_lse, "lse")
    assert_bitwise_equal(kc, kc2, "appended cache")


@pytest.mark.parametrize("call, arg", [
    ("func", dict(dropout_p=0.1)),
    ("func", dict(dropout_p=0.5)),
])
def test_fa2_refuses_what_hipflash_lacks_by_name(call, arg):
    q, k, v = qkv("cpu", s=4)
    name = next(iter(arg))
    with pytest.raises(NotImplementedError, match=name):
        if call == "func":
            fa2.flash_attn_func(q, k, v, **arg)
        else:
            fa2.flash_attn_with_kvcache(q, k, v, **arg)


@pytest.mark.parametrize("device", DEVICES)
def test_fa3_flash_attn_func(device):
    q, k, v = qkv(device)
    want, lse = hipflash.flash_attn_func(q, k, v, causal=True, num_splits=1, return_lse=True)
    assert_bitwise_equal(fa3.flash_attn_func(q, k, v, causal=True), want, "out")
    out, got_lse = fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                       pack_gqa=True, sm_margin=4)
    assert_bitwise_equal(out, want, "out")
    assert_bitwise_equal(got_lse, lse, "lse")
    # num_splits <= 0: hipflash's heuristic (bitwise its own num_splits=0 call)
    assert_bitwise_equal(fa3.flash_attn_func(q, k, v, num_splits=0),
                         hipflash.flash_attn_func(q, k, v, num_splits=0), "heuristic splits")


@pytest.mark.parametrize("device", DEVICES)
def test_fa3_qkvpacked_with_gqa_heads(device):
    q, k, v = qkv(device, hq=4, hkv=2)
    packed = torch.cat([q, k, v], dim=2)
    assert_bitwise_equal(fa3.flash_attn_qkvpacked_func(packed, num_heads_q=4),
                         hipflash.flash_attn_func(q, k, v, num_splits=1), "4-d qkv")
    with pytest.raises(ValueError, match="num_heads_q"):
        fa3.flash_attn_qkvpacked_func(packed)


@pytest.mark.parametrize("device", DEVICES)
def test_fa3_varlen_and_chunked_prefill(device):
    q, k, v = (t[0] for t in qkv(device, b=1, s=48))
    cu = torch.tensor([0, 20, 48], dtype=torch.int32, device=device)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu, cu, 28, 28, causal=True,
                                          return_attn_probs=True)
    want, want_lse = hipflash.flash_attn_varlen_func(q, k, v, cu, cu, 28, 28, causal=True,
                                                     num_splits=1, return_lse=True,
                                                     lse_layout="packed")
    assert_bitwise_equal(out, want, "out")
    assert_bitwise_equal(lse, want_lse, "lse")
    # varlen queries against a paged cache (page_table), as hipflash's chunked prefill
    page = 16
    kc = torch.randn(8, page, 2, 64).to(BF16).to(device)
    vc = torch.randn(8, page, 2, 64).to(BF16).to(device)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32, device=device)
    seqlens = torch.tensor([30, 50], dtype=torch.int32, device=device)
    got = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table,
                                      cu_seqlens_q=cu, max_seqlen_q=28, causal=True)
    cu_k = torch.tensor([0, 30, 80], dtype=torch.int32, device=device)
    assert_bitwise_equal(got, hipflash.flash_attn_varlen_func(
        q, kc, vc, cu, cu_k, 28, 64, causal=True, block_table=table), "chunked prefill")
    # cache_batch_idx picks page_table rows (FlashAttention 3's rule), here in reverse
    wide = torch.cat([table.flip(0), table.flip(0)])
    got = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=wide,
                                      cache_batch_idx=torch.tensor([3, 2], dtype=torch.int32,
                                                                   device=device),
                                      cu_seqlens_q=cu, max_seqlen_q=28, causal=True)
    assert_bitwise_equal(got, hipflash.flash_attn_varlen_func(
        q, kc, vc, cu, cu_k, 28, 64, causal=True, block_table=table), "cache_batch_idx")


@pytest.mark.parametrize("device", DEVICES)
def test_fa3_combine_layouts_and_out_dtype(device):
    torch.manual_seed(0)
    n, b, s, h, d = 3, 2, 5, 4, 64
    out_p = torch.randn(n, b, h, s, d, device=device).transpose(2, 3)  # FA3's, non-contiguous
    lse_p = torch.randn(n, b, h, s, device=device).transpose(-1, -2)
    lse_p[1:, 0] = -float("inf")
    out, lse = fa3.flash_attn_combine(out_p, lse_p, out_dtype=BF16)
    lse_ref = torch.logsumexp(lse_p, dim=0)
    w = torch.exp(lse_p - lse_ref)  # (n, b, s, h)
    out_ref = (w[..., None] * out_p).sum(0)
    assert out.dtype == BF16 and out.shape == (b, s, h, d) and lse.shape == (b, s, h)
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.float(), out_ref, atol=1e-2, rtol=1e-2)
    assert fa3.flash_attn_combine(out_p, lse_p, return_lse=False).dtype == torch.float32


@pytest.mark.parametrize("arg", [dict(qv=torch.ones(1)), dict(attention_chunk=64)])
def test_fa3_refuses_what_hipflash_lacks_by_name(arg):
    q, k, v = qkv("cpu", s=4)
    with pytest.raises(NotImplementedError, match=next(iter(arg))):
        fa3.flash_attn_func(q, k, v, **arg)
    with pytest.raises(NotImplementedError, match=next(iter(arg))):
        cu = torch.tensor([0, 4], dtype=torch.int32)
        fa3.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4, 4, **arg)


def test_softcap_none_is_off_and_a_tensor_is_refused():
    q, k, v = qkv("cpu", s=4)
    assert torch.equal(fa2.flash_attn_func(q, k, v, softcap=None), hipflash.flash_attn_func(q, k, v))
    with pytest.raises(NotImplementedError, match="softcap"):
        fa3.flash_attn_func(q, k, v, softcap=torch.tensor(0.0))
