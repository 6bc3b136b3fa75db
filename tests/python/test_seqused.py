"""FlashAttention 3's seqused_q / seqused_k on hipflash's varlen functions: sequence b uses only
its first seqused_q[b] query rows and seqused_k[b] keys, masks aligned on the used lengths; its
other rows get out = 0, LSE -inf and zero gradients. The used rows bitwise equal the call on the
used rows packed on their own, which is checked against the reference — on the CPU backend and
in the NVIDIA kernels, forward and backward."""
import pytest
import torch

import hipflash
import hipflash.compat.flash_attn_interface as fa3
from reference import (assert_bitwise_equal, check_lse, check_out, make_varlen,
                       varlen_attention_ref)
from test_backward import grads

GPU = torch.cuda.is_available() and hipflash.gpu_available()
BF16 = torch.bfloat16
I32 = torch.int32


def cu_of(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=I32)


def used_rows(cu, used):
    """Indices of the used rows of each sequence, in packed order."""
    return torch.cat([torch.arange(int(cu[b]), int(cu[b]) + int(u)) for b, u in enumerate(used)])


def assert_used_equal_unused_empty(out, lse, want, want_lse, rq, uq, layout):
    """The used rows (rq) bitwise the used sequences' call (want, want_lse); the other rows out 0
    and LSE -inf, in either LSE layout."""
    assert_bitwise_equal(out[rq], want, "used rows")
    unused = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    unused[rq] = False
    assert (out[unused] == 0).all(), "unused rows: out 0"
    if layout == "packed":
        assert_bitwise_equal(lse[:, rq], want_lse, "used rows' lse")
        assert torch.isneginf(lse[:, unused]).all(), "unused rows: lse -inf"
    else:
        for b, u in enumerate(uq.tolist()):
            assert_bitwise_equal(lse[b, :, :u], want_lse[b, :, :u], f"sequence {b} lse")
            assert torch.isneginf(lse[b, :, u:]).all()


def case():
    lens_q, lens_k = [7, 0, 40, 5], [9, 6, 50, 5]
    used_q, used_k = [4, 0, 33, 5], [9, 2, 20, 0]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 2, 64, BF16, seed=4)
    return q, k, v, cu_q, cu_k, torch.tensor(used_q, dtype=I32), torch.tensor(used_k, dtype=I32)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_used_rows_equal_the_used_sequences_alone(causal, layout):
    q, k, v, cu_q, cu_k, uq, uk = case()
    kw = dict(causal=causal, return_lse=True, lse_layout=layout)
    out, lse = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 50, seqused_q=uq,
                                               seqused_k=uk, **kw)
    rq, rk = used_rows(cu_q, uq), used_rows(cu_k, uk)
    cq, ck = cu_of(uq.tolist()), cu_of(uk.tolist())
    want, want_lse = hipflash.flash_attn_varlen_func(q[rq], k[rk], v[rk], cq, ck, 33, 20, **kw)
    assert_used_equal_unused_empty(out, lse, want, want_lse, rq, uq, layout)
    # and the used sequences against the reference (bottom-right on the used lengths)
    ref, ref_packed, ref_padded = varlen_attention_ref(q[rq], k[rk], v[rk], cq, ck, 33,
                                                       causal=causal)
    ref_lp, _, _ = varlen_attention_ref(q[rq], k[rk], v[rk], cq, ck, 33, lowp=True, causal=causal)
    check_out(want, ref, ref_lp, "used rows")
    check_lse(want_lse, ref_packed if layout == "packed" else ref_padded, "used rows")


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_gradients_of_unused_rows_are_zero_and_used_ones_match(deterministic):
    q, k, v, cu_q, cu_k, uq, uk = case()
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(BF16)
    _, g = grads(lambda *a: hipflash.flash_attn_varlen_func(
        *a, cu_q, cu_k, 40, 50, causal=True, seqused_q=uq, seqused_k=uk,
        deterministic=deterministic), q, k, v, dout)
    rq, rk = used_rows(cu_q, uq), used_rows(cu_k, uk)
    cq, ck = cu_of(uq.tolist()), cu_of(uk.tolist())
    _, gu = grads(lambda *a: hipflash.flash_attn_varlen_func(
        *a, cq, ck, 33, 20, causal=True, deterministic=deterministic), q[rq], k[rk], v[rk],
        dout[rq])
    for name, full, alone, rows in (("dq", g[0], gu[0], rq), ("dk", g[1], gu[1], rk),
                                    ("dv", g[2], gu[2], rk)):
        assert_bitwise_equal(full[rows], alone, name)
        rest = torch.ones(full.shape[0], dtype=torch.bool)
        rest[rows] = False
        assert (full[rest] == 0).all(), f"{name}: unused rows not zero"


@pytest.mark.parametrize("bad, error, match", [
    (dict(seqused_q=torch.tensor([8, 0, 40, 5], dtype=I32)), ValueError,
     r"seqused_q\[0\] = 8 must be in \[0, 7\]"),
    (dict(seqused_k=torch.tensor([1, 1, 1, -1], dtype=I32)), ValueError, "seqused_k"),
    (dict(seqused_k=torch.tensor([1, 1, 1], dtype=I32)), ValueError, "must have shape"),
    (dict(seqused_q=torch.tensor([1, 1, 1, 1])), ValueError, "int32"),
    (dict(seqused_q=[1, 1, 1, 1]), TypeError, "seqused_q must be a torch.Tensor"),
])
def test_bad_seqused_is_refused_and_nothing_is_written(bad, error, match):
    q, k, v, cu_q, cu_k, _, _ = case()
    out = torch.full_like(q, float("nan"))
    with pytest.raises(error, match=match):
        hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 50, out=out, **bad)
    assert torch.isnan(out).all()


def test_fa3_passes_them_through():
    q, k, v, cu_q, cu_k, uq, uk = case()
    want = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 50, causal=True,
                                           seqused_q=uq, seqused_k=uk)
    got = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 50, seqused_q=uq, seqused_k=uk,
                                     causal=True)
    assert_bitwise_equal(got, want, "fa3")


needs_gpu = pytest.mark.skipif(
    not GPU, reason="needs a GPU visible to torch and a hipflash built with GPU kernels "
    f"(this build: {hipflash.build_info()!r})")


@needs_gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_used_rows_equal_the_used_sequences_alone(causal, layout, num_splits):
    # The forward kernels read the used lengths; the unused rows are written by their own kernel.
    q, k, v, cu_q, cu_k, uq, uk = (t.cuda() for t in case())
    kw = dict(causal=causal, return_lse=True, lse_layout=layout, num_splits=num_splits)
    out = torch.full_like(q, float("nan"))
    lse = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 50, seqused_q=uq,
                                          seqused_k=uk, out=out, **kw)[1]
    rq, rk = used_rows(cu_q.cpu(), uq.cpu()).cuda(), used_rows(cu_k.cpu(), uk.cpu()).cuda()
    cq, ck = cu_of(uq.tolist()).cuda(), cu_of(uk.tolist()).cuda()
    want, want_lse = hipflash.flash_attn_varlen_func(q[rq], k[rk], v[rk], cq, ck, 33, 20, **kw)
    assert_used_equal_unused_empty(out, lse, want, want_lse, rq, uq, layout)
    qc, kc, vc = (t.cpu() for t in (q[rq], k[rk], v[rk]))
    ref, ref_packed, ref_padded = varlen_attention_ref(qc, kc, vc, cq.cpu(), ck.cpu(), 33,
                                                       causal=causal)
    ref_lp, _, _ = varlen_attention_ref(qc, kc, vc, cq.cpu(), ck.cpu(), 33, lowp=True,
                                        causal=causal)
    check_out(want.cpu(), ref, ref_lp, "gpu used rows")
    check_lse(want_lse.cpu(), ref_packed if layout == "packed" else ref_padded, "gpu used rows")


@needs_gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_gradients_of_unused_rows_are_zero_and_used_ones_match(D, causal, deterministic):
    # Several query and key blocks a sequence, GQA, a sequence with no used keys (its used rows
    # see nothing) and one with no rows: the used rows' gradients match the used sequences' own
    # call's (within rounding: the two calls' shapes may take different tiles or kernels), the
    # others are exactly 0 (the allocator's blocks of the gradients' sizes poisoned with NaN
    # first), the op and autograd agree (bitwise where nothing is added atomically), and both
    # match the CPU backend.
    lens_q, lens_k = [300, 0, 517, 64, 129], [400, 66, 517, 64, 200]
    used_q, used_k = [250, 0, 517, 1, 100], [399, 2, 300, 0, 129]
    q, k, v, cu_q, cu_k = (t.cuda() for t in make_varlen(lens_q, lens_k, 4, 2, D, BF16, seed=9))
    uq, uk = (torch.tensor(u, dtype=I32, device="cuda") for u in (used_q, used_k))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(BF16).cuda()
    kw = dict(causal=causal, deterministic=deterministic)
    out, lse = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 517, 517, seqused_q=uq,
                                               seqused_k=uk, return_lse=True, **kw)
    poison = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    del poison
    g = torch.ops.hipflash.varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, 517, 517, None,
                                      causal, -1, -1, deterministic, "padded", 0.0, None, uq, uk)
    _, g_autograd = grads(lambda *a: hipflash.flash_attn_varlen_func(
        *a, cu_q, cu_k, 517, 517, seqused_q=uq, seqused_k=uk, **kw), q, k, v, dout)
    rq, rk = (used_rows(c.cpu(), u.cpu()).cuda() for c, u in ((cu_q, uq), (cu_k, uk)))
    cq, ck = cu_of(used_q).cuda(), cu_of(used_k).cuda()
    _, gu = grads(lambda *a: hipflash.flash_attn_varlen_func(*a, cq, ck, 517, 399, **kw),
                  q[rq], k[rk], v[rk], dout[rq])
    for name, full, via, alone, rows in (("dq", g[0], g_autograd[0], gu[0], rq),
                                         ("dk", g[1], g_autograd[1], gu[1], rk),
                                         ("dv", g[2], g_autograd[2], gu[2], rk)):
        torch.testing.assert_close(full[rows].float(), alone.float(), atol=2e-2, rtol=2e-2,
                                   msg=lambda m: f"{name} vs the used sequences alone: {m}")
        if name != "dq" or deterministic:  # (atomic dq additions: any order)
            assert_bitwise_equal(via, full, f"{name} through autograd")
        rest = torch.ones(full.shape[0], dtype=torch.bool, device="cuda")
        rest[rows] = False
        assert (full[rest] == 0).all(), f"{name}: unused rows not zero"
    # and against the CPU backend's gradients of the same call
    _, g_cpu = grads(lambda *a: hipflash.flash_attn_varlen_func(
        *a, cu_q.cpu(), cu_k.cpu(), 517, 517, seqused_q=uq.cpu(), seqused_k=uk.cpu(), **kw),
        q.cpu(), k.cpu(), v.cpu(), dout.cpu())
    for name, gpu, cpu in zip(("dq", "dk", "dv"), g, g_cpu):
        torch.testing.assert_close(gpu.cpu().float(), cpu.float(), atol=5e-2, rtol=5e-2,
                                   msg=lambda m: f"{name} vs the CPU backend: {m}")
