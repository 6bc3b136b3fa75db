"""hipflash.flash_attn_with_kvcache (SPEC §7) on CPU tensors: a paged cache gives bitwise the
result of a contiguous cache holding the same rows; append + attend against the reference of
SPEC §3; bad block tables refused before anything is written; the operator."""
import pytest
import torch

import hipflash
from reference import assert_bitwise_equal, check_attention


def make_cache(lens, capacity, hkv, d, dtype, page, seed=0):
    """A contiguous cache [B, capacity, Hkv, D] with NaN past each sequence's keys, and a paged
    copy [num_blocks, page, Hkv, D] (pages shuffled, spare pages NaN) with its block table."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    k = torch.full((b, capacity, hkv, d), float("nan"), dtype=dtype)
    v = torch.full_like(k, float("nan"))
    for i, n in enumerate(lens):
        k[i, :n] = torch.randn(n, hkv, d, generator=g).to(dtype)
        v[i, :n] = torch.randn(n, hkv, d, generator=g).to(dtype)
    max_blocks = capacity // page
    blocks = b * max_blocks + 3
    ids = torch.randperm(blocks, generator=g)[: b * max_blocks].reshape(b, max_blocks).to(torch.int32)
    k_pages = torch.full((blocks, page, hkv, d), float("nan"), dtype=dtype)
    v_pages = torch.full_like(k_pages, float("nan"))
    for i in range(b):
        for e in range(max_blocks):
            k_pages[ids[i, e]] = k[i, e * page:(e + 1) * page]
            v_pages[ids[i, e]] = v[i, e * page:(e + 1) * page]
    return k, v, k_pages, v_pages, ids


def check_per_sequence(out, lse, q, k_cache, v_cache, lens, **kw):
    for i, n in enumerate(lens):
        check_attention(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k_cache[i:i + 1, :n],
                        v_cache[i:i + 1, :n], what=f"sequence {i}", **kw)


@pytest.mark.parametrize("append", [0, 3], ids=["attend", "append3"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=lambda h: f"h{h[0]}_{h[1]}")
@pytest.mark.parametrize("page", [16, 64, 256])
def test_paged_equals_contiguous_bitwise(page, heads, causal, append):
    hq, hkv = heads
    lens = [2 * page + 5, 0, page, 17]
    capacity = ((max(lens) + append + page - 1) // page) * page
    k, v, k_pages, v_pages, table = make_cache(lens, capacity, hkv, 64, torch.bfloat16, page)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 2, hq, 64, generator=g).bfloat16()
    k_new = torch.randn(4, append, hkv, 64, generator=g).bfloat16() if append else None
    v_new = torch.randn(4, append, hkv, 64, generator=g).bfloat16() if append else None
    seqlens = torch.tensor(lens, dtype=torch.int32)
    kw = dict(causal=causal, num_splits=2, return_lse=True)
    out_c, lse_c = hipflash.flash_attn_with_kvcache(q, k, v, k_new, v_new, seqlens, **kw)
    out_p, lse_p = hipflash.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, seqlens,
                                                    block_table=table, **kw)
    assert_bitwise_equal(out_p, out_c, "out")
    assert_bitwise_equal(lse_p, lse_c, "lse")
    total = [n + append for n in lens]
    check_per_sequence(out_c, lse_c, q, k, v, total, causal=causal)
    if append == 0:
        assert (lse_c[1] == float("-inf")).all()  # the empty sequence: no key, LSE -inf
    if append:  # the new rows landed at cache_seqlens[b] in both layouts, the rest untouched
        for i, n in enumerate(lens):
            assert torch.equal(k[i, n:n + append], k_new[i]) and torch.equal(v[i, n:n + append], v_new[i])
            for j in range(append):
                pos = n + j
                assert torch.equal(k_pages[table[i, pos // page], pos % page], k_new[i, j])
            assert torch.isnan(k[i, n + append:].float()).all()


def test_window_and_long_query_chunk():
    lens, page = [5, 100, 0], 16
    k, v, k_pages, v_pages, table = make_cache(lens, 128, 2, 64, torch.float16, page, seed=2)
    q = torch.randn(3, 40, 6, 64).half()
    k_new, v_new = torch.randn(3, 8, 2, 64).half(), torch.randn(3, 8, 2, 64).half()
    kw = dict(causal=True, window_size=(20, -1), return_lse=True)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out_p, lse_p = hipflash.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, seqlens,
                                                    block_table=table, **kw)
    out_c, lse_c = hipflash.flash_attn_with_kvcache(q, k, v, k_new, v_new, seqlens, **kw)
    assert_bitwise_equal(out_p, out_c, "out")
    assert_bitwise_equal(lse_p, lse_c, "lse")
    check_per_sequence(out_c, lse_c, q, k, v, [n + 8 for n in lens], causal=True,
                       window_size=(20, -1))


def test_int_and_missing_cache_seqlens():
    k, v, k_pages, v_pages, table = make_cache([32, 32], 32, 2, 64, torch.bfloat16, 16)
    q = torch.randn(2, 1, 4, 64).bfloat16()
    a = hipflash.flash_attn_with_kvcache(q, k_pages, v_pages, block_table=table)
    b = hipflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=32)
    c = hipflash.flash_attn_with_kvcache(q, k, v)
    assert_bitwise_equal(a, b)
    assert_bitwise_equal(b, c)
    assert_bitwise_equal(c, hipflash.flash_attn_func(q, k, v))


def test_bad_calls_write_nothing():
    k, v, k_pages, v_pages, table = make_cache([20, 40], 48, 2, 64, torch.bfloat16, 16)
    q = torch.randn(2, 1, 4, 64).bfloat16()
    k_new, v_new = torch.randn(2, 2, 2, 64).bfloat16(), torch.randn(2, 2, 2, 64).bfloat16()
    lens = torch.tensor([20, 40], dtype=torch.int32)
    before = k_pages.clone()

    def call(kp=k_pages, vp=v_pages, bt=table, sl=lens, **kw):
        return hipflash.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, sl, block_table=bt, **kw)

    for bad in (8, 24, 512):
        with pytest.raises(ValueError, match=r"power of two in \[16, 256\]"):
            call(kp=torch.zeros(4, bad, 2, 64).bfloat16(), vp=torch.zeros(4, bad, 2, 64).bfloat16())
    bt = table.clone()
    bt[1, 2] = k_pages.shape[0]
    with pytest.raises(ValueError, match="is not a page of the cache"):
        call(bt=bt)
    with pytest.raises(ValueError, match="needs"):
        call(sl=torch.tensor([20, 47], dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        call(bt=table.long())
    with pytest.raises(ValueError, match="int32"):
        call(sl=lens.long())
    with pytest.raises(ValueError, match="one row per sequence"):
        call(bt=table[:1])
    with pytest.raises(ValueError, match="together"):
        hipflash.flash_attn_with_kvcache(q, k, v, k_new, None, lens)
    assert torch.equal(k_pages.view(torch.int16), before.view(torch.int16))
    bt = table.clone()
    bt[0, 2] = -1  # sequence 0 uses ceil(22 / 16) = 2 entries: the third is never read
    out = call(bt=bt)
    assert torch.isfinite(out.float()).all()


def test_requires_grad_is_refused_and_caches_are_bumped():
    k, v, k_pages, v_pages, table = make_cache([3], 16, 1, 64, torch.bfloat16, 16)
    q = torch.randn(1, 1, 2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="no backward"):
        hipflash.flash_attn_with_kvcache(q.requires_grad_(), k, v, cache_seqlens=3)
    q = q.detach()
    version = k._version
    hipflash.flash_attn_with_kvcache(q, k, v, torch.randn(1, 1, 1, 64).bfloat16(),
                                     torch.randn(1, 1, 1, 64).bfloat16(), cache_seqlens=3)
    assert k._version > version


@pytest.mark.skipif(not (torch.cuda.is_available() and hipflash.gpu_available()),
                    reason="needs a GPU visible to torch and a hipflash built with GPU kernels")
def test_cuda_tensors_are_not_implemented_yet():
    k, v, k_pages, v_pages, table = make_cache([3], 16, 1, 64, torch.bfloat16, 16)
    q = torch.randn(1, 1, 2, 64).bfloat16()
    with pytest.raises(NotImplementedError, match="CPU tensors"):
        hipflash.flash_attn_with_kvcache(q.cuda(), k_pages.cuda(), v_pages.cuda(),
                                         cache_seqlens=torch.tensor([3], dtype=torch.int32).cuda(),
                                         block_table=table.cuda())
