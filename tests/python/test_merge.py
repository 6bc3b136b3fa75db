"""hipflash.merge_attn_states (SPEC §7): attention over disjoint key sets merged by their LSEs
equals the attention over all keys; both layouts, N-way, empty parts, NaN, the operator."""
import math

import pytest
import torch

import hipflash
from reference import check_attention, check_lse, make_qkv, make_varlen


def parts(q, k, v, cuts, **kw):
    """(outs, lses) of the dense forward over each key range [cuts[i], cuts[i+1])."""
    res = [hipflash.flash_attn_func(q, k[:, a:b], v[:, a:b], return_lse=True, **kw)
           for a, b in zip(cuts[:-1], cuts[1:])]
    return [o for o, _ in res], [l for _, l in res]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_halves_equal_the_unsplit_attention(dtype):
    q, k, v = make_qkv(2, 37, 300, 4, 2, 64, dtype, seed=1)
    (oa, ob), (la, lb) = parts(q, k, v, [0, 150, 300])
    out, lse = hipflash.merge_attn_states(oa, la, ob, lb)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, 4, 37)
    check_attention(out, lse, q, k, v)
    _, lse_full = hipflash.flash_attn_func(q, k, v, return_lse=True)
    assert (lse - lse_full).abs().max().item() <= 1e-4


def test_n_way_stacked():
    q, k, v = make_qkv(1, 20, 500, 2, 1, 64, torch.bfloat16, seed=2)
    outs, lses = parts(q, k, v, [0, 64, 100, 101, 380, 500])
    out, lse = hipflash.merge_attn_states(torch.stack(outs), torch.stack(lses))
    check_attention(out, lse, q, k, v)


def test_packed_layout_of_varlen():
    # Two key halves of each sequence as two varlen calls with packed LSEs [H, total_q].
    q, k, v, cq, ck = make_varlen([3, 40], [50, 70], 4, 2, 64, torch.bfloat16, seed=3)
    ka, kb = torch.cat([k[0:25], k[50:85]]), torch.cat([k[25:50], k[85:120]])
    va, vb = torch.cat([v[0:25], v[50:85]]), torch.cat([v[25:50], v[85:120]])
    ck2 = torch.tensor([0, 25, 60], dtype=torch.int32)
    oa, la = hipflash.flash_attn_varlen_func(q, ka, va, cq, ck2, 40, 35, return_lse=True, lse_layout="packed")
    ob, lb = hipflash.flash_attn_varlen_func(q, kb, vb, cq, ck2, 40, 35, return_lse=True, lse_layout="packed")
    out, lse = hipflash.merge_attn_states(oa, la, ob, lb)
    full, lse_full = hipflash.flash_attn_varlen_func(q, k, v, cq, ck, 40, 70, return_lse=True, lse_layout="packed")
    assert lse.shape == (4, 43)
    assert (lse - lse_full).abs().max().item() <= 1e-4
    assert (out.float() - full.float()).abs().max().item() <= 2e-2


def test_empty_parts_and_nan():
    out_a = torch.full((3, 1, 4), float("nan"))
    out_b = torch.arange(12, dtype=torch.float32).reshape(3, 1, 4)
    lse_a = torch.tensor([[float("-inf"), float("-inf"), float("nan")]])
    lse_b = torch.tensor([[0.5, float("-inf"), 0.0]])
    out, lse = hipflash.merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[0], out_b[0]) and lse[0, 0].item() == 0.5      # part a empty
    assert torch.equal(out[1], torch.zeros(1, 4)) and lse[0, 1].item() == float("-inf")  # both
    assert torch.isnan(out[2]).all() and math.isnan(lse[0, 2].item())     # NaN lse


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available()
                                               and hipflash.gpu_available() else []))
def test_weights_that_underflow_still_multiply(device):
    # Finite LSEs any distance apart, up to fp32's range: the lower part's weight is 0, and
    # that 0 still multiplies its out, so its NaN reaches the merged out (0 x NaN is NaN). Two
    # parts, and four stacked ones with the NaN part last (the GPU kernel's second batch).
    for lse_a, lse_b in ((100.0, -100.0), (2e38, -2e38), (3.4e38, -3.4e38), (0.0, -3.4e38)):
        for parts in (2, 4):
            outs = torch.zeros(parts, 2, 1, 64, device=device)
            outs[-1, :, 0, 0] = float("nan")
            lses = torch.full((parts, 1, 2), lse_a, device=device)
            lses[-1] = lse_b
            out, lse = (hipflash.merge_attn_states(outs[0], lses[0], outs[1], lses[1])
                        if parts == 2 else hipflash.merge_attn_states(outs, lses))
            assert torch.isnan(out[:, 0, 0]).all() and torch.count_nonzero(out[:, 0, 1:]) == 0
            want = torch.logsumexp(lses.double(), 0).float()
            assert torch.equal(lse, want), (lse_a, lse_b, parts, lse)


def test_requires_grad_and_bad_calls():
    o = torch.zeros(2, 3, 1, 8)
    l = torch.zeros(2, 1, 2)
    with pytest.raises(ValueError, match="does not match outs"):
        hipflash.merge_attn_states(o, l)
    with pytest.raises(RuntimeError, match="no backward yet"):
        hipflash.merge_attn_states(o.requires_grad_(), torch.zeros(2, 1, 3))
    with pytest.raises(ValueError, match="takes"):
        hipflash.merge_attn_states(o, l, o)


def test_mismatched_parts_are_refused():
    oa, ob = torch.randn(2, 3, 1, 64), torch.randn(2, 3, 1, 64)
    la, lb = torch.randn(2, 1, 3), torch.randn(2, 1, 3)
    with pytest.raises(ValueError, match="lses must have shape"):  # a [B*S]-compatible mix-up
        hipflash.merge_attn_states(oa, la.permute(2, 1, 0).contiguous(), ob, lb.permute(2, 1, 0).contiguous())
    with pytest.raises(TypeError, match="one dtype"):
        hipflash.merge_attn_states(oa.bfloat16(), la, ob.half(), lb)
