"""Varlen queries against a KV cache with an append (FlashAttention 3's flash_attn_with_kvcache
with cu_seqlens_q and, for the new keys, cu_seqlens_k_new): the new rows are written into the
cache by PyTorch ops (an indexed copy, after the append's checks), then hipflash's chunked
prefill (flash_attn_varlen_func with a block table) attends. The attention call checks the rest
of the arguments; where it refuses them, the rows the append overwrote are put back before the
error propagates, so that a refused call leaves the cache as it was (SPEC §4). A contiguous
cache [B_cache, S, Hkv, D] is read as pages of S rows (sequence b's table row: its cache entry),
so both layouts take one path.
With cache_leftpad, sequence b's keys start at row cache_leftpad[b], and with attention_chunk
each query row sees its chunk's keys only (hipflash/_chunks.py): the cache is then read as pages
of one row, each sequence (or chunk piece) with a table row listing its keys' rows (the
gathered kernel, a bandwidth kernel at any page size).
"""
import torch

import hipflash

from . import _C, _chunks, _rotary


def _int32_vector(t, name, n, device):
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != n or t.dtype != torch.int32:
        raise ValueError(f"{name} must be an int32 tensor of shape ({n},)")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


def check_append(k_cache, v_cache, read):
    """The caches an append by PyTorch ops writes, against what the call reads (read: (name,
    tensor or None) pairs): neither may overlap itself or the other, nor share memory with a
    read tensor (SPEC §4; the launcher's own append keeps the same rules)."""
    _C.check_written_buffers([(k_cache, "k_cache"), (v_cache, "v_cache")],
                             [(t, n) for n, t in read if isinstance(t, torch.Tensor)])


def _page_table(t, name, batch, any_rows, device):
    """A block table [batch, max_blocks] int32 (any number of rows with cache_batch_idx, which
    picks them), contiguous, on q's device."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.int32 or \
            not (any_rows or t.shape[0] == batch):
        raise ValueError(f"{name} must be an int32 tensor [batch = {batch}, max_blocks]"
                         + (" (any rows with cache_batch_idx)" if any_rows else "") + ", got "
                         + (f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor)
                            else type(t).__name__))
    if t.device != device or not t.is_contiguous() or t.shape[1] == 0:
        raise ValueError(f"{name} must be contiguous, on q's device ({device}), with at least "
                         f"one column, got {list(t.shape)} on {t.device}")
    return t


def _rotated(x, cos, sin, base, cu, per_row, interleaved):
    """Packed rows x [T, H, D] rotated at base[b] (+ i, the row's index in its sequence, where
    per_row) for the rows of sequence b (cu: its prefix sums)."""
    lens = (cu[1:] - cu[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=x.device), lens)
    pos = base.long()[seq]
    if per_row:
        pos = pos + torch.arange(x.shape[0], device=x.device) - cu.long()[seq]
    return _rotary.rotate(x[None], cos, sin, pos[None], interleaved)[0]


def _by_rows(q, k_cache, v_cache, table, cu_seqlens_q, first, lens, chunk, alibi_slopes, kw):
    """Sequence b's query rows against its lens[b] keys from cache row first[b], cut into
    attention_chunk pieces when chunk > 0 (hipflash/_chunks.py): the caches read as pages of one
    row, each piece (its query rows and its chunk's keys) a sequence of the call, its table row
    listing its keys' cache rows. Returns what flash_attn_varlen_func does (LSE packed)."""
    page, per_row = k_cache.shape[1], k_cache.shape[2:]
    if k_cache.shape[0] * page > 2**31 - 1:
        raise ValueError("cache_leftpad or attention_chunk with varlen queries reads the cache "
                         "by rows: it must hold fewer than 2^31 rows")
    offset, *host = torch.cat([cu_seqlens_q[:1], cu_seqlens_q[1:] - cu_seqlens_q[:-1],
                               lens]).tolist()
    batch = len(host) // 2
    owner, rows_q, rows_k, key0 = _chunks.split(host[:batch], host[batch:], chunk,
                                                keyed_only=True)
    if not owner:  # no query row at all: one empty piece keeps the call's shape
        owner, rows_q, rows_k, key0 = [0], [0], [0], [0]
    dev = q.device
    owner_t = torch.tensor(owner, dtype=torch.int64, device=dev)
    width = max(max(rows_k), 1)
    capacity = table.shape[1] * page
    row = (first.long()[owner_t] + torch.tensor(key0, dtype=torch.int64, device=dev))[:, None] \
        + torch.arange(width, device=dev)
    row.clamp_(max=capacity - 1)  # past a piece's keys: never read
    pieces_table = (table.long()[owner_t].gather(1, torch.div(row, page, rounding_mode="floor"))
                    * page + row % page).to(torch.int32)
    return hipflash.flash_attn_varlen_func(
        q, k_cache.reshape(-1, 1, *per_row), v_cache.reshape(-1, 1, *per_row),
        _chunks.prefix(rows_q, offset, dev), _chunks.prefix(rows_k, 0, dev), max(rows_q), width,
        lse_layout="packed", block_table=pieces_table,
        alibi_slopes=_chunks.per_piece(alibi_slopes, owner), **kw)


def with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table,
                 cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, rotary_cos, rotary_sin,
                 rotary_seqlens, rotary_interleaved, softmax_scale, causal, window_size,
                 num_splits, return_lse, softcap, cache_leftpad=None, attention_chunk=0,
                 alibi_slopes=None, k_scale=None, v_scale=None, table_name="page_table"):
    """FlashAttention 3's varlen kvcache call; returns what flash_attn_varlen_func does. An fp8
    cache (float8_e4m3fn) takes bfloat16 / float16 q (or FA3's e4m3 q, widened exactly), new
    rows in q's dtype stored as k / k_scale rounded to e4m3 and saturated to +-448 (or e4m3 rows
    as they are), and hipflash's k_scale / v_scale. Every argument is checked before the
    append writes the cache (SPEC §4): the shapes, dtypes and values here, the aliasing of the
    written caches by hipflash's own rules (_C.check_written_buffers); the attention call checks
    the rest, and if it refuses, the appended rows are put back. table_name: the block table's
    name in errors (FlashAttention 3's page_table, hipflash's block_table)."""
    if (k is None) != (v is None):
        raise ValueError("k and v (the new keys and values) must be given together")
    if not isinstance(attention_chunk, int) or attention_chunk < 0:
        raise ValueError(f"attention_chunk must be an int >= 0, got {attention_chunk!r}")
    if (k is None) != (cu_seqlens_k_new is None):
        raise ValueError("varlen queries append new keys with cu_seqlens_k_new (the new rows' "
                         "prefix sums): give k, v and cu_seqlens_k_new together")
    if rotary_cos is not None or rotary_sin is not None:
        _rotary.check_tables(q, k, rotary_cos, rotary_sin, need_k=False)
    elif rotary_seqlens is not None:
        raise ValueError("rotary_seqlens needs rotary_cos and rotary_sin")
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1:
        raise ValueError("cu_seqlens_q must be a 1-D int32 tensor of length batch + 1")
    if max_seqlen_q is None or cache_seqlens is None:
        raise ValueError("varlen queries against a KV cache need max_seqlen_q and cache_seqlens")
    dev, batch = q.device, cu_seqlens_q.shape[0] - 1
    # q and the caches checked here, as the attention call would, before anything is written.
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be packed [total_q, nheads, headdim] and k_cache / v_cache "
                         f"[num_blocks or batch, page or seqlen, nheads_k, headdim], got "
                         f"{list(q.shape)}, {list(k_cache.shape)}, {list(v_cache.shape)}")
    e4m3 = getattr(torch, "float8_e4m3fn", None)
    fp8 = k_cache.dtype == e4m3 and q.dtype in (e4m3, torch.bfloat16, torch.float16)
    if k_cache.device != dev or v_cache.device != dev:
        raise ValueError(f"k_cache and v_cache must be on q's device ({dev}), got "
                         f"{k_cache.device}, {v_cache.device}")
    if (q.dtype != k_cache.dtype and not fp8) or k_cache.dtype != v_cache.dtype:
        raise TypeError(f"q, k_cache and v_cache must share a dtype (or the cache be "
                        f"float8_e4m3fn, q 16-bit), got {q.dtype}, {k_cache.dtype}, "
                        f"{v_cache.dtype}")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is not None and not fp8:
            raise ValueError(f"{name} applies to float8_e4m3fn caches only (the cache is "
                             f"{k_cache.dtype})")
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or
                              t.numel() != 1 or t.dim() > 1 or t.device != dev):
            raise ValueError(f"{name} must be a float32 tensor of shape [] or [1] on {dev}")
    if q.shape[-1] != k_cache.shape[-1] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q's heads ({q.shape[1]}) must be a multiple of the cache's "
                         f"({k_cache.shape[2]}) and the head dims equal")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=dev)
    _int32_vector(cache_seqlens, "cache_seqlens", batch, dev)
    # The cache as pages: a page table's rows (cache_batch_idx picks them, FA3's rule), or a
    # contiguous cache's entries as one page each.
    if cache_batch_idx is not None:
        _int32_vector(cache_batch_idx, "cache_batch_idx", batch, dev)
        entries = cache_batch_idx
        # Appending, two sequences naming one entry would write each other's rows.
        if k is not None and torch.unique(entries).numel() != batch:
            raise ValueError("cache_batch_idx names a cache entry twice: with new keys appended, "
                             "each sequence needs an entry of its own")
    else:
        entries = None
    if page_table is not None:
        _page_table(page_table, table_name, batch, entries is not None, dev)
        table = page_table if entries is None else page_table.index_select(0, entries.long())
    else:
        rows = entries if entries is not None else torch.arange(batch, dtype=torch.int32,
                                                                device=dev)
        table = rows.to(torch.int32).view(batch, 1)
    page = k_cache.shape[1]
    capacity = table.shape[1] * page
    lens = cache_seqlens
    if k is not None:
        _int32_vector(cu_seqlens_k_new, "cu_seqlens_k_new", batch + 1, dev)
        new_lens = cu_seqlens_k_new[1:] - cu_seqlens_k_new[:-1]
        lens = cache_seqlens + new_lens
    if cache_leftpad is not None:
        _int32_vector(cache_leftpad, "cache_leftpad", batch, dev)
    # The lengths' bounds in one copy to the host: the new rows' total, the smallest new count,
    # the smallest cached length, the largest total and the smallest cached length past its
    # leftpad.
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    total_new, min_new, min_cached, max_len, min_pad, min_past_pad = torch.cat([
        cu_seqlens_k_new[-1:] if k is not None else zero,
        new_lens.min().view(1) if k is not None and batch else zero,
        cache_seqlens.min().view(1) if batch else zero,
        lens.max().view(1) if batch else zero,
        cache_leftpad.min().view(1) if cache_leftpad is not None and batch else zero,
        (cache_seqlens - cache_leftpad).min().view(1) if cache_leftpad is not None and batch
        else zero]).tolist()
    if k is not None:
        # The append writes the caches: neither may overlap itself or the other, nor share
        # memory with anything the call reads (the new rows, q, the lengths, the tables).
        check_append(k_cache, v_cache, [
            ("q", q), ("k", k), ("v", v), ("cache_seqlens", cache_seqlens),
            (table_name, page_table), ("cache_batch_idx", cache_batch_idx),
            ("cache_leftpad", cache_leftpad), ("cu_seqlens_q", cu_seqlens_q),
            ("cu_seqlens_k_new", cu_seqlens_k_new), ("rotary_cos", rotary_cos),
            ("rotary_sin", rotary_sin), ("rotary_seqlens", rotary_seqlens),
            ("alibi_slopes", alibi_slopes), ("k_scale", k_scale), ("v_scale", v_scale)])
        want = [total_new] + list(k_cache.shape[2:])
        for name, t in (("k", k), ("v", v)):
            # An fp8 cache: rows in q's dtype (quantised on append), or e4m3 ones with FA3's
            # e4m3 q (their bytes as they are).
            if list(t.shape) != want or t.device != dev or \
                    t.dtype != (q.dtype if fp8 and q.dtype != k_cache.dtype else k_cache.dtype):
                raise ValueError(f"{name} must be the packed new rows {want} in the cache's "
                                 f"dtype {k_cache.dtype} (an fp8 cache: or q's) on {dev}, got "
                                 f"{list(t.shape)} {t.dtype} on {t.device}")
        if min_new < 0:
            raise ValueError("cu_seqlens_k_new must be non-decreasing")
    if min_cached < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got down to {min_cached}")
    if max_len > capacity:
        raise ValueError(f"each sequence's cached plus new keys must fit its cache ({capacity} "
                         f"rows), got lengths up to {max_len}")
    if min_pad < 0 or min_past_pad < 0:
        raise ValueError("cache_leftpad[b] must lie in [0, cache_seqlens[b]]")
    if e4m3 is not None and q.dtype == e4m3:
        # FlashAttention 3's fp8 KV-cache call (q, the cache and the new rows all e4m3, no
        # scales): q widened to bfloat16 exactly, the cache read as an fp8 cache with scales 1,
        # out bfloat16.
        q = q.to(torch.bfloat16)
        if rotary_cos is not None and k is not None:  # rotated in bf16, then quantised
            k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    if rotary_cos is not None:
        base = cache_seqlens if rotary_seqlens is None else _int32_vector(
            rotary_seqlens, "rotary_seqlens", batch, dev)
        lowest = int(base.min()) if batch else 0  # one host sync
        if lowest < 0:
            raise ValueError(f"rotary positions must be >= 0, got rotary_seqlens down to "
                             f"{lowest}")
        left, right = window_size
        per_row = bool(causal) or left >= 0 or right >= 0
        q = _rotated(q, rotary_cos, rotary_sin, base, cu_seqlens_q, per_row, rotary_interleaved)
        if k is not None:
            k = _rotated(k, rotary_cos, rotary_sin, base, cu_seqlens_k_new, True,
                         rotary_interleaved)
    if k is not None and k.shape[0]:  # the append: row cache_seqlens[b] + j of sequence b
        seq = torch.repeat_interleave(torch.arange(batch, device=dev), new_lens.long())
        row = cache_seqlens.long()[seq] + torch.arange(k.shape[0], device=dev) \
            - cu_seqlens_k_new.long()[seq]
        pages = table.long()[seq, torch.div(row, page, rounding_mode="floor")]
        lo, hi = pages.aminmax()
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= k_cache.shape[0]:
            raise ValueError(f"the new rows' pages (or cache entries) must lie in the cache "
                             f"(0 .. {k_cache.shape[0] - 1}), got {lo} .. {hi}")
        def stored(t, scale):  # an fp8 cache's rows: t / scale, rounded, saturated (NaN stays)
            if t.dtype == k_cache.dtype:
                return t
            x = t.float() if scale is None else t.float() / scale.float().reshape(())
            return x.clamp(-448.0, 448.0).to(k_cache.dtype)
        slots = row % page
        saved = (k_cache[pages, slots], v_cache[pages, slots])  # put back if the call refuses
        k_cache[pages, slots] = stored(k, k_scale)
        v_cache[pages, slots] = stored(v, v_scale)
    else:
        saved = None
    try:
        return _attend(q, k_cache, v_cache, table, cu_seqlens_q, lens, max_seqlen_q, capacity,
                       batch, cache_leftpad, attention_chunk, alibi_slopes,
                       dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                            num_splits=num_splits, return_lse=return_lse, softcap=softcap,
                            k_scale=k_scale, v_scale=v_scale))
    except Exception:
        if saved is not None:
            k_cache[pages, slots], v_cache[pages, slots] = saved
        raise


def _attend(q, k_cache, v_cache, table, cu_seqlens_q, lens, max_seqlen_q, capacity, batch,
            cache_leftpad, attention_chunk, alibi_slopes, kw):
    """The attention of with_kvcache, the new rows in the cache."""
    dev = q.device
    if batch and (cache_leftpad is not None or attention_chunk):
        first = cache_leftpad if cache_leftpad is not None else torch.zeros_like(lens)
        return _by_rows(q, k_cache, v_cache, table, cu_seqlens_q, first, lens - first,
                        attention_chunk, alibi_slopes, kw)
    cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
    torch.cumsum(lens, 0, out=cu_k[1:])
    return hipflash.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens_q, cu_k, max_seqlen_q, capacity, lse_layout="packed",
        block_table=table, alibi_slopes=alibi_slopes, **kw)
