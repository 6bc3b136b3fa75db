"""hipflash.flash_attn_with_kvcache (SPEC §7) on CPU tensors: a paged cache gives bitwise the
result of a contiguous cache holding the same rows; append + attend against the reference of
SPEC §3; bad block tables refused before anything is written; the operator; chunked prefill (varlen queries against a paged cache, flash_attn_varlen_func
with a block_table) against the same keys packed contiguously."""
import pytest
import torch

import hipflash
from reference import assert_bitwise_equal, check_attention, head_major
from reference import check_kv_per_sequence as check_per_sequence
from reference import make_chunked_prefill
from reference import make_kv_cache as make_cache


def assert_kvcache_equals_dense_per_sequence(paged, kw, cache_kw=None, sequence_kw=None):
    """Decode (one query row, bf16) against caches of 7 and 16 keys, contiguous or paged (a page
    of 16 rows a sequence): bitwise each sequence's dense call on its own keys. kw: options of
    both calls; cache_kw: of the cache call only; sequence_kw(i): of sequence i's dense call
    only (e.g. its row of per-batch ALiBi slopes)."""
    torch.manual_seed(2)
    b, hq, hkv, d, cap = 2, 4, 2, 64, 16
    q = torch.randn(b, 1, hq, d).to(torch.bfloat16)
    k_cache = torch.randn(b, cap, hkv, d).to(torch.bfloat16)
    v_cache = torch.randn(b, cap, hkv, d).to(torch.bfloat16)
    lens = torch.tensor([7, 16], dtype=torch.int32)
    table = torch.arange(b, dtype=torch.int32)[:, None] if paged else None
    out, lse = hipflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                                block_table=table, return_lse=True, **kw,
                                                **(cache_kw or {}))
    for i in range(b):
        n = int(lens[i])
        want, want_lse = hipflash.flash_attn_func(q[i:i + 1], k_cache[i:i + 1, :n],
                                                  v_cache[i:i + 1, :n], return_lse=True, **kw,
                                                  **(sequence_kw(i) if sequence_kw else {}))
        assert_bitwise_equal(out[i:i + 1], want, f"sequence {i}")
        assert_bitwise_equal(lse[i:i + 1], want_lse, f"sequence {i} lse")


@pytest.mark.parametrize("append", [0, 3], ids=["attend", "append3"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=lambda h: f"h{h[0]}_{h[1]}")
@pytest.mark.parametrize("page", [1, 3, 16, 17, 64, 256])  # any page size on the CPU
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


@pytest.mark.parametrize("append", [0, 3], ids=["attend", "append3"])
@pytest.mark.parametrize("page", [0, 16, 64], ids=lambda p: f"page{p}" if p else "contiguous")
def test_head_major_cache_equals_row_major_bitwise(page, append):
    """A head-major cache (contiguous [B, Hkv, S, D] or pages [num_blocks, Hkv, page, D]) passed
    as a [.., S or page, Hkv, D] view: the same out and LSE, bitwise, as the row-major cache
    holding the same rows, and the appended rows land in the head-major storage."""
    lens = [2 * 16 + 5, 0, 16, 17]
    pg = page or 16
    capacity = ((max(lens) + append + pg - 1) // pg) * pg
    k, v, k_pages, v_pages, table = make_cache(lens, capacity, 2, 64, torch.bfloat16, pg)
    if not page:
        k_pages, v_pages, table = k, v, None
    k_hm, v_hm = head_major(k_pages), head_major(v_pages)
    assert k_hm.stride(2) > k_hm.stride(1)  # the heads are the outer dimension of the rows
    g = torch.Generator().manual_seed(4)
    q = torch.randn(4, 2, 8, 64, generator=g).bfloat16()
    k_new = torch.randn(4, append, 2, 64, generator=g).bfloat16() if append else None
    v_new = torch.randn(4, append, 2, 64, generator=g).bfloat16() if append else None
    seqlens = torch.tensor(lens, dtype=torch.int32)
    kw = dict(causal=True, num_splits=2, return_lse=True, block_table=table)
    out, lse = hipflash.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, seqlens, **kw)
    out_hm, lse_hm = hipflash.flash_attn_with_kvcache(q, k_hm, v_hm, k_new, v_new, seqlens, **kw)
    assert_bitwise_equal(out_hm, out, "out")
    assert_bitwise_equal(lse_hm, lse, "lse")
    for a, b in ((k_hm, k_pages), (v_hm, v_pages)):  # appended alike; NaN past the lengths
        assert_bitwise_equal(a.contiguous(), b, "cache")


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

    with pytest.raises(ValueError, match="must be >= 1"):
        call(kp=torch.zeros(4, 0, 2, 64).bfloat16(), vp=torch.zeros(4, 0, 2, 64).bfloat16())
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


# ---- Chunked prefill: varlen queries against a paged cache (flash_attn_varlen_func) ----------


@pytest.mark.parametrize("lse_layout", ["padded", "packed"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=lambda h: f"h{h[0]}_{h[1]}")
@pytest.mark.parametrize("page", [1, 5, 16, 64])
def test_chunked_prefill_equals_packed_keys_bitwise(page, heads, causal, splits, lse_layout):
    q, cu_q, cu_k, mq, mk, k_pages, v_pages, table, k_packed, v_packed = \
        make_chunked_prefill(page, *heads)
    kw = dict(causal=causal, num_splits=splits, return_lse=True, lse_layout=lse_layout)
    out_p, lse_p = hipflash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, mq, mk,
                                                   block_table=table, **kw)
    out_c, lse_c = hipflash.flash_attn_varlen_func(q, k_packed, v_packed, cu_q, cu_k, mq, mk, **kw)
    assert_bitwise_equal(out_p, out_c, "out")
    assert_bitwise_equal(lse_p, lse_c, "lse")
    # and the packed call against the reference, sequence by sequence
    for b in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if qs.stop == qs.start:
            continue
        lse_b = (lse_c[:, qs] if lse_layout == "packed" else lse_c[b, :, :qs.stop - qs.start])
        lse_b = lse_b.contiguous()
        check_attention(out_c[qs][None], lse_b[None], q[qs][None], k_packed[ks][None],
                        v_packed[ks][None], causal=causal)


def test_chunked_prefill_bad_calls_are_refused():
    q, cu_q, cu_k, mq, mk, k_pages, v_pages, table, _, _ = make_chunked_prefill(16, 4, 4)

    def call(**over):
        args = dict(q=q, k=k_pages, v=v_pages, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    max_seqlen_q=mq, max_seqlen_k=mk, block_table=table)
        args.update(over)
        return hipflash.flash_attn_varlen_func(**args)

    bad = table.clone()
    bad[0, 1] = k_pages.shape[0]  # a page that does not exist, inside sequence 0's keys
    with pytest.raises(ValueError, match="is not a page of the cache"):
        call(block_table=bad)
    long_k = cu_k.clone()
    long_k[1:] += 1000  # sequence 0 longer than its pages
    with pytest.raises(ValueError, match="cache holds"):
        call(cu_seqlens_k=long_k, max_seqlen_k=mk + 1000)
    with pytest.raises(ValueError, match="page size .* must be >= 1"):
        call(k=k_pages[:, :0], v=v_pages[:, :0])
    with pytest.raises(ValueError, match="block_table must have one row per sequence"):
        call(block_table=table[:2])
    with pytest.raises(ValueError, match="out= is not supported"):
        call(out=torch.empty_like(q))
    with pytest.raises(RuntimeError, match="no backward yet"):
        call(q=q.clone().requires_grad_())


GPU_OK = torch.cuda.is_available() and hipflash.gpu_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not GPU_OK, reason="needs a GPU visible to torch and a hipflash built with GPU kernels "
    f"(this build: {hipflash.build_info()!r})"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sq", [3, 40], ids=["decode", "generic"])
def test_cache_batch_idx_reads_and_appends_the_named_entries(device, sq):
    # FlashAttention's cache_batch_idx: a contiguous cache of 3 entries, 2 sequences reading
    # entries 2 and 0 — bitwise the call on a cache of those entries; the appends land there.
    # (A paged cache: test_cache_batch_idx_picks_block_table_rows.)
    import hipflash.compat.flash_attn as fa2
    import hipflash.compat.flash_attn_interface as fa3
    torch.manual_seed(6)
    bf16 = torch.bfloat16
    q = torch.randn(2, sq, 4, 64).to(bf16).to(device)
    k_cache = torch.randn(3, 80, 2, 64).to(bf16).to(device)
    v_cache = torch.randn(3, 80, 2, 64).to(bf16).to(device)
    k_new = torch.randn(2, 2, 2, 64).to(bf16).to(device)
    v_new = torch.randn(2, 2, 2, 64).to(bf16).to(device)
    lens = torch.tensor([17, 30], dtype=torch.int32, device=device)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=device)
    kw = dict(cache_seqlens=lens, causal=True, return_lse=True)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = hipflash.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_batch_idx=idx, **kw)
    ks, vs = k_cache[idx.long()].clone(), v_cache[idx.long()].clone()
    want, want_lse = hipflash.flash_attn_with_kvcache(q, ks, vs, k_new, v_new, **kw)
    assert_bitwise_equal(out, want, "out")
    assert_bitwise_equal(lse, want_lse, "lse")
    assert_bitwise_equal(kc[idx.long()], ks, "appended k entries")
    assert_bitwise_equal(vc[idx.long()], vs, "appended v entries")
    assert_bitwise_equal(kc[1], k_cache[1], "entry 1 untouched")
    for mod in (fa2, fa3):  # the compatibility modules pass it through
        got = mod.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new,
                                          cache_seqlens=lens, cache_batch_idx=idx, causal=True)
        assert_bitwise_equal(got, want, mod.__name__)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sq", [3, 40], ids=["decode", "generic"])
def test_cache_batch_idx_picks_block_table_rows(device, sq):
    # FlashAttention 3's cache_batch_idx with a page table: sequence b reads and appends through
    # row cache_batch_idx[b] of a table with more rows than sequences — bitwise the call with
    # those rows gathered; the appends land in those rows' pages.
    import hipflash.compat.flash_attn_interface as fa3
    g = torch.Generator().manual_seed(8)
    bf16, page = torch.bfloat16, 16
    q = torch.randn(2, sq, 4, 64, generator=g).to(bf16).to(device)
    k_pages = torch.randn(15, page, 2, 64, generator=g).to(bf16).to(device)
    v_pages = torch.randn(15, page, 2, 64, generator=g).to(bf16).to(device)
    k_new = torch.randn(2, 2, 2, 64, generator=g).to(bf16).to(device)
    v_new = torch.randn(2, 2, 2, 64, generator=g).to(bf16).to(device)
    table = torch.randperm(15, generator=g).to(torch.int32).reshape(3, 5).to(device)
    lens = torch.tensor([17, 50], dtype=torch.int32, device=device)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=device)
    kw = dict(cache_seqlens=lens, causal=True, return_lse=True)
    kc, vc = k_pages.clone(), v_pages.clone()
    out, lse = hipflash.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, block_table=table,
                                                cache_batch_idx=idx, **kw)
    ks, vs = k_pages.clone(), v_pages.clone()
    want, want_lse = hipflash.flash_attn_with_kvcache(q, ks, vs, k_new, v_new,
                                                      block_table=table[idx.long()], **kw)
    assert_bitwise_equal(out, want, "out")
    assert_bitwise_equal(lse, want_lse, "lse")
    assert_bitwise_equal(kc, ks, "k pages after the append")
    assert_bitwise_equal(vc, vs, "v pages after the append")
    assert not torch.equal(kc, k_pages), "nothing was appended"
    got = fa3.flash_attn_with_kvcache(q, k_pages.clone(), v_pages.clone(), k_new, v_new,
                                      cache_seqlens=lens, cache_batch_idx=idx, page_table=table,
                                      causal=True)
    assert_bitwise_equal(got, want, "flash_attn_interface")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sq", [1, 40], ids=["decode", "generic"])
@pytest.mark.parametrize("page", [0, 16, 6], ids=["contiguous", "paged16", "paged6"])
def test_cache_leftpad_equals_the_call_on_the_shifted_cache(device, sq, page):
    # FlashAttention's cache_leftpad: sequence b's keys are rows [pad[b], cache_seqlens[b]) plus
    # the appended ones (written at cache_seqlens[b]); bitwise the call on a cache whose rows
    # were moved to start at row 0 (same capacity, so the same splits). A paged cache with a
    # leftpad reads each row through the table on the GPU (the gathered rows).
    import hipflash.compat.flash_attn as fa2
    import hipflash.compat.flash_attn_interface as fa3
    g = torch.Generator().manual_seed(12)
    bf16, cap, paged = torch.bfloat16, 96, page > 0
    q = torch.randn(2, sq, 4, 64, generator=g).to(bf16)
    k_cache = torch.randn(2, cap, 2, 64, generator=g).to(bf16)
    v_cache = torch.randn(2, cap, 2, 64, generator=g).to(bf16)
    k_new = torch.randn(2, 3, 2, 64, generator=g).to(bf16)
    v_new = torch.randn(2, 3, 2, 64, generator=g).to(bf16)
    lens, pads = [50, 70], [13, 0]
    k_shift, v_shift = k_cache.clone(), v_cache.clone()
    for b, p in enumerate(pads):
        k_shift[b, :cap - p], v_shift[b, :cap - p] = k_cache[b, p:], v_cache[b, p:]
    dev = lambda t: t.to(device)  # noqa: E731
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    kw = dict(causal=True, return_lse=True)

    def cache(t):  # contiguous, or pages in reverse order
        if not paged:
            return dev(t.clone()), None
        table = torch.arange(2 * cap // page, dtype=torch.int32).flip(0).reshape(2, cap // page)
        pages = t.reshape(-1, page, 2, 64)[table.flatten().argsort()].clone()
        return dev(pages), dev(table)

    kc, table = cache(k_cache)
    vc, _ = cache(v_cache)
    out, lse = hipflash.flash_attn_with_kvcache(dev(q), kc, vc, dev(k_new), dev(v_new),
                                                cache_seqlens=i32(lens), block_table=table,
                                                cache_leftpad=i32(pads), **kw)
    ks, _ = cache(k_shift)
    vs, _ = cache(v_shift)
    want, want_lse = hipflash.flash_attn_with_kvcache(
        dev(q), ks, vs, dev(k_new), dev(v_new), block_table=table,
        cache_seqlens=i32([n - p for n, p in zip(lens, pads)]), **kw)
    assert_bitwise_equal(out, want, "out")
    assert_bitwise_equal(lse, want_lse, "lse")
    if device == "cuda":  # the lengths as CPU tensors: checked on the host, uploaded (the same
        # rows are appended again)
        host = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        got = hipflash.flash_attn_with_kvcache(dev(q), kc, vc, dev(k_new), dev(v_new),
                                               cache_seqlens=host(lens), block_table=table,
                                               cache_leftpad=host(pads), **kw)
        assert_bitwise_equal(got[0], want, "out, host lengths")
        assert_bitwise_equal(got[1], want_lse, "lse, host lengths")
    if not paged:  # the new rows land at cache_seqlens[b], the padding untouched
        for b, (n, p) in enumerate(zip(lens, pads)):
            assert_bitwise_equal(kc[b, n:n + 3].cpu(), k_new[b], f"appended k of {b}")
            assert_bitwise_equal(kc[b, :n].cpu(), k_cache[b, :n], f"cached k of {b}")
        for mod in (fa2, fa3):  # the compatibility modules pass it through
            got = mod.flash_attn_with_kvcache(dev(q), dev(k_cache.clone()), dev(v_cache.clone()),
                                              dev(k_new), dev(v_new), cache_seqlens=i32(lens),
                                              cache_leftpad=i32(pads), causal=True)
            assert_bitwise_equal(got, want, mod.__name__)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pads_on", ["device", "host"])
def test_bad_cache_leftpad_is_refused_and_nothing_is_written(device, pads_on):
    # pads_on="host": CPU tensors with GPU q are checked from their host values.
    q = torch.randn(2, 1, 4, 64).to(torch.bfloat16).to(device)
    k_cache = torch.zeros(2, 48, 2, 64, dtype=torch.bfloat16, device=device)
    k_new = torch.ones(2, 1, 2, 64, dtype=torch.bfloat16, device=device)
    on = "cpu" if pads_on == "host" else device
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=on)  # noqa: E731
    for pads, error, match in (([5, 0], ValueError, r"cache_leftpad\[0\] = 5 is not in \[0, 4\]"),
                               ([-1, 0], ValueError, "cache_leftpad"),
                               ([0], ValueError, "one entry per sequence")):
        with pytest.raises(error, match=match):
            hipflash.flash_attn_with_kvcache(q, k_cache, k_cache.clone(), k_new, k_new.clone(),
                                             cache_seqlens=4, cache_leftpad=i32(pads))
        assert not k_cache.any(), "the append ran before the refusal"


@pytest.mark.skipif(not GPU_OK, reason="needs a GPU visible to torch and a hipflash built with "
                    f"GPU kernels (this build: {hipflash.build_info()!r})")
def test_a_decode_step_with_host_lengths_does_not_wait_for_the_gpu():
    # A decode loop (transformers' generation steps) passes cache_seqlens as an int and
    # cache_leftpad as a CPU tensor: checked on the host, the call returns while earlier work
    # is still running (device tensors are copied back, which waits for it).
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(4, 1, 8, 128, device=dev, dtype=bf16)
    k_cache = torch.randn(4, 256, 2, 128, device=dev, dtype=bf16)
    v_cache = torch.randn(4, 256, 2, 128, device=dev, dtype=bf16)
    pads = torch.tensor([0, 3, 100, 17], dtype=torch.int32)
    want = hipflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=200,
                                            cache_leftpad=pads.to(dev), causal=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of the GPU's clock
    busy = torch.cuda.Event()
    busy.record()
    got = hipflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=200,
                                           cache_leftpad=pads, causal=True)
    still_running = not busy.query()
    torch.cuda.synchronize()
    assert still_running, "the call waited for the GPU's queued work"
    assert_bitwise_equal(got, want, "out")


@pytest.mark.parametrize("bad, error, match", [
    (dict(cache_batch_idx=torch.tensor([3, 0], dtype=torch.int32)), ValueError,
     r"cache_batch_idx\[0\] = 3 is not an entry of the cache"),
    (dict(cache_batch_idx=torch.tensor([0], dtype=torch.int32)), ValueError, "one entry per"),
    (dict(cache_batch_idx=torch.tensor([0, 1])), ValueError, "int32"),
    (dict(cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32),
          block_table=torch.zeros(2, 3, dtype=torch.int32)), ValueError,
     r"cache_batch_idx\[0\] = 2 is not a row of block_table"),
    (dict(cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32)), ValueError,
     "names entry 1 twice"),
])
@pytest.mark.parametrize("device", DEVICES)
def test_bad_cache_batch_idx_is_refused_and_nothing_is_written(bad, error, match, device):
    q = torch.randn(2, 1, 4, 64).to(torch.bfloat16).to(device)
    k_cache = torch.zeros(3, 48, 2, 64, dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    k_new = torch.ones(2, 1, 2, 64, dtype=torch.bfloat16, device=device)
    bad = {n: t.to(device) for n, t in bad.items()}
    with pytest.raises(error, match=match):
        if "block_table" in bad:  # a paged cache: pages of 16 rows
            hipflash.flash_attn_with_kvcache(q, k_cache.view(9, 16, 2, 64),
                                             v_cache.view(9, 16, 2, 64), k_new, k_new.clone(),
                                             cache_seqlens=4, **bad)
        else:
            hipflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new.clone(),
                                             cache_seqlens=4, **bad)
    assert not k_cache.any() and not v_cache.any(), "the append ran before the refusal"




def rotary_reference(x, cos, sin, pos, interleaved):
    """FlashAttention's rotary embedding in float64: the first rotary_dim dims of x [B, S, H, D]
    as complex pairs (interleaved) or halves (rotate_half), at positions pos [B, S]."""
    rd = 2 * cos.shape[1]
    c, s = cos.double()[pos][:, :, None, :], sin.double()[pos][:, :, None, :]
    xr = x[..., :rd].double()
    if interleaved:
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], rd // 2, 2).contiguous())
        rot = torch.view_as_real(z * torch.complex(c, s)).flatten(-2)
    else:
        c2, s2 = torch.cat((c, c), -1), torch.cat((s, s), -1)
        half = torch.cat((-xr[..., rd // 2:], xr[..., :rd // 2]), -1)
        rot = xr * c2 + half * s2
    return torch.cat((rot.to(x.dtype), x[..., rd:]), -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("leftpad", [False, True], ids=["nopad", "leftpad"])
def test_rotary_on_append(device, interleaved, causal, leftpad):
    # FlashAttention's rotary_cos / rotary_sin: k rotated at cache_seqlens + j (its cache row,
    # leftpad or not) before the append, q at that base + i (causal) or the base alone; against
    # the float64 rotation. The table has 42 rows: sequence 1's positions 42 and 43 are past it,
    # not rotated (FlashAttention's cos 1 / sin 0 there).
    import hipflash.compat.flash_attn as fa2
    import hipflash.compat.flash_attn_interface as fa3
    g = torch.Generator().manual_seed(21)
    bf16, d, rd, s_new, sq = torch.bfloat16, 64, 32, 3, 3
    q = torch.randn(2, sq, 4, d, generator=g).to(bf16).to(device)
    kc = torch.randn(2, 64, 2, d, generator=g).to(bf16).to(device)
    vc = torch.randn(2, 64, 2, d, generator=g).to(bf16).to(device)
    k_new = torch.randn(2, s_new, 2, d, generator=g).to(bf16).to(device)
    v_new = torch.randn(2, s_new, 2, d, generator=g).to(bf16).to(device)
    angles = torch.rand(80, rd // 2, generator=g, dtype=torch.float64) * 6.3
    angles[42:] = 0  # the reference's table: cos 1, sin 0 past the 42 rows the call gets
    cos_ref, sin_ref = angles.cos().float().to(device), angles.sin().float().to(device)
    cos, sin = cos_ref[:42], sin_ref[:42]
    lens = torch.tensor([20, 41], dtype=torch.int32, device=device)
    pads = torch.tensor([5, 0], dtype=torch.int32, device=device) if leftpad else None
    base = lens.long()
    pos_k = base[:, None] + torch.arange(s_new, device=device)
    pos_q = base[:, None] + (torch.arange(sq, device=device) if causal else 0 * torch.arange(sq, device=device))
    q_rot = rotary_reference(q, cos_ref, sin_ref, pos_q, interleaved)
    k_rot = rotary_reference(k_new, cos_ref, sin_ref, pos_k, interleaved)
    kw = dict(cache_seqlens=lens, cache_leftpad=pads, causal=causal, return_lse=True)
    k1, v1 = kc.clone(), vc.clone()
    out, lse = hipflash.flash_attn_with_kvcache(q, k1, v1, k_new, v_new, rotary_cos=cos,
                                                rotary_sin=sin, rotary_interleaved=interleaved, **kw)
    k2, v2 = kc.clone(), vc.clone()
    want, want_lse = hipflash.flash_attn_with_kvcache(q_rot, k2, v2, k_rot, v_new, **kw)
    # The rotation rounds once to bf16 either way (float32 vs float64 before it): within an ulp.
    for b in range(2):
        n = int(lens[b])
        got_k, ref_k = k1[b, n:n + s_new].float(), k_rot[b].float()
        assert torch.allclose(got_k, ref_k, rtol=2 ** -7, atol=1e-6), "appended k rotated"
        assert torch.equal(k1[b, :n], kc[b, :n]) and torch.equal(v1[b, n:n + s_new], v_new[b])
    assert (out.float() - want.float()).abs().max() < 2e-2
    assert (lse - want_lse).abs().max() < 1e-2
    # The compatibility modules pass it through (FA3's rotary_seqlens too: the same base here).
    for mod, extra in ((fa2, {}), (fa3, {"rotary_seqlens": (lens if leftpad else None)})):
        got = mod.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k_new, v_new,
                                          cache_seqlens=lens, cache_leftpad=pads, causal=causal,
                                          rotary_cos=cos, rotary_sin=sin,
                                          rotary_interleaved=interleaved, **extra)
        assert_bitwise_equal(got, out, mod.__name__)


def test_bad_rotary_is_refused_and_nothing_is_written():
    q = torch.randn(1, 1, 2, 64).to(torch.bfloat16)
    kc = torch.zeros(1, 32, 2, 64, dtype=torch.bfloat16)
    k_new = torch.ones(1, 2, 2, 64, dtype=torch.bfloat16)
    cos = torch.ones(8, 16)
    for kw, match in ((dict(rotary_cos=cos), "given together"),
                      (dict(rotary_cos=cos, rotary_sin=torch.ones(8, 8)), "one shape"),
                      (dict(rotary_cos=torch.ones(8, 40), rotary_sin=torch.ones(8, 40)),
                       "rotary_dim"),
                      (dict(rotary_cos=cos, rotary_sin=cos.clone(),
                            rotary_seqlens=torch.tensor([-1], dtype=torch.int32)), ">= 0"),
                      (dict(rotary_seqlens=torch.zeros(1, dtype=torch.int32)), "needs rotary_cos")):
        with pytest.raises(ValueError, match=match):
            hipflash.flash_attn_with_kvcache(q, kc, kc.clone(), k_new, k_new.clone(),
                                             cache_seqlens=7, **kw)
        assert not kc.any(), "the append ran before the refusal"
    with pytest.raises(ValueError, match="k and v must be given"):  # as FlashAttention
        hipflash.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=7, rotary_cos=cos,
                                         rotary_sin=cos.clone())
