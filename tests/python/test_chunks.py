"""attention_chunk (FlashAttention 3's; Llama 4's chunked attention) against the reference of
SPEC §3 with the chunk mask (reference.valid_mask): the pieces it runs as, the dense, varlen and
KV-cache calls (out and LSE), alone and with causal, windows, GQA, softcap and ALiBi, rows
before the first key, gradients, and what it refuses."""
import itertools
import random

import pytest
import torch

import hipflash
from hipflash import _chunks
from reference import (check_attention, check_lse, check_out, make_qkv, make_varlen,
                       varlen_attention_ref, valid_mask)
from test_backward import DEVICES, assert_flash_rule, grads, torch_attention

BF16 = torch.bfloat16


def test_pieces_tile_the_rows_and_keys_and_keep_the_alignment():
    rng = random.Random(0)
    for _ in range(500):
        sq, sk, chunk = rng.randint(0, 40), rng.randint(0, 40), rng.randint(1, 45)
        ps = _chunks.pieces(sq, sk, chunk)
        assert sum(p[0] for p in ps) == sq and sum(p[1] for p in ps) == sk, (sq, sk, chunk)
        # The pieces' block-diagonal masks (each bottom-right aligned, as the varlen call
        # aligns them) are exactly the chunk mask, causal or not.
        for causal in (False, True):
            want = valid_mask(sq, sk, causal, attention_chunk=chunk)
            got = torch.zeros(sq, sk, dtype=torch.bool)
            i = j = 0
            for nq, nk in ps:
                got[i:i + nq, j:j + nk] = valid_mask(nq, nk, causal)
                i, j = i + nq, j + nk
            assert torch.equal(got, want), (sq, sk, chunk, causal)


MODES = {"full": dict(), "causal": dict(causal=True), "window": dict(window_size=(6, 3)),
         "causal_window": dict(causal=True, window_size=(9, -1))}
SHAPES = [(40, 40), (17, 50), (50, 17), (1, 33), (64, 64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("chunk", [1, 7, 16, 100])
def test_dense_matches_the_reference(device, mode, chunk):
    for b, (sq, sk) in enumerate(SHAPES):
        q, k, v = make_qkv(2, sq, sk, 4, 2, 64, BF16, seed=b)
        kw = dict(MODES[mode], attention_chunk=chunk)
        out, lse = hipflash.flash_attn_func(q.to(device), k.to(device), v.to(device),
                                            return_lse=True, **kw)
        assert out.shape == q.shape and lse.shape == (2, 4, sq) and lse.is_contiguous()
        check_attention(out.cpu(), lse.cpu(), q, k, v, f"sq{sq} sk{sk}", **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_softcap_alibi_and_out(device):
    q, k, v = make_qkv(2, 30, 45, 4, 4, 64, BF16, seed=5)
    slopes = torch.rand(2, 4) * 0.3
    kw = dict(causal=True, attention_chunk=12, softcap=20.0)
    out = torch.full_like(q, float("nan")).to(device)
    got, lse = hipflash.flash_attn_func(q.to(device), k.to(device), v.to(device),
                                        return_lse=True, out=out, alibi_slopes=slopes.to(device),
                                        **kw)
    assert got is out
    check_attention(out.cpu(), lse.cpu(), q, k, v, "softcap+alibi", alibi_slopes=slopes, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lse_layout", ["packed", "padded"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_chunks_each_sequence(device, lse_layout, causal):
    lens_q, lens_k = [5, 0, 33, 20, 1], [5, 12, 33, 9, 40]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 2, 64, BF16, seed=2)
    kw = dict(causal=causal, attention_chunk=8)
    out, lse = hipflash.flash_attn_varlen_func(
        q.to(device), k.to(device), v.to(device), cu_q.to(device), cu_k.to(device),
        max(lens_q), max(lens_k), return_lse=True, lse_layout=lse_layout, **kw)
    ref, ref_packed, ref_padded = varlen_attention_ref(q, k, v, cu_q, cu_k, max(lens_q), **kw)
    low, _, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, max(lens_q), lowp=True, **kw)
    check_out(out.cpu(), ref, low, "varlen")
    check_lse(lse.cpu(), ref_packed if lse_layout == "packed" else ref_padded, "varlen")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lse_layout", ["packed", "padded"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_chunks_with_seqused(device, lse_layout, causal):
    # FA3's seqused_q / seqused_k with attention_chunk: the used rows and keys, packed alone,
    # against the reference; the other rows out 0 and LSE -inf.
    lens_q, lens_k = [5, 0, 33, 20, 1], [5, 12, 33, 9, 40]
    used_q, used_k = [3, 0, 33, 10, 0], [5, 7, 20, 0, 25]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 2, 64, BF16, seed=3)
    kw = dict(causal=causal, attention_chunk=8)
    i32 = lambda n: torch.tensor(n, dtype=torch.int32)  # noqa: E731
    out, lse = hipflash.flash_attn_varlen_func(
        q.to(device), k.to(device), v.to(device), cu_q.to(device), cu_k.to(device),
        max(lens_q), max(lens_k), seqused_q=i32(used_q).to(device),
        seqused_k=i32(used_k).to(device), return_lse=True, lse_layout=lse_layout, **kw)
    out, lse = out.cpu(), lse.cpu()
    rows_q = torch.cat([torch.arange(a, a + u) for a, u in zip(cu_q[:-1].tolist(), used_q)])
    rows_k = torch.cat([torch.arange(a, a + u) for a, u in zip(cu_k[:-1].tolist(), used_k)])
    cu = lambda n: torch.tensor([0] + n).cumsum(0).to(torch.int32)  # noqa: E731
    ref, ref_packed, _ = varlen_attention_ref(q[rows_q], k[rows_k], v[rows_k], cu(used_q),
                                              cu(used_k), max(used_q), **kw)
    low, _, _ = varlen_attention_ref(q[rows_q], k[rows_k], v[rows_k], cu(used_q), cu(used_k),
                                     max(used_q), lowp=True, **kw)
    check_out(out[rows_q], ref, low, "used rows")
    unused = torch.ones(q.shape[0], dtype=torch.bool)
    unused[rows_q] = False
    assert (out[unused] == 0).all(), "an unused row was written"
    packed = lse if lse_layout == "packed" else torch.cat(
        [lse[b, :, :n] for b, n in enumerate(lens_q)], dim=1)
    check_lse(packed[:, rows_q], ref_packed, "used rows")
    assert torch.isneginf(packed[:, unused]).all()
    with pytest.raises(ValueError, match=r"seqused_k\[3\] = 10 must be in \[0, 9\]"):
        hipflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                        seqused_k=i32([5, 7, 20, 10, 25]), **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [(33, 33, True, 8), (20, 50, False, 16), (45, 30, True, 10)],
                         ids=lambda c: f"sq{c[0]}_sk{c[1]}_c{int(c[2])}_chunk{c[3]}")
def test_gradients_match_fp64_autograd(device, case):
    sq, sk, causal, chunk = case
    q, k, v = make_qkv(2, sq, sk, 4, 2, 64, BF16, seed=4)
    dout = torch.randn(2, sq, 4, 64, generator=torch.Generator().manual_seed(9)).to(BF16)
    ref = dict(causal=causal, attention_chunk=chunk)
    _, g64 = grads(lambda *a: torch_attention(*a, torch.float64, **ref), q, k, v, dout)
    _, glp = grads(lambda *a: torch_attention(*a, BF16, **ref), q, k, v, dout, device)
    _, ghf = grads(lambda *a: hipflash.flash_attn_func(*a, **ref), q, k, v, dout, device)
    for name, ours, low, want in zip("qkv", ghf, glp, g64):
        assert_flash_rule(name, ours, low, want)


def test_refusals():
    q, k, v = make_qkv(1, 8, 8, 2, 2, 64, BF16)
    with pytest.raises(ValueError, match="attention_chunk"):
        hipflash.flash_attn_func(q, k, v, attention_chunk=-1)
    # Per-sequence slopes for another batch: a piece takes its sequence's row, so the rows must
    # be the sequences' (not silently the first ones); nothing written.
    out = torch.full_like(q, float("nan"))
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \[batch = 1, 2\]"):
        hipflash.flash_attn_func(q, k, v, attention_chunk=4, alibi_slopes=torch.ones(2, 2),
                                 out=out)
    assert out.isnan().all()
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="attention_chunk"):
        hipflash.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, attention_chunk=4,
                                        block_table=torch.zeros(1, 1, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page", [0, 1, 16], ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("mode", ["causal", "causal_window"])
@pytest.mark.parametrize("leftpad", [False, True], ids=["", "leftpad"])
def test_kvcache_appends_then_chunks_each_sequence(device, page, mode, leftpad):
    """flash_attn_with_kvcache with attention_chunk: k / v land at cache_seqlens[b], then each
    sequence's query rows see their chunk of its keys (from its leftpad row): out and LSE
    against the reference on the keys gathered, and the cache's other rows untouched."""
    g = torch.Generator().manual_seed(3)
    batch, sq, snew, hq, hkv, d, cap, chunk = 3, 6, 4, 4, 2, 64, 48, 5
    lens, pads = [10, 0, 30], ([3, 0, 17] if leftpad else [0, 0, 0])
    kc = torch.randn(batch, cap, hkv, d, generator=g).to(BF16)
    vc = torch.randn(batch, cap, hkv, d, generator=g).to(BF16)
    q = torch.randn(batch, sq, hq, d, generator=g).to(BF16)
    k = torch.randn(batch, snew, hkv, d, generator=g).to(BF16)
    v = torch.randn(batch, snew, hkv, d, generator=g).to(BF16)
    kw = dict(MODES[mode], attention_chunk=chunk)
    table = None
    caches = kc.clone(), vc.clone()
    if page:  # the same rows in pages, shuffled
        per = cap // page
        perm = torch.randperm(batch * per, generator=g)
        caches = tuple(torch.empty(batch * per, page, hkv, d, dtype=BF16) for _ in range(2))
        for c, src in zip(caches, (kc, vc)):
            c[perm] = src.reshape(batch * per, page, hkv, d)
        table = perm.view(batch, per).to(torch.int32).to(device)
    caches = tuple(c.to(device) for c in caches)
    out, lse = hipflash.flash_attn_with_kvcache(
        q.to(device), *caches, k.to(device), v.to(device),
        torch.tensor(lens, dtype=torch.int32, device=device), block_table=table,
        cache_leftpad=torch.tensor(pads, dtype=torch.int32, device=device) if leftpad else None,
        return_lse=True, **kw)
    got_k = caches[0].cpu()
    if page:
        got_k = got_k[table.cpu().long()].reshape(batch, cap, hkv, d)
    for b in range(batch):
        keys = torch.cat([kc[b, pads[b]:lens[b]], k[b]])[None]
        vals = torch.cat([vc[b, pads[b]:lens[b]], v[b]])[None]
        check_attention(out[b:b + 1].cpu(), lse[b:b + 1].cpu(), q[b:b + 1], keys, vals,
                        f"sequence {b}", **kw)
        assert torch.equal(got_k[b, lens[b]:lens[b] + snew], k[b]), f"appended rows {b}"
        assert torch.equal(got_k[b, :lens[b]], kc[b, :lens[b]]), f"cached rows {b}"


@pytest.mark.parametrize("device", DEVICES)
def test_fa3_compat_takes_attention_chunk(device):
    import hipflash.compat.flash_attn_interface as fa3
    q, k, v = (t.to(device) for t in make_qkv(2, 20, 20, 4, 2, 64, BF16, seed=6))
    out, lse = fa3.flash_attn_func(q, k, v, causal=True, attention_chunk=6,
                                   return_attn_probs=True)
    check_attention(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), "fa3", causal=True,
                    attention_chunk=6)
    with pytest.raises(NotImplementedError, match="head dim"):
        fa3.flash_attn_func(q, k, torch.zeros(2, 20, 2, 128, dtype=BF16, device=device))


# Refused calls with attention_chunk (or FA3's varlen kvcache call, the same path) leave the
# cache as it was, and the checks the pieces cannot make are made for the call.
def _appending(device):
    g = torch.Generator().manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, BF16)
    return (rand(2, 1, 4, 64), rand(2, 32, 2, 64), rand(2, 32, 2, 64), rand(2, 3, 2, 64),
            rand(2, 3, 2, 64), torch.tensor([20, 5], dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", ["alibi_shape", "softcap", "num_splits", "window"])
def test_a_refused_chunked_append_leaves_the_cache(device, bad):
    q, k_cache, v_cache, k, v, seqlens = _appending(device)
    kw = {"alibi_shape": dict(alibi_slopes=torch.rand(9, device=device)),
          "softcap": dict(softcap=-1.0), "num_splits": dict(num_splits=1000),
          "window": dict(window_size=(-2, 0))}[bad]
    k0, v0 = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError):
        hipflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                         attention_chunk=4, **kw)
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


@pytest.mark.parametrize("device", DEVICES)
def test_appending_twice_to_one_cache_entry_is_refused(device):
    q, k_cache, v_cache, k, v, seqlens = _appending(device)
    k0 = k_cache.clone()
    twice = torch.tensor([1, 1], dtype=torch.int32, device=device)
    for chunk in (0, 4):
        with pytest.raises(ValueError, match="twice"):
            hipflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                             cache_batch_idx=twice, attention_chunk=chunk)
    assert torch.equal(k_cache, k0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", ["rotary_shapes", "rotary_dim", "rotary_seqlens",
                                 "cache_seqlens"])
def test_chunked_append_names_what_is_wrong(device, bad):
    # The chunked path (attention_chunk > 0) refuses with the plain path's messages: rotary
    # tables of two shapes or wider than the head, negative rotary positions, a negative cached
    # length (not "must fit its cache"); the cache is left as it was.
    q, k_cache, v_cache, k, v, seqlens = _appending(device)
    cos = torch.rand(64, 16, device=device)
    bad_kw, match = {
        "rotary_shapes": (dict(rotary_cos=cos, rotary_sin=cos[:, :8]), "one shape"),
        "rotary_dim": (dict(rotary_cos=torch.rand(64, 40, device=device),
                            rotary_sin=torch.rand(64, 40, device=device)), "rotary_dim"),
        "rotary_seqlens": (dict(rotary_cos=cos, rotary_sin=cos, rotary_seqlens=torch.tensor(
            [-1, 3], dtype=torch.int32, device=device)), "rotary positions must be >= 0"),
        "cache_seqlens": (dict(), "cache_seqlens"),
    }[bad]
    if bad == "cache_seqlens":
        seqlens = torch.tensor([-3, 5], dtype=torch.int32, device=device)
    k0, v0 = k_cache.clone(), v_cache.clone()
    for chunk in (0, 4):
        with pytest.raises(ValueError, match=match):
            hipflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                             attention_chunk=chunk, **bad_kw)
        assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


@pytest.mark.parametrize("device", DEVICES)
def test_fa3_varlen_kvcache_refusal_leaves_the_cache(device):
    from hipflash.compat import flash_attn_interface as fa3
    _, k_cache, v_cache, _, _, _ = _appending(device)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(4, 4, 64, generator=g).to(device, BF16)  # packed: 2 + 2 query rows
    k, v = (torch.randn(3, 2, 64, generator=g).to(device, BF16) for _ in range(2))
    args = dict(cache_seqlens=torch.tensor([5, 6], dtype=torch.int32, device=device),
                cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32, device=device),
                cu_seqlens_k_new=torch.tensor([0, 1, 3], dtype=torch.int32, device=device))
    k0 = k_cache.clone()
    for bad in (dict(max_seqlen_q=1), dict(max_seqlen_q=2, softcap=-1.0)):
        with pytest.raises(ValueError):
            fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **args, **bad)
        assert torch.equal(k_cache, k0)


@pytest.mark.parametrize("bad", ["max_seqlen_k", "int64"])
def test_chunked_varlen_checks_its_bounds(bad):
    q, k, v = (torch.randn(n, 4, 64).to(BF16) for n in (8, 16, 16))
    cu_q = torch.tensor([0, 3, 8, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 7, 16], dtype=torch.int32)  # the longest: 9 keys
    args = (cu_q, cu_k, 5, 8) if bad == "max_seqlen_k" else (cu_q.long(), cu_k.long(), 5, 9)
    for chunk in (0, 4):
        with pytest.raises(ValueError, match="too small" if bad == "max_seqlen_k" else "int32"):
            hipflash.flash_attn_varlen_func(q, k, v, *args, attention_chunk=chunk)


def test_chunked_calls_name_the_callers_shapes_in_their_errors():
    # The pieces are calls of their own: a per-sequence argument of the wrong width is refused
    # with the caller's batch and heads, not the pieces' (2 sequences here, 6 pieces).
    q, k, v = make_qkv(2, 12, 12, 4, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \[batch = 2, 4\] or "
                                         r"\[4\], got \[2, 3\]"):
        hipflash.flash_attn_func(q, k, v, attention_chunk=4, alibi_slopes=torch.ones(2, 3))
    # No query heads: an empty result, as without chunks (not reshape's error).
    out = hipflash.flash_attn_func(q[:, :, :0], k, v, attention_chunk=4)
    assert out.shape == (2, 12, 0, 64)
