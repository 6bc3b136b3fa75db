"""Regression tests of calls a new user makes that once lost data, crashed or misled (issue 38):
empty key and query extents on every entry point, the backward of empty problems, double
backward, merges of huge finite LSEs and of strided LSE parts.

Runs on the CPU backend everywhere and on the GPU kernels where torch sees a GPU and this build
has them (the `device` parameter; CI has no GPU: those cases skip with the reason).
"""
import math

import pytest
import torch

import hipflash
from reference import assert_bitwise_equal, make_qkv, make_varlen

GPU = torch.cuda.is_available() and hipflash.gpu_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not GPU, reason="needs a GPU visible to torch and a hipflash built with GPU kernels; this "
    f"build: {hipflash.build_info()!r}"))]
BF16 = torch.bfloat16


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


# ---- Empty key ranges: out 0, lse -inf, on every path (the TMA kernel's included) -------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [64, 128, 256, 96])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("splits", [0, 3])
@pytest.mark.parametrize("with_out", [False, True])
def test_empty_key_range(device, d, causal, splits, with_out):
    q, k, v = make_qkv(2, 128, 0, 8, 8, d, BF16, device=device)
    out = torch.full_like(q, float("nan")) if with_out else None
    res, lse = hipflash.flash_attn_func(q, k, v, causal=causal, num_splits=splits,
                                        return_lse=True, out=out)
    sync(device)
    assert res.shape == q.shape and lse.shape == (2, 8, 128)
    assert (res == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 5, 7), (2, 0, 7), (2, 0, 0), (0, 0, 0)],
                         ids=["b0", "sq0", "sq0-sk0", "all0"])
def test_empty_query_extent(device, shape):
    b, sq, sk = shape
    q, k, v = make_qkv(b, sq, sk, 4, 2, 128, BF16, device=device)
    out, lse = hipflash.flash_attn_func(q, k, v, return_lse=True)
    sync(device)
    assert out.shape == q.shape and lse.shape == (b, 4, sq)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lse_layout", ["padded", "packed"])
def test_varlen_without_keys(device, lse_layout):
    q, k, v, cu_q, cu_k = make_varlen([3, 5, 0], [0, 0, 0], 4, 2, 128, BF16, device=device)
    out, lse = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 0, return_lse=True,
                                               lse_layout=lse_layout)
    sync(device)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sq", [1, 40])
def test_kvcache_without_keys(device, paged, sq):
    q = torch.randn(2, sq, 8, 128, dtype=BF16, device=device)
    if paged:
        k_cache = torch.randn(3, 16, 2, 128, dtype=BF16, device=device)
        table = torch.tensor([[0], [2]], dtype=torch.int32, device=device)
    else:
        k_cache, table = torch.randn(2, 0, 2, 128, dtype=BF16, device=device), None
    lens = torch.zeros(2, dtype=torch.int32, device=device) if paged else None
    out, lse = hipflash.flash_attn_with_kvcache(q, k_cache, k_cache.clone(), cache_seqlens=lens,
                                                block_table=table, return_lse=True)
    sync(device)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("device", DEVICES)
def test_merge_with_an_empty_half(device):
    """Serving and ring attention split the keys; one half may be empty: the merge is the other
    half, bitwise."""
    q, k, v = make_qkv(2, 128, 96, 8, 8, 128, BF16, device=device)
    full = hipflash.flash_attn_func(q, k, v, return_lse=True)
    empty = hipflash.flash_attn_func(q, k[:, :0], v[:, :0], return_lse=True)
    for a, b in ((full, empty), (empty, full)):
        out, lse = hipflash.merge_attn_states(a[0], a[1], b[0], b[1])
        sync(device)
        assert_bitwise_equal(out, full[0], "out")
        assert_bitwise_equal(lse, full[1], "lse")


# ---- The backward of empty problems, as autograd calls it ---------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 5, 7), (2, 0, 7), (2, 5, 0)], ids=["b0", "sq0", "sk0"])
def test_backward_of_empty_problem(device, shape):
    b, sq, sk = shape
    q, k, v = (t.requires_grad_() for t in make_qkv(b, sq, sk, 4, 2, 64, BF16, device=device))
    out = hipflash.flash_attn_func(q, k, v, causal=True)
    out.sum().backward()  # autograd hands over an expanded (stride-0) gradient
    sync(device)
    for t in (q, k, v):
        assert t.grad.shape == t.shape and (t.grad == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_backward_of_empty_sequences(device):
    q, k, v, cu_q, cu_k = make_varlen([0, 0], [0, 0], 4, 2, 64, BF16, device=device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 0, 0)
    out.sum().backward()
    sync(device)
    for t in (q, k, v):
        assert t.grad.shape == t.shape


# ---- Double backward: refused by name, never a silently constant attention ----------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("varlen", [False, True])
def test_double_backward_is_refused(device, varlen):
    if varlen:
        q, k, v, cu_q, cu_k = make_varlen([5, 3], [7, 4], 4, 2, 64, BF16, device=device)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, causal=True)
    else:
        q, k, v = (t.requires_grad_() for t in make_qkv(2, 5, 7, 4, 2, 64, BF16, device=device))
        out = hipflash.flash_attn_func(q, k, v, causal=True)
    dq, dk = torch.autograd.grad(out.float().square().sum(), (q, k), create_graph=True)
    assert dq.requires_grad and dq.grad_fn is not None  # a graph, not silently constants
    with pytest.raises(RuntimeError, match="hipflash: the attention backward is not differentiable"):
        (dq.float().sum() + dk.float().sum()).backward()
    # First-order gradients are unchanged by the guard.
    dq1, = torch.autograd.grad(out.float().square().sum(), q, retain_graph=True)
    assert_bitwise_equal(dq1, dq.detach(), "dq")


# ---- merge_attn_states: every finite LSE, strided LSE parts -------------------------------------


def merge_ref(outs, lses):
    """fp64 merge of stacked parts: lse = max + log(sum exp(lse_i - max)), out = sum w_i out_i
    with w_i = exp(lse_i - max) / sum exp(lse_j - max)."""
    lses64 = lses.double()
    m = lses64.max(0).values
    w = torch.exp(lses64 - m)
    lse = m + torch.log(w.sum(0))
    weights = w / w.sum(0)  # exp(lse_i - lse), without rounding lse first  [N, B, H, S]
    out = (weights.permute(0, 1, 3, 2)[..., None] * outs.double()).sum(0)
    return out, lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", [(3.0e38, 3.0e38 - 2e31), (3.3e38, -3.3e38), (-3.0e38, -3.0e38),
                                  (2.5e38, 2.5e38), (-3.4e38, 1.0)],
                         ids=["near-max", "max-and-min", "near-min", "tie", "min-and-one"])
def test_merge_huge_finite_lses(device, pair):
    g = torch.Generator().manual_seed(5)
    outs = torch.randn(2, 1, 3, 2, 64, generator=g).to(BF16).to(device)
    lses = torch.tensor(pair, dtype=torch.float32).view(2, 1, 1, 1).expand(2, 1, 2, 3)
    lses = lses.contiguous().to(device)
    out, lse = hipflash.merge_attn_states(outs, lses)
    sync(device)
    ref_out, ref_lse = merge_ref(outs.cpu(), lses.cpu())
    assert torch.isfinite(lse).all() and torch.isfinite(out.float()).all()
    rel = ((lse.cpu().double() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)).max().item()
    assert rel < 1e-6, rel
    assert (out.cpu().double() - ref_out).abs().max().item() < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_merge_keeps_the_non_finite_rules(device):
    """-inf parts are empty, +inf and NaN reach the result: the huge-LSE fix changes none."""
    outs = torch.ones(2, 4, 1, 64, dtype=BF16, device=device)
    lses = torch.tensor([[-math.inf, 1.0, math.nan, math.inf],
                         [-math.inf, -math.inf, 0.0, 0.0]], device=device).view(2, 1, 4)
    out, lse = hipflash.merge_attn_states(outs, lses)
    sync(device)
    assert lse[0, 0].item() == -math.inf and (out[0] == 0).all()
    assert lse[0, 1].item() == 1.0 and (out[1] == 1).all()
    assert math.isnan(lse[0, 2].item()) and torch.isnan(out[2].float()).all()
    assert not math.isfinite(lse[0, 3].item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dense", [True, False])
def test_merge_strided_lse_parts(device, dense):
    """LSE parts that are views (a slice of a wider LSE, a transposed one) merge as their
    contiguous copies do, bitwise."""
    g = torch.Generator().manual_seed(9)
    if dense:  # parts [N, B, S, H, D], LSEs [N, B, H, S]
        outs = torch.randn(3, 2, 5, 4, 64, generator=g).to(BF16).to(device)
        wide = torch.randn(3, 2, 4, 10, generator=g).to(device)
        lses = wide[..., ::2]  # every other row: stride 2
    else:  # packed parts [N, T, H, D], LSEs [N, H, T]
        outs = torch.randn(3, 7, 4, 64, generator=g).to(BF16).to(device)
        lses = torch.randn(3, 7, 4, generator=g).to(device).transpose(1, 2)
    assert not lses.is_contiguous()
    out, lse = hipflash.merge_attn_states(outs, lses)
    want_out, want_lse = hipflash.merge_attn_states(outs, lses.contiguous())
    sync(device)
    assert_bitwise_equal(out, want_out, "out")
    assert_bitwise_equal(lse, want_lse, "lse")


# ---- The KV-cache appends PyTorch ops do (attention_chunk, varlen queries, rotary): SPEC §4's
# ---- aliasing rules before the first write, as the launcher's own append keeps them --------


def _cache_case(device, seed=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 1, 4, 64, generator=g).to(BF16).to(device)
    kc = torch.randn(2, 32, 2, 64, generator=g).to(BF16).to(device)
    vc = torch.randn(2, 32, 2, 64, generator=g).to(BF16).to(device)
    kn = torch.randn(2, 1, 2, 64, generator=g).to(BF16).to(device)
    vn = torch.randn(2, 1, 2, 64, generator=g).to(BF16).to(device)
    lens = torch.tensor([3, 20], dtype=torch.int32, device=device)
    return q, kc, vc, kn, vn, lens


ALIASED_APPENDS = {
    # name: (how the call's arguments are bent, the error)
    "v_cache is k_cache": (lambda a: a.update(v_cache=a["k_cache"]), "must not alias"),
    "expanded cache": (lambda a: a.update(k_cache=a["k_cache"][:1].expand(2, 32, 2, 64)),
                       "must not overlap itself"),
    "q inside the cache": (lambda a: a.update(q=a["k_cache"][:, 3:5].view(2, 1, 4, 64)),
                           "must not alias"),
    "new keys inside the cache": (lambda a: a.update(k=a["k_cache"][:, 5:6]), "must not alias"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["attention_chunk", "rotary", "fa3 varlen queries"])
@pytest.mark.parametrize("case", list(ALIASED_APPENDS))
def test_appends_by_pytorch_ops_refuse_aliased_caches(device, path, case):
    # The call is refused with the launcher's message and writes nothing: before the fix these
    # paths appended through the aliases (the key rows took v, sequences wrote each other's
    # rows, q changed under its own call).
    q, kc, vc, kn, vn, lens = _cache_case(device)
    args = dict(q=q, k_cache=kc, v_cache=vc, k=kn, v=vn)
    bend, match = ALIASED_APPENDS[case]
    bend(args)
    before = [t.clone() for t in (kc, vc)]
    with pytest.raises(ValueError, match=match):
        if path == "attention_chunk":
            hipflash.flash_attn_with_kvcache(**args, cache_seqlens=lens, attention_chunk=64)
        elif path == "rotary":
            cos = torch.ones(64, 16, device=device)
            hipflash.flash_attn_with_kvcache(**args, cache_seqlens=lens, rotary_cos=cos,
                                             rotary_sin=torch.zeros_like(cos))
        else:
            import hipflash.compat.flash_attn_interface as fa3
            cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
            fa3.flash_attn_with_kvcache(args["q"].flatten(0, 1), args["k_cache"],
                                        args["v_cache"], args["k"].flatten(0, 1),
                                        args["v"].flatten(0, 1), cache_seqlens=lens,
                                        cu_seqlens_q=cu, cu_seqlens_k_new=cu, max_seqlen_q=1)
    sync(device)
    assert_bitwise_equal(kc, before[0], "k_cache")
    assert_bitwise_equal(vc, before[1], "v_cache")


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_kvcache_checks_its_tables_and_lengths(device):
    # What the call without chunks refuses, the chunked one refuses too (not an IndexError or a
    # silent acceptance).
    q, kc, vc, kn, vn, lens = _cache_case(device)
    kw = dict(k=kn, v=vn, attention_chunk=16)
    pages = kc.view(8, 8, 2, 64), vc.view(8, 8, 2, 64)
    table = torch.arange(8, dtype=torch.int32, device=device).view(2, 4)
    cases = [
        (dict(cache_seqlens=lens, block_table=table.flatten()), ValueError, "block_table"),
        (dict(cache_seqlens=lens, block_table=torch.cat([table, table[:1]])), ValueError,
         "block_table"),
        (dict(cache_seqlens=lens, block_table=table.t().contiguous().t()), ValueError,
         "block_table"),
        (dict(cache_seqlens=torch.tensor([3, 0, 20, 0], dtype=torch.int32,
                                         device=device)[::2], block_table=table),
         ValueError, "cache_seqlens"),
    ]
    for extra, error, match in cases:
        with pytest.raises(error, match=match):
            hipflash.flash_attn_with_kvcache(q, *pages, **kw, **extra)
    with pytest.raises(TypeError, match="dtype"):
        hipflash.flash_attn_with_kvcache(q.half(), kc, vc, k=kn.half(), v=vn.half(),
                                         cache_seqlens=lens, attention_chunk=16)
    with pytest.raises(ValueError, match="rotary_seqlens"):
        hipflash.flash_attn_with_kvcache(q, kc, vc, **kw, cache_seqlens=lens,
                                         rotary_seqlens=lens)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["q", "k"])
def test_chunked_varlen_refuses_maxima_past_the_rows(device, which):
    # Before anything is allocated or written (out= stays as it was).
    q, k, v, cu_q, cu_k = make_varlen([3, 5], [4, 6], 4, 2, 64, BF16, device=device)
    out = torch.full_like(q, float("nan"))
    most = dict(q=[2**40, 6], k=[5, 2**40])[which]
    with pytest.raises(ValueError, match=f"max_seqlen_{which} = .* exceeds the rows"):
        hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, *most, attention_chunk=4, out=out)
    sync(device)
    assert torch.isnan(out.float()).all()


@pytest.mark.parametrize("name", ["softcap", "softmax_scale"])
def test_positive_values_below_float32_are_refused(name):
    # 1e-46 narrows to 0.0f: for the softcap that would be "off", a silently uncapped call.
    q, k, v = make_qkv(1, 4, 4, 2, 2, 64, BF16)
    with pytest.raises(ValueError, match=f"{name} = 1e-46 is below float32"):
        hipflash.flash_attn_func(q, k, v, **{name: 1e-46})


@pytest.mark.parametrize("kind", ["sparse", "quantized"])
def test_tensors_hipflash_cannot_read_are_refused_in_one_line(kind):
    q = torch.zeros(1, 4, 2, 64)
    x = q.to_sparse() if kind == "sparse" else torch.quantize_per_tensor(q, 1.0, 0, torch.qint8)
    with pytest.raises(NotImplementedError, match="hipflash runs on dense") as e:
        hipflash.flash_attn_func(x, x, x)
    assert len(str(e.value)) < 200


def test_merge_of_a_plus_inf_lse_is_nan():
    # SPEC §7: a part whose LSE is +inf (scores that overflowed) merges to NaN, never to a
    # finite value.
    out_a, out_b = torch.ones(1, 2, 3, 8), torch.ones(1, 2, 3, 8)
    lse_a = torch.full((1, 3, 2), float("inf"))
    lse_b = torch.zeros(1, 3, 2)
    out, lse = hipflash.merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert bool(torch.isnan(out).all()) and bool(torch.isnan(lse).all())
