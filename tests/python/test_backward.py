"""The backward (SPEC §7) on the CPU and, where torch sees a GPU and hipflash has GPU kernels,
on the GPU: gradients of hipflash.flash_attn_func against fp64 autograd with FlashAttention's
rule (error <= 2 x the same-precision PyTorch error + 1e-5, per tensor; the same-precision
reference runs on the device under test), both dq paths (deterministic and atomic), the LSE
contract it relies on, determinism, a small training loop, varlen, and where no backward exists
(out=, double backward)."""
import pytest
import torch

import hipflash
from reference import alibi_bias, make_qkv, make_varlen, valid_mask

GPU = torch.cuda.is_available() and hipflash.gpu_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not GPU, reason="needs a GPU visible to torch and a hipflash built with GPU kernels "
        f"(this build: {hipflash.build_info()!r})")),
]


def torch_attention(q, k, v, dtype, causal=False, window=(-1, -1), scale=None, softcap=0.0,
                    alibi_slopes=None, attention_chunk=0):
    """SDPA of SPEC §3 in `dtype` with PyTorch ops (autograd reference); [B, S, H, D] layout;
    softcap > 0 caps the scaled scores to softcap * tanh(s / softcap), then alibi_slopes add
    ALiBi's bias (reference.alibi_bias); attention_chunk as reference.valid_mask."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qq, kk, vv = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    kk = kk.repeat_interleave(hq // hkv, dim=1)
    vv = vv.repeat_interleave(hq // hkv, dim=1)
    # Products in `dtype`; where the CPU has no such kernel (float16 in PyTorch 1.13) each
    # product is taken in fp32 and rounded to float16, one rounding per operation.
    native = not (dtype == torch.float16 and q.device.type == "cpu")
    mm = (lambda a, b: a @ b) if native else (lambda a, b: (a.float() @ b.float()).to(dtype))
    s = mm(qq, kk.transpose(-1, -2)) * scale
    if softcap:  # in fp32 (no float16 tanh on PyTorch 1.13's CPU), rounded once
        s = (softcap * torch.tanh(s.float() / softcap)).to(dtype)
    if alibi_slopes is not None:  # in fp64, rounded once
        bias = alibi_bias(alibi_slopes, b, hq, sq, k.shape[1], q.device)
        s = (s.double() + bias).to(dtype)
    mask = valid_mask(sq, k.shape[1], causal, window, device=q.device,
                      attention_chunk=attention_chunk)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).nan_to_num(0.0).to(dtype)  # empty rows: zero
    return mm(p, vv).transpose(1, 2)


def assert_same_bits(got, want):
    """Tensors of 16-bit floats, equal bit for bit."""
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def grads(fn, q, k, v, dout, device=None):
    """(out, [dq, dk, dv]) of fn on copies of q, k, v (moved to `device` when given)."""
    device = device or q.device
    q, k, v = (t.detach().to(device).clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout.to(device, out.dtype))
    return out.detach(), [t.grad.detach() for t in (q, k, v)]


CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, causal, window)
    (1, 37, 50, 2, 2, 64, False, (-1, -1)),
    (2, 33, 33, 4, 2, 64, True, (-1, -1)),      # GQA 2:1, causal
    (1, 64, 40, 2, 1, 32, True, (-1, -1)),      # Sq > Sk: first rows see no key
    (1, 50, 70, 2, 2, 128, False, (10, 5)),     # sliding window
    (1, 3, 200, 8, 2, 96, False, (-1, -1)),     # decode-like, GQA 4:1, head dim 96
]


# Longer sequences and every head dim, on the GPU only (the fp64 reference stays on the CPU).
GPU_CASES = [
    (2, 257, 300, 4, 4, 32, False, (-1, -1)),
    (1, 640, 640, 4, 1, 64, True, (-1, -1)),    # MQA, several key blocks of every tile
    (2, 333, 517, 4, 2, 128, True, (-1, -1)),
    (1, 600, 500, 2, 2, 128, False, (64, 32)),  # window, Sq > Sk
    (1, 300, 300, 4, 2, 256, True, (-1, -1)),
    (2, 129, 1000, 8, 8, 96, False, (-1, -1)),
    (2, 700, 1100, 8, 2, 128, False, (-1, -1)),  # GQA, unmasked: a rotated walk when deterministic
    (2, 200, 1000, 4, 2, 64, True, (64, 0)),  # key blocks 0-4 seen by no row: tiles with no steps
]


def case_id(c):
    return f"b{c[0]}_sq{c[1]}_sk{c[2]}_h{c[3]}x{c[4]}_d{c[5]}_c{int(c[6])}_w{c[7][0]}x{c[7][1]}"


def assert_flash_rule(name, ours, low, ref):
    """FlashAttention's rule: max|ours - ref| <= 2 x the same-precision error + 1e-5."""
    err = (ours.double().cpu() - ref).abs().max().item()
    tol = 2 * (low.double().cpu() - ref).abs().max().item() + 1e-5
    assert err <= tol, f"d{name}: max|err| {err:.3e} > {tol:.3e}"


def check_gradients(device, dtype, case, deterministic):
    b, sq, sk, hq, hkv, d, causal, window = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype, seed=7)
    dout = torch.randn(b, sq, hq, d, generator=torch.Generator().manual_seed(8)).to(dtype)
    _, g64 = grads(lambda *a: torch_attention(*a, torch.float64, causal, window), q, k, v, dout)
    _, glp = grads(lambda *a: torch_attention(*a, dtype, causal, window), q, k, v, dout, device)
    _, ghf = grads(lambda *a: hipflash.flash_attn_func(*a, causal=causal, window_size=window,
                                                       deterministic=deterministic),
                   q, k, v, dout, device)
    for name, ours, low, ref in zip("qkv", ghf, glp, g64):
        assert ours.dtype == dtype and ours.shape == ref.shape and ours.device.type == device
        assert not torch.isnan(ours).any(), f"d{name}: NaN"
        assert_flash_rule(name, ours, low, ref)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gradients_match_fp64_autograd(device, dtype, case, deterministic):
    check_gradients(device, dtype, case, deterministic)


@pytest.mark.skipif(not GPU, reason="GPU cases: needs a GPU visible to torch and GPU kernels")
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_gpu_gradients_match_fp64_autograd(dtype, case, deterministic):
    check_gradients("cuda", dtype, case, deterministic)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("device", DEVICES)
def test_rows_without_keys_get_zero_gradients(device, deterministic):
    q, k, v = make_qkv(1, 10, 4, 1, 1, 64, torch.bfloat16, seed=1)  # causal: rows 0-5 see nothing
    _, (dq, dk, dv) = grads(lambda *a: hipflash.flash_attn_func(
        *a, causal=True, deterministic=deterministic), q, k, v, torch.ones(1, 10, 1, 64), device)
    assert torch.equal(dq[:, :6], torch.zeros_like(dq[:, :6]))
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_bitwise_over_repeats(device, causal):
    q, k, v = make_qkv(2, 245, 270, 4, 2, 64, torch.bfloat16, seed=3)
    dout = torch.randn(2, 245, 4, 64).to(torch.bfloat16)
    fn = lambda *a: hipflash.flash_attn_func(*a, causal=causal, deterministic=True)  # noqa: E731
    first = grads(fn, q, k, v, dout, device)[1]
    for _ in range(100):
        assert_same_bits(grads(fn, q, k, v, dout, device)[1], first)


@pytest.mark.skipif(not GPU, reason="needs a GPU visible to torch and a hipflash built with "
                    f"GPU kernels (this build: {hipflash.build_info()!r})")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_deterministic_many_tiles(causal, d):
    """More key-block tiles than a GPU has multiprocessors (a persistent grid hands them out:
    a counter for masked calls, a rotated walk unmasked): bitwise over repeats, and within
    FlashAttention's rule of the fp64 gradients as the atomic mode is."""
    q, k, v = make_qkv(2, 1100, 1100, 16, 4, d, torch.bfloat16, seed=5)  # 2 x 4 x 9 = 72 tiles
    q, k, v = (t.repeat(3, 1, 1, 1) for t in (q, k, v))                  # x 3: 216 tiles
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    fn = lambda *a: hipflash.flash_attn_func(*a, causal=causal, deterministic=True)  # noqa: E731
    first = grads(fn, q, k, v, dout, "cuda")[1]
    for _ in range(5):
        assert_same_bits(grads(fn, q, k, v, dout, "cuda")[1], first)
    _, g64 = grads(lambda *a: torch_attention(*a, torch.float64, causal), q, k, v, dout, "cuda")
    _, glow = grads(lambda *a: torch_attention(*a, torch.bfloat16, causal), q, k, v, dout,
                    "cuda")
    for name, ours, low, ref in zip("qkv", first, glow, (g.cpu() for g in g64)):
        assert_flash_rule(name, ours, low, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_training_loop_matches_sdpa(device):
    # A tiny attention model trained a few hundred steps with hipflash and with the same model
    # on PyTorch attention (fp32 SDPA math): the loss curves agree within noise.
    torch.manual_seed(0)
    B, S, H, D = 4, 16, 2, 32

    def run(attn):
        g = torch.Generator().manual_seed(1)
        wq, wk, wv = ((torch.randn(H * D, H * D, generator=g) * 0.1).to(device) for _ in range(3))
        params = [w.requires_grad_() for w in (wq, wk, wv)]
        opt = torch.optim.Adam(params, lr=1e-2)
        x = torch.randn(64, B, S, H * D, generator=g).to(device)
        losses = []
        for step in range(300):
            xb = x[step % 64]
            q, k, v = ((xb @ w).view(B, S, H, D) for w in params)
            out = attn(q, k, v)
            loss = ((out.float() - xb.view(B, S, H, D)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return torch.tensor(losses)

    ours = run(lambda q, k, v: hipflash.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True))
    ref = run(lambda q, k, v: torch_attention(q, k, v, torch.float32, causal=True))
    assert ours[-50:].mean() < 0.7 * ours[:10].mean(), "it trains"
    assert (ours[-50:].mean() - ref[-50:].mean()).abs() <= 0.05 * ref[-50:].mean() + 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_no_backward_where_there_is_none(device):
    q, k, v = make_qkv(1, 8, 8, 1, 1, 64, torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match="no backward yet"):  # out= keeps the boundary
        hipflash.flash_attn_func(q.requires_grad_(), k, v, out=torch.empty_like(q))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lse_layout", ["padded", "packed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lens", [
    ([3, 0, 40, 17], [5, 7, 30, 17]),
    ([40, 300, 9], [600, 300, 700]),  # GPU, unmasked: sequences 0 and 2 walk unrotated (n > steps)
], ids=["short", "mixed"])
def test_varlen_gradients_equal_per_sequence_dense(lse_layout, causal, lens, device):
    # Each sequence's gradients of the packed backward equal the dense backward's on that
    # sequence (deterministic dq: bitwise). Both take the packed forward's out and LSE: the
    # forwards may run different kernels (on Hopper, short hd64 varlen sequences take the
    # cp.async kernel, a dense call the TMA one; each is tested against the reference on its own).
    lens_q, lens_k = lens
    # Causal: no GQA. A dense causal GQA call this small splits a kv head's query heads over
    # tiles (bwd_heads_per_tile), summing dk / dv in another order than a packed call's whole
    # groups (both repeatable; equal to the reference within the rule, test_gradients_*).
    hkv = 4 if causal else 2
    q, k, v, cq, ck = make_varlen(lens_q, lens_k, 4, hkv, 64, torch.bfloat16, device=device,
                                  seed=9)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(10)).to(device,
                                                                                torch.bfloat16)
    out, lse = hipflash.flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k),
                                               causal=causal, lse_layout=lse_layout,
                                               return_lse=True)
    dq, dk, dv = torch.ops.hipflash.varlen_bwd(dout, q, k, v, out, lse, cq, ck, max(lens_q),
                                               max(lens_k), None, causal, -1, -1, True,
                                               lse_layout)
    for b in range(len(lens_q)):
        qs, ks = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        if lens_q[b] == 0:
            assert torch.equal(dk[ks], torch.zeros_like(dk[ks]))  # no query sees these keys
            continue
        seq_lse = lse[b, :, :lens_q[b]] if lse_layout == "padded" else lse[:, qs]
        eq, ek, ev = torch.ops.hipflash.bwd(dout[qs][None], q[qs][None], k[ks][None],
                                            v[ks][None], out[qs][None],
                                            seq_lse[None].contiguous(), None, causal, -1, -1,
                                            True)
        for name, got, want in (("dq", dq[qs], eq[0]), ("dk", dk[ks], ek[0]),
                                ("dv", dv[ks], ev[0])):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                f"sequence {b}: {name}"


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("device", DEVICES)
def test_varlen_rows_outside_every_sequence_get_zero_gradients(device, deterministic):
    cq = torch.tensor([0, 4], dtype=torch.int32, device=device)
    ck = torch.tensor([2, 6], dtype=torch.int32, device=device)  # keys 0-1: no sequence's
    q = torch.randn(6, 1, 64).to(device, torch.bfloat16)  # query rows 4-5: no sequence's
    k = torch.randn(6, 1, 64).to(device, torch.bfloat16)
    o, l = hipflash.flash_attn_varlen_func(q, k, k, cq, ck, 4, 4, return_lse=True)
    for _ in range(5):  # fresh (NaN-poisoned in the allocator's reuse) buffers each time
        torch.full((6, 1, 64), float("nan"), device=device).to(torch.bfloat16)
        dq, dk, dv = torch.ops.hipflash.varlen_bwd(torch.randn(6, 1, 64).to(device, torch.bfloat16),
                                                   q, k, k, o, l, cq, ck, 4, 4, None, False, -1,
                                                   -1, deterministic, "padded")
        assert torch.equal(dq[4:].float().cpu(), torch.zeros(2, 1, 64))
        assert torch.equal(dk[:2].float().cpu(), torch.zeros(2, 1, 64))
        assert torch.equal(dv[:2].float().cpu(), torch.zeros(2, 1, 64))


@pytest.mark.parametrize("device", DEVICES)
def test_double_backward_is_refused_not_silently_wrong(device):
    x = torch.randn(1, 4, 2, 64).to(device, torch.bfloat16).requires_grad_()
    out = hipflash.flash_attn_func(x, x, x)
    gx, = torch.autograd.grad(out.float().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.float().pow(2).sum().backward()
