"""Attention sinks (flash_attn_func / flash_attn_varlen_func ``sinks``, gpt-oss's): out, LSE and
the gradients of q, k, v and the sinks against a PyTorch reference that puts the sink logit in
every row's softmax, in fp64, with FlashAttention's 2x rule against the same reference in the
low precision; the refusals. CPU in CI, the GPU kernels where torch sees a GPU."""
import pytest
import torch

import hipflash
from reference import make_qkv, make_varlen, valid_mask
from test_backward import DEVICES, assert_flash_rule

BF16 = torch.bfloat16
SINKS = [-1.0, 0.5, 2.0, 8.0]


def sink_attention(q, k, v, sinks, dtype, causal=False, window=(-1, -1)):
    """(out [B, Sq, H, D], lse [B, H, Sq]) of the softmax over each row's keys and its head's
    sink logit (which attends to nothing), with PyTorch ops in `dtype`."""
    b, sq, hq, d = q.shape
    group = hq // k.shape[2]
    qq, kk, vv = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
    s = (qq @ kk.transpose(-1, -2)) * d ** -0.5
    mask = valid_mask(sq, k.shape[1], causal, window, device=q.device)
    s = s.masked_fill(~mask, float("-inf"))
    logits = torch.cat([s, sinks.to(dtype).view(1, hq, 1, 1).expand(b, hq, sq, 1)], -1)
    p = torch.softmax(logits, -1)
    return (p[..., :-1] @ vv).transpose(1, 2), torch.logsumexp(logits, -1)


def run(fn, q, k, v, sinks, dout, device):
    """(out, lse, [dq, dk, dv, dsinks]) of fn on copies moved to `device`."""
    args = [t.detach().to(device).clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = fn(*args)
    out.backward(dout.to(device, out.dtype))
    return out.detach(), lse.detach(), [t.grad.detach() for t in args]


CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, causal, window)
    (2, 33, 33, 4, 2, 64, True, (-1, -1)),
    (1, 40, 25, 4, 4, 64, True, (-1, -1)),     # Sq > Sk: rows without keys see only the sink
    (1, 37, 50, 4, 1, 128, False, (10, 5)),    # MQA, sliding window
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_sq{}_sk{}_h{}x{}_d{}_{}_{}".format(
    *c[:6], "causal" if c[6] else "full", "win" if c[7] != (-1, -1) else "nowin"))
def test_dense_sinks_forward_and_gradients(device, case):
    b, sq, sk, hq, hkv, d, causal, window = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, BF16, seed=3)
    sinks = torch.tensor(SINKS)
    dout = torch.randn(b, sq, hq, d, generator=torch.Generator().manual_seed(4)).to(BF16)
    ref = lambda dt: lambda *a: sink_attention(*a, dt, causal, window)  # noqa: E731
    out64, lse64, g64 = run(ref(torch.float64), q, k, v, sinks, dout, "cpu")
    outlp, _, glp = run(ref(BF16), q, k, v, sinks, dout, "cpu")
    out, lse, g = run(lambda *a: hipflash.flash_attn_func(*a[:3], causal=causal,
                                                         window_size=window, sinks=a[3],
                                                         return_lse=True),
                      q, k, v, sinks, dout, device)
    assert_flash_rule("out", out, outlp, out64)
    assert (lse.double().cpu() - lse64).abs().max().item() < 1e-4
    for name, ours, low, want in zip(["q", "k", "v", "sinks"], g, glp, g64):
        assert not torch.isnan(ours).any(), f"d{name}: NaN"
        assert_flash_rule(name, ours, low, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lse_layout", ["packed", "padded"])
def test_varlen_sinks_are_each_sequences_dense_call(device, lse_layout):
    # Each sequence of the packed call gives its dense call's out and LSE (bitwise on the CPU;
    # on the GPU other kernels may sum in another order), and the sinks' gradient is the sum
    # of the sequences'.
    q, k, v, cu_q, cu_k = make_varlen([5, 17, 0, 9], [8, 17, 3, 20], 4, 2, 64, BF16,
                                      device=device)
    sinks = torch.tensor(SINKS, device=device, requires_grad=True)
    out, lse = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 20, causal=True,
                                               sinks=sinks, return_lse=True,
                                               lse_layout=lse_layout)
    out.float().sum().backward()
    want_grad, sinks.grad = sinks.grad.clone(), None
    for b in range(4):
        rq, rk = slice(*cu_q[b:b + 2].tolist()), slice(*cu_k[b:b + 2].tolist())
        o, l = hipflash.flash_attn_func(q[None, rq], k[None, rk], v[None, rk], causal=True,
                                        sinks=sinks, return_lse=True)
        o.float().sum().backward()
        got = lse[:, rq] if lse_layout == "packed" else lse[b, :, :rq.stop - rq.start]
        if device == "cpu":
            assert torch.equal(out[rq], o[0]) and torch.equal(got, l[0])
        torch.testing.assert_close(out[rq], o[0], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got, l[0], rtol=1e-5, atol=1e-5)
    if lse_layout == "padded":  # past each sequence's rows: -inf
        assert bool((lse[2] == float("-inf")).all())
    torch.testing.assert_close(sinks.grad, want_grad, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_without_keys_see_only_the_sink(device):
    # Out 0, the LSE the sink's logit, no NaN in any gradient.
    q, k, v = make_qkv(1, 6, 0, 4, 4, 64, BF16, device=device)
    sinks = torch.tensor(SINKS, device=device)
    out, lse = hipflash.flash_attn_func(q, k, v, sinks=sinks, return_lse=True)
    assert torch.count_nonzero(out) == 0
    assert torch.equal(lse, sinks.view(1, 4, 1).expand(1, 4, 6))


@pytest.mark.parametrize("device", DEVICES)
def test_infinite_and_nan_sinks(device):
    # A -inf sink is no sink: out and LSE the sink-free call's, rows without keys out 0 and
    # LSE -inf, and the gradients those of the sink-free call (d sink 0). A NaN sink makes its
    # head's LSE NaN and the out of its rows with keys, not of those without (an empty sum).
    q, k, v = make_qkv(1, 6, 4, 4, 2, 64, BF16, seed=3, device=device)  # causal: rows 0, 1 empty
    inf, nan = float("-inf"), float("nan")
    sinks = torch.tensor([inf, 0.5, nan, inf], device=device)
    dout = torch.randn_like(q)
    out, lse, grads = run(lambda *a: hipflash.flash_attn_func(*a[:3], causal=True, sinks=a[3],
                                                              return_lse=True),
                          q, k, v, sinks, dout, device)
    ref, ref_lse = hipflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    for h in (0, 3):
        assert torch.equal(out[:, :, h], ref[:, :, h]) and torch.equal(lse[:, h], ref_lse[:, h])
    assert torch.count_nonzero(out[:, :2]) == 0
    assert torch.isnan(lse[:, 2]).all() and not torch.isnan(lse[:, [0, 1, 3]]).any()
    assert torch.isnan(out[:, 2:, 2]).all() and not torch.isnan(out[:, :, [0, 1, 3]]).any()
    dsinks = grads[3]
    assert dsinks[0].item() == 0 and dsinks[3].item() == 0 and torch.isfinite(dsinks[1])


def test_sinks_are_refused_where_they_do_not_run():
    q, k, v = make_qkv(1, 8, 8, 4, 4, 64, BF16)
    sinks = torch.tensor(SINKS)
    with pytest.raises(ValueError, match="sinks must be"):
        hipflash.flash_attn_func(q, k, v, sinks=sinks[:3])
    with pytest.raises(NotImplementedError, match="sinks with out="):
        hipflash.flash_attn_func(q, k, v, sinks=sinks, out=torch.empty_like(q))
    with pytest.raises(NotImplementedError, match="sinks with attention_chunk"):
        hipflash.flash_attn_func(q, k, v, sinks=sinks, attention_chunk=4)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="sinks with a block_table"):
        hipflash.flash_attn_varlen_func(q[0], k.view(1, 8, 4, 64), v.view(1, 8, 4, 64), cu, cu,
                                        8, 8, sinks=sinks,
                                        block_table=torch.zeros(1, 1, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_sinks_against_the_reference(device):
    # A decode step against a cache with sinks: each sequence's softmax over its cached keys,
    # the appended one and the sinks (fp64 reference, FlashAttention's rule for out).
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 1, 4, 64, generator=g).to(BF16).to(device)
    kc, vc = (torch.randn(2, 32, 2, 64, generator=g).to(BF16).to(device) for _ in range(2))
    kn, vn = (torch.randn(2, 1, 2, 64, generator=g).to(BF16).to(device) for _ in range(2))
    lens = torch.tensor([5, 20], dtype=torch.int32, device=device)
    sinks = torch.tensor(SINKS, device=device)
    out, lse = hipflash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens,
                                                causal=True, sinks=sinks, return_lse=True)
    for b, n in enumerate([6, 21]):
        args = [t[b:b + 1].cpu() for t in (q, kc[:, :n], vc[:, :n])] + [sinks.cpu()]
        o64, l64 = sink_attention(*args, torch.float64, causal=True)
        olp, _ = sink_attention(*args, BF16, causal=True)
        assert_flash_rule("out", out[b:b + 1], olp, o64)
        assert (lse[b:b + 1].double().cpu() - l64).abs().max().item() < 1e-4
    with pytest.raises(NotImplementedError, match="sinks with attention_chunk"):
        hipflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, sinks=sinks,
                                         attention_chunk=8)
