"""hipflash.compat: FlashAttention 2's and 3's Python APIs run by hipflash — the same results as
hipflash's own functions (bitwise), FlashAttention's return conventions and layouts, gradients
through packed inputs, and a NotImplementedError naming every argument hipflash cannot honour."""
import pytest
import torch

import hipflash
import hipflash.compat.flash_attn as fa2
import hipflash.compat.flash_attn_interface as fa3
from reference import assert_bitwise_equal, attention_ref, check_out, make_qkv

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
    assert probs.numel() == 0 and probs.dtype == q.dtype  # FA2's S_dmask without dropout


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


@pytest.mark.parametrize("arg", [dict(qv=torch.ones(1)), dict(headdim_v=128)])
def test_fa3_refuses_what_hipflash_lacks_by_name(arg):
    q, k, v = qkv("cpu", s=4)
    if "headdim_v" in arg:  # FA3 takes v of another head dim (MLA); hipflash not yet
        v, arg = torch.zeros(*v.shape[:-1], 128, dtype=v.dtype), {}
    match = next(iter(arg)) if arg else "head dim"
    with pytest.raises(NotImplementedError, match=match):
        fa3.flash_attn_func(q, k, v, **arg)
    with pytest.raises(NotImplementedError, match=match):
        cu = torch.tensor([0, 4], dtype=torch.int32)
        fa3.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4, 4, **arg)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [40, 80, 192])
@pytest.mark.parametrize("api", ["fa2", "fa3"])
def test_head_dims_hipflash_lacks_run_zero_padded(device, d, api):
    # FlashAttention runs every head dim up to 256; the compatibility modules run those without
    # a kernel on q, k, v zero-padded to the next head dim: out and LSE those of the padded call
    # (out cut to d columns), the default scale d^-0.5, gradients through the padding.
    mod = fa2 if api == "fa2" else fa3
    q, k, v = (t.requires_grad_() for t in qkv(device, s=24, d=d))
    out, lse = mod.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]
    pad = next(h for h in (32, 64, 96, 128, 256) if h >= d) - d
    qp, kp, vp = (torch.nn.functional.pad(t.detach(), (0, pad)).requires_grad_()
                  for t in (q, k, v))
    want, want_lse = hipflash.flash_attn_func(qp, kp, vp, softmax_scale=d ** -0.5, causal=True,
                                              return_lse=True)
    assert out.shape == q.shape
    assert_bitwise_equal(out, want[..., :d], "out")
    assert_bitwise_equal(lse, want_lse, "lse")
    ref, ref_lse = attention_ref(q.detach(), k.detach(), v.detach(), causal=True)
    lp, _ = attention_ref(q.detach(), k.detach(), v.detach(), causal=True, lowp=True)
    check_out(out.detach(), ref, lp, f"head dim {d}")
    grad = torch.randn_like(out)
    out.backward(grad)
    want[..., :d].backward(grad)
    for name, got, padded in (("dq", q.grad, qp.grad), ("dk", k.grad, kp.grad),
                              ("dv", v.grad, vp.grad)):
        assert_bitwise_equal(got, padded[..., :d], name)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32, device=device)
    out_v = mod.flash_attn_varlen_func(q[0].detach(), k[0].detach(), v[0].detach(), cu, cu, 14,
                                       14, causal=True)
    want_v = hipflash.flash_attn_varlen_func(qp[0].detach(), kp[0].detach(), vp[0].detach(), cu,
                                             cu, 14, 14, softmax_scale=d ** -0.5, causal=True)
    assert_bitwise_equal(out_v, want_v[..., :d], "varlen out")


@pytest.mark.parametrize("api", ["fa2", "fa3"])
def test_head_dims_hipflash_lacks_are_refused_against_a_cache(api):
    # A KV cache is appended to and read in place: padding would copy it every call.
    mod = fa2 if api == "fa2" else fa3
    q = torch.zeros(1, 1, 2, 80, dtype=BF16)
    cache = torch.zeros(1, 8, 2, 80, dtype=BF16)
    with pytest.raises(NotImplementedError, match="head dim 80 .*KV cache"):
        mod.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=4)
    if api == "fa2":
        table = torch.zeros(1, 1, dtype=torch.int32)
        cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32) for n in (1, 8))
        with pytest.raises(NotImplementedError, match="head dim 80 .*paged"):
            fa2.flash_attn_varlen_func(q[0], cache, cache, cu_q, cu_k, 1, 8, block_table=table)


def test_head_dims_past_256_stay_hipflash_errors():
    q = torch.zeros(1, 4, 2, 264, dtype=BF16)
    for mod in (fa2, fa3):
        with pytest.raises(ValueError, match="head dim 264"):
            mod.flash_attn_func(q, q, q)


@pytest.mark.parametrize("api", ["fa2", "fa3"])
def test_a_strided_last_dimension_is_copied(api):
    # FlashAttention's maybe_contiguous: q, k, v whose last dimension is not contiguous run on
    # copies.
    mod = fa2 if api == "fa2" else fa3
    q, k, v = qkv("cpu", s=12, d=128)
    qs, ks, vs = (t[..., ::2] for t in (q, k, v))
    assert qs.stride(-1) == 2
    assert_bitwise_equal(mod.flash_attn_func(qs, ks, vs, causal=True),
                         hipflash.flash_attn_func(*(t.contiguous() for t in (qs, ks, vs)),
                                                  causal=True), "out")


def test_softcap_none_is_off_and_a_tensor_is_refused():
    q, k, v = qkv("cpu", s=4)
    assert torch.equal(fa2.flash_attn_func(q, k, v, softcap=None), hipflash.flash_attn_func(q, k, v))
    with pytest.raises(NotImplementedError, match="softcap"):
        fa3.flash_attn_func(q, k, v, softcap=torch.tensor(0.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page", [0, 5, 16], ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch_idx", [False, True], ids=["", "batch_idx"])
@pytest.mark.parametrize("leftpad", [False, True], ids=["", "leftpad"])
def test_fa3_varlen_queries_append_packed_keys(device, page, rotary, causal, batch_idx, leftpad):
    """FA3's flash_attn_with_kvcache with cu_seqlens_q and cu_seqlens_k_new: the packed new
    rows land at cache_seqlens[b] of each sequence's cache (paged or contiguous, through
    cache_batch_idx), and each sequence's rows equal the batched call on that sequence alone
    (hipflash's own append, rotary and cache_leftpad), out and LSE."""
    g = torch.Generator().manual_seed(11)
    hq, hkv, d, cap = 4, 2, 64, 80
    lens, new, sq = [20, 0, 33], [3, 5, 0], [3, 5, 2]
    pads = [7, 0, 33] if leftpad else [0, 0, 0]  # the last sequence: its new rows only (none)
    n_cache = 5 if batch_idx else 3
    entries = [4, 0, 2] if batch_idx else [0, 1, 2]
    kc = torch.randn(n_cache, cap, hkv, d, generator=g).to(BF16)
    vc = torch.randn(n_cache, cap, hkv, d, generator=g).to(BF16)
    q = torch.randn(sum(sq), hq, d, generator=g).to(BF16)
    k = torch.randn(sum(new), hkv, d, generator=g).to(BF16)
    v = torch.randn(sum(new), hkv, d, generator=g).to(BF16)
    cu_q = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    cu_new = torch.tensor([0, 3, 8, 8], dtype=torch.int32)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    cos = sin = None
    if rotary:
        angle = torch.rand(64, 16, generator=g) * 6.3
        cos, sin = angle.cos(), angle.sin()
    kw = dict(cache_seqlens=seqlens.to(device), cu_seqlens_q=cu_q.to(device),
              cu_seqlens_k_new=cu_new.to(device), max_seqlen_q=5, causal=causal,
              return_softmax_lse=True,
              cache_leftpad=torch.tensor(pads, dtype=torch.int32, device=device)
              if leftpad else None,
              cache_batch_idx=torch.tensor(entries, dtype=torch.int32, device=device)
              if batch_idx else None,
              rotary_cos=cos.to(device) if rotary else None,
              rotary_sin=sin.to(device) if rotary else None)
    if page:  # the same rows in pages of `page` rows, scattered
        per = cap // page
        perm = torch.randperm(n_cache * per, generator=g)
        kp = torch.empty(n_cache * per, page, hkv, d, dtype=BF16)
        vp = torch.empty_like(kp)
        kp[perm] = kc.reshape(n_cache * per, page, hkv, d)
        vp[perm] = vc.reshape(n_cache * per, page, hkv, d)
        table = perm.view(n_cache, per).to(torch.int32)
        caches = (kp.to(device), vp.to(device))
        kw["page_table"] = table.to(device)
    else:
        caches = (kc.clone().to(device), vc.clone().to(device))
    out, lse, *rest = fa3.flash_attn_with_kvcache(q.to(device), *caches, k=k.to(device),
                                                  v=v.to(device), **kw)
    # FA3's split accumulators, empty for a call it does not split
    assert [t.numel() for t in rest] == [0, 0]
    out, lse, got_k = out.cpu(), lse.cpu(), caches[0].cpu()
    if page:  # back to [entry, row] order
        got_k = got_k[table.long()].reshape(n_cache, cap, hkv, d)
    for b in range(3):
        e, nq, nn = entries[b], slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_new[b]), int(cu_new[b + 1]))
        kb, vb = kc[e:e + 1].clone(), vc[e:e + 1].clone()
        pad = torch.tensor([pads[b]], dtype=torch.int32) if leftpad else None
        want, want_lse = hipflash.flash_attn_with_kvcache(
            q[None, nq], kb, vb, k[None, nn] if new[b] else None, v[None, nn] if new[b] else None,
            torch.tensor([lens[b]], dtype=torch.int32), causal=causal, return_lse=True,
            cache_leftpad=pad, rotary_cos=cos if rotary and new[b] else None,
            rotary_sin=sin if rotary and new[b] else None)
        if rotary and not new[b]:  # hipflash's batched call rotates on append only: q by hand
            from hipflash import _rotary
            pos = torch.full((1, sq[b]), lens[b]) + (torch.arange(sq[b]) if causal else 0)
            qb = _rotary.rotate(q[None, nq], cos, sin, pos, True)
            want, want_lse = hipflash.flash_attn_with_kvcache(
                qb, kb, vb, cache_seqlens=torch.tensor([lens[b]], dtype=torch.int32),
                causal=causal, return_lse=True, cache_leftpad=pad)
        torch.testing.assert_close(out[nq], want[0], rtol=0, atol=2e-2, msg=f"sequence {b} out")
        torch.testing.assert_close(lse[:, nq], want_lse[0], rtol=0, atol=1e-4,
                                   msg=f"sequence {b} lse")
        assert torch.equal(got_k[e, :lens[b] + new[b]], kb[0, :lens[b] + new[b]]), f"cache {b}"
        assert torch.equal(got_k[e, lens[b] + new[b]:], kc[e, lens[b] + new[b]:]), f"past {b}"


@pytest.mark.parametrize("device", DEVICES)
def test_fa3_varlen_append_refused_before_writing(device):
    kc = torch.zeros(2, 8, 1, 64, dtype=BF16, device=device)
    vc = torch.zeros_like(kc)
    q = torch.randn(4, 2, 64).to(BF16).to(device)
    k = torch.ones(6, 1, 64, dtype=BF16, device=device)
    cu_q = torch.tensor([0, 2, 4], dtype=torch.int32, device=device)
    cu_new = torch.tensor([0, 1, 6], dtype=torch.int32, device=device)
    seqlens = torch.tensor([3, 4], dtype=torch.int32, device=device)  # 4 + 5 rows > 8
    with pytest.raises(ValueError, match="fit its cache"):
        fa3.flash_attn_with_kvcache(q, kc, vc, k=k, v=k.clone(), cache_seqlens=seqlens,
                                    cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_new, max_seqlen_q=2)
    with pytest.raises(ValueError, match="together"):
        fa3.flash_attn_with_kvcache(q, kc, vc, k=k, v=k.clone(), cache_seqlens=seqlens,
                                    cu_seqlens_q=cu_q, max_seqlen_q=2)
    cu_new = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    for pads in ([0, 5], [-1, 0]):  # past the cached rows, negative
        with pytest.raises(ValueError, match="cache_leftpad"):
            fa3.flash_attn_with_kvcache(
                q, kc, vc, k=k[:3], v=k[:3].clone(), cache_seqlens=seqlens, cu_seqlens_q=cu_q,
                cu_seqlens_k_new=cu_new, max_seqlen_q=2,
                cache_leftpad=torch.tensor(pads, dtype=torch.int32, device=device))
    assert not kc.any() and not vc.any()


@pytest.mark.parametrize("device", DEVICES)
def test_fa3_combine_refuses_an_out_of_another_shape(device):
    parts = torch.randn(2, 2, 1, 4, 64, device=device)
    lses = torch.randn(2, 2, 1, 4, device=device)
    for shape in ((2, 5, 4, 64), (2, 1, 4, 32)):  # one broadcasts (it was filled), one cannot
        out = torch.full(shape, float("nan"), device=device)
        with pytest.raises(ValueError, match="out must be"):
            fa3.flash_attn_combine(parts, lses, out=out)
        assert out.isnan().all()
    out = torch.empty(2, 1, 4, 64, device=device)
    got, _ = fa3.flash_attn_combine(parts, lses, out=out)
    assert got is out


def test_fa2_package_layout():
    # flash_attn's own layout: the functions in flash_attn.flash_attn_interface, re-exported by
    # the package, which names the release whose API they follow.
    import hipflash.compat.flash_attn.flash_attn_interface as interface
    for name in fa2.__all__:
        assert getattr(fa2, name) is getattr(interface, name)
    assert fa2.__version__.startswith("2.")


@pytest.mark.parametrize("api", ["fa2", "fa3"])
def test_any_negative_window_bound_is_unbounded(api):
    # FlashAttention reads every negative bound as "no bound"; hipflash's own API takes -1 only.
    mod = fa2 if api == "fa2" else fa3
    q, k, v = qkv("cpu", s=12)
    assert_bitwise_equal(mod.flash_attn_func(q, k, v, window_size=(-7, -100)),
                         hipflash.flash_attn_func(q, k, v), "out")
    assert_bitwise_equal(mod.flash_attn_func(q, k, v, window_size=(torch.tensor(3), -5)),
                         hipflash.flash_attn_func(q, k, v, window_size=(3, -1)), "out")


@pytest.mark.parametrize("device", DEVICES)
def test_bert_padding_round_trip_and_varlen(device):
    # flash_attn.bert_padding: unpad_input packs the rows the mask keeps (left and right padding,
    # a sequence without rows), the varlen call on them is each sequence's dense call, and
    # pad_input puts them back with zeros at the padding; gradients reach the kept rows only.
    from hipflash.compat.flash_attn.bert_padding import (index_first_axis,
                                                         index_put_first_axis, pad_input,
                                                         unpad_input)
    b, s, h, d = 4, 24, 2, 64
    lengths, starts = [24, 7, 0, 13], [0, 17, 0, 3]
    mask = torch.zeros(b, s, dtype=torch.bool, device=device)
    for i, (n, a) in enumerate(zip(lengths, starts)):
        mask[i, a:a + n] = True
    q, k, v = (t.requires_grad_() for t in make_qkv(b, s, s, h, h, d, torch.bfloat16, seed=4,
                                                     device=device))
    (qu, idx, cu, most, used), (ku, _, _, _, _), (vu, _, _, _, _) = (
        unpad_input(t, mask.int()) for t in (q, k, v))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 24, 31, 31, 44] and most == 24
    assert used.tolist() == lengths and idx.dtype == torch.int64 and qu.shape == (44, h, d)
    out = pad_input(fa2.flash_attn_varlen_func(qu, ku, vu, cu, cu, most, most, causal=True),
                    idx, b, s)
    assert out.shape == q.shape and torch.count_nonzero(out[~mask]) == 0
    for i, (n, a) in enumerate(zip(lengths, starts)):
        if n:
            rows = slice(a, a + n)
            want = fa2.flash_attn_func(q[i:i + 1, rows], k[i:i + 1, rows], v[i:i + 1, rows],
                                       causal=True)
            assert_bitwise_equal(out[i:i + 1, rows], want)
    out.float().sum().backward()
    assert torch.count_nonzero(q.grad[~mask]) == 0 and torch.count_nonzero(q.grad[mask]) > 0
    # unused_mask: packed and counted in the lengths, not in the used lengths (seqused).
    unused = torch.zeros_like(mask)
    unused[3, 16:20] = True
    packed2, idx2, cu2, most2, used2 = unpad_input(q.detach(), mask, unused)
    assert cu2.tolist() == [0, 24, 31, 31, 48] and used2.tolist() == lengths and most2 == 24
    assert torch.equal(idx2, (mask | unused).flatten().nonzero().flatten())
    assert torch.equal(packed2, q.detach().flatten(0, 1)[idx2])
    kept = mask | unused
    assert torch.equal(pad_input(packed2, idx2.int(), b, s)[kept], q.detach()[kept])
    x = torch.arange(12.0, device=device).reshape(6, 2)
    rows = torch.tensor([4, 1, 5], device=device)
    assert torch.equal(index_first_axis(x, rows), x[rows])
    back = index_put_first_axis(x[rows], rows, 6)
    assert torch.equal(back[rows], x[rows]) and torch.count_nonzero(back[[0, 2, 3]]) == 0


def _rotary_reference(x, cos, sin, pos, interleaved):
    """x [..., rows, H, D] rotated at integer positions pos [..., rows] in float64, a complex
    product per pair: (x1 + i x2)(cos + i sin); positions past the tables are not rotated."""
    half = cos.shape[1]
    inside = (pos < cos.shape[0])[..., None]
    at = pos.clamp(max=cos.shape[0] - 1)
    turn = torch.complex(cos.double()[at], sin.double()[at])
    turn = torch.where(inside, turn, torch.ones_like(turn))[..., None, :]
    xr = x[..., :2 * half].double()
    if interleaved:
        pairs = xr.unflatten(-1, (half, 2))
    else:
        pairs = xr.unflatten(-1, (2, half)).transpose(-1, -2)
    z = torch.view_as_complex(pairs.contiguous()) * turn
    back = torch.view_as_real(z)
    back = back.flatten(-2) if interleaved else back.transpose(-1, -2).flatten(-2)
    return torch.cat((back, x[..., 2 * half:].double()), -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_layers_rotary_apply_rotary_emb(device, interleaved):
    # flash_attn.layers.rotary.apply_rotary_emb: dense with int and per-sequence offsets, varlen
    # with cu_seqlens, in place, gradients; against a float64 complex-product reference.
    from hipflash.compat.flash_attn.layers.rotary import apply_rotary_emb
    gen = torch.Generator().manual_seed(6)
    b, s, h, d, ro = 3, 10, 2, 64, 48
    angle = torch.rand(40, ro // 2, generator=gen) * 6.3
    cos, sin = angle.cos().to(device), angle.sin().to(device)
    x = torch.randn(b, s, h, d, generator=gen).to(device, torch.bfloat16)
    for offsets in (0, 5, torch.tensor([0, 7, 35], device=device)):  # 35 + 9 runs past the table
        got = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
        base = offsets if isinstance(offsets, torch.Tensor) else torch.full((b,), offsets,
                                                                            device=device)
        pos = base[:, None].long() + torch.arange(s, device=device)[None, :]
        want = _rotary_reference(x, cos, sin, pos, interleaved)
        assert got.dtype == x.dtype and (got.double() - want).abs().max() < 2e-2
        assert torch.equal(got[..., ro:], x[..., ro:])
    # varlen: each packed sequence as its own dense call
    cu = torch.tensor([0, 4, 4, 13], dtype=torch.int32, device=device)
    xv = torch.randn(13, h, d, generator=gen).to(device, torch.bfloat16)
    offs = torch.tensor([2, 0, 9], device=device)
    got = apply_rotary_emb(xv, cos, sin, interleaved=interleaved, seqlen_offsets=offs,
                           cu_seqlens=cu, max_seqlen=9)
    for i in range(3):
        a, e = int(cu[i]), int(cu[i + 1])
        if e > a:
            one = apply_rotary_emb(xv[None, a:e], cos, sin, interleaved=interleaved,
                                   seqlen_offsets=int(offs[i]))
            assert torch.equal(got[a:e], one[0])
    # in place, and gradients (a rotation's: the reference's)
    y = x.clone()
    assert apply_rotary_emb(y, cos, sin, interleaved=interleaved, inplace=True) is y
    assert torch.equal(y, apply_rotary_emb(x, cos, sin, interleaved=interleaved))
    xg = x.float().requires_grad_()
    g = torch.randn(xg.shape, generator=gen).to(device)
    (apply_rotary_emb(xg, cos, sin, interleaved=interleaved) * g).sum().backward()
    x64 = x.double().requires_grad_()
    pos = torch.arange(s, device=device)[None, :].expand(b, s)
    (_rotary_reference(x64, cos, sin, pos, interleaved) * g.double()).sum().backward()
    assert (xg.grad.double() - x64.grad).abs().max() < 1e-4
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_emb(x, torch.ones(8, 40, device=device), torch.ones(8, 40, device=device))
    with pytest.raises(ValueError, match="past rotary_cos"):  # an int offset: as flash-attn
        apply_rotary_emb(x, cos, sin, seqlen_offsets=31)
    with pytest.raises(ValueError, match="past rotary_cos"):
        apply_rotary_emb(xv, cos, sin, seqlen_offsets=32, cu_seqlens=cu, max_seqlen=9)
