"""The one reference of SPEC §3 for the Python suite, and the checks of SPEC §6.

    out_ref, lse_ref = attention_ref(q, k, v, causal=True)            # fp32 on upcast inputs
    out_lp, _ = attention_ref(q, k, v, causal=True, lowp=True)        # same math in q's dtype
    check_attention(out, lse, q, k, v, causal=True)                    # FlashAttention's rule

Shapes follow hipflash: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]; lse [B, Hq, Sq].
Runs on the tensors' device (so a GPU test computes its reference on the GPU).
"""
import math

import torch

NEG_INF = float("-inf")


def valid_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1), device="cpu",
               attention_chunk=0):
    """[Sq, Sk] bool: key j is valid for row i (bottom-right aligned causal / window; with
    attention_chunk C, only keys of the chunk of i's position p: [p - p mod C, + C))."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = i + seqlen_k - seqlen_q
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= diag - left
    if right >= 0:
        mask &= j <= diag + right
    if attention_chunk:
        start = diag - diag % attention_chunk  # % of a tensor: the divisor's sign (FA3's)
        mask &= (j >= start) & (j < start + attention_chunk)
    return mask


def _round(x, dtype):
    """Rounds an fp32 tensor to `dtype` and back: one low-precision rounding step."""
    return x.to(dtype).float()


def alibi_bias(slopes, batch, heads, seqlen_q, seqlen_k, device="cpu"):
    """ALiBi's bias [B, Hq, Sq, Sk] (fp64): -slopes[b, h] * |i + Sk - Sq - j|, slopes [Hq] or
    [B, Hq]; 0 on the bottom-right diagonal."""
    i = torch.arange(seqlen_q, device=device, dtype=torch.float64)[:, None]
    j = torch.arange(seqlen_k, device=device, dtype=torch.float64)[None, :]
    dist = (i + seqlen_k - seqlen_q - j).abs()
    s = slopes.double().to(device).reshape(-1 if slopes.dim() == 2 else 1, heads)
    bias = -s[:, :, None, None] * dist
    return torch.where(dist == 0, torch.zeros_like(bias), bias).expand(batch, heads, seqlen_q,
                                                                       seqlen_k)


def attention_ref(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), lowp=False,
                  softcap=0.0, alibi_slopes=None, attention_chunk=0):
    """SPEC §3 for dense q/k/v. Returns (out fp32 [B, Sq, Hq, D], lse fp32 [B, Hq, Sq]).

    lowp=False: fp32 math on the upcast inputs (ref32). lowp=True: the same math with every
    intermediate rounded to q's dtype as FlashAttention's reference does without upcast (scaled
    q, scores, probabilities, output; products accumulated in fp32) — its error against ref32
    is the yardstick of SPEC §6. The lse is always the fp32 one. softcap > 0: each scaled
    score s becomes softcap * tanh(s / softcap) before the softmax (FlashAttention 2's softcap);
    alibi_slopes ([Hq] or [B, Hq]) then add alibi_bias; attention_chunk as valid_mask.
    """
    batch, seqlen_q, heads_q, dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dim)
    dtype = q.dtype
    qf, kf, vf = q.float(), k.float(), v.float()
    # GQA by grouping the query heads of one kv head: [B, Sq, Hkv, G, D] (no k/v copy).
    qg = qf.reshape(batch, seqlen_q, heads_kv, group, dim)
    mask = valid_mask(seqlen_q, seqlen_k, causal, window_size, q.device, attention_chunk)
    row_valid = mask.any(dim=-1)  # [Sq]

    if lowp:
        s = torch.einsum("bqhgd,bkhd->bhgqk", _round(qg * scale, dtype), kf)
        s = _round(s, dtype)
    else:
        s = torch.einsum("bqhgd,bkhd->bhgqk", qg, kf) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
        if lowp:
            s = _round(s, dtype)
    if alibi_slopes is not None:
        bias = alibi_bias(alibi_slopes, batch, heads_q, seqlen_q, seqlen_k, q.device)
        s = s + bias.float().reshape(batch, heads_kv, group, seqlen_q, seqlen_k)
        if lowp:
            s = _round(s, dtype)
    s = s.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(s, dim=-1)  # -inf where a row has no valid key
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    p = p * row_valid[:, None]  # rows without keys: p = 0 -> out = 0
    if lowp:
        p = _round(p, dtype)
    out = torch.einsum("bhgqk,bkhd->bqhgd", p, vf)
    if lowp:
        out = _round(out, dtype)
    out = out.reshape(batch, seqlen_q, heads_q, dim)
    lse = lse.reshape(batch, heads_q, seqlen_q)
    return out, lse


def varlen_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, lowp=False, **kw):
    """SPEC §3 for varlen q [total_q, Hq, D]. Returns (out fp32 [total_q, Hq, D],
    lse_packed fp32 [Hq, total_q], lse_padded fp32 [B, Hq, max_seqlen_q] with -inf padding).
    Rows of q past cu_seqlens_q[-1] are left 0 in out and -inf in lse_packed."""
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    batch = len(cu_q) - 1
    total_q, heads_q, dim = q.shape
    out = torch.zeros(total_q, heads_q, dim, device=q.device)
    lse_packed = torch.full((heads_q, total_q), NEG_INF, device=q.device)
    lse_padded = torch.full((batch, heads_q, max_seqlen_q), NEG_INF, device=q.device)
    for b in range(batch):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        kb = dict(kw)
        if kw.get("alibi_slopes") is not None and kw["alibi_slopes"].dim() == 2:
            kb["alibi_slopes"] = kw["alibi_slopes"][b]  # this sequence's slopes
        o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], lowp=lowp, **kb)
        out[q0:q1] = o[0]
        lse_packed[:, q0:q1] = l[0]
        lse_padded[b, :, : q1 - q0] = l[0]
    return out, lse_packed, lse_padded


# ---- SPEC §6 checks --------------------------------------------------------------------------


def check_out(out, out_ref, out_lp, what=""):
    """max|out - ref32| <= 2 * max|ref_lp - ref32| + 1e-5, and no NaN."""
    assert out.shape == out_ref.shape, f"{what}: out shape {tuple(out.shape)} != {tuple(out_ref.shape)}"
    if out.numel() == 0:
        return
    assert not torch.isnan(out).any(), f"{what}: NaN in out"
    err = (out.float() - out_ref).abs().max().item()
    tol = 2 * (out_lp - out_ref).abs().max().item() + 1e-5
    assert err <= tol, f"{what}: max|out - ref| = {err:.3e} > tolerance {tol:.3e}"


def check_lse(lse, lse_ref, what=""):
    """fp32, within 1e-3 abs/rel of the reference, -inf exactly where the reference is, no NaN."""
    assert lse.dtype == torch.float32, f"{what}: lse dtype {lse.dtype}"
    assert lse.shape == lse_ref.shape, f"{what}: lse shape {tuple(lse.shape)} != {tuple(lse_ref.shape)}"
    assert lse.is_contiguous(), f"{what}: lse is not contiguous"
    if lse.numel() == 0:
        return
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    ref_inf = torch.isneginf(lse_ref)
    got_inf = torch.isneginf(lse)
    assert torch.equal(got_inf, ref_inf), (
        f"{what}: -inf mismatch at {(got_inf != ref_inf).nonzero()[:5].tolist()} "
        f"(got {lse[got_inf != ref_inf][:5].tolist()}, ref {lse_ref[got_inf != ref_inf][:5].tolist()})"
    )
    assert torch.isfinite(lse[~ref_inf]).all(), f"{what}: +inf in lse"
    diff = (lse - lse_ref)[~ref_inf].abs()
    bound = 1e-3 + 1e-3 * lse_ref[~ref_inf].abs()
    if diff.numel():
        worst = (diff - bound).argmax()
        assert (diff <= bound).all(), (
            f"{what}: |lse - ref| = {diff[worst].item():.3e} > {bound[worst].item():.3e}"
        )


def check_attention(out, lse, q, k, v, what="", **kw):
    """Checks a dense result (lse may be None) against the reference of SPEC §3."""
    out_ref, lse_ref = attention_ref(q, k, v, **kw)
    out_lp, _ = attention_ref(q, k, v, lowp=True, **kw)
    check_out(out, out_ref, out_lp, what)
    if lse is not None:
        check_lse(lse, lse_ref, what)


def bits(t):
    """A tensor's bit pattern, for bitwise comparisons (NaN == NaN, -0 != 0)."""
    t = t.contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise_equal(a, b, what=""):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(bits(a), bits(b)), f"{what}: results differ bitwise"


# ---- Inputs ----------------------------------------------------------------------------------


def make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, dim, dtype, device="cpu", seed=0):
    """Random q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] (generated on the CPU: reproducible)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads_q, dim, generator=g).to(dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, dim, generator=g).to(dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, dim, generator=g).to(dtype)
    return q.to(device), k.to(device), v.to(device)


def make_varlen(lens_q, lens_k, heads_q, heads_kv, dim, dtype, device="cpu", seed=0):
    """Packed q [total_q, Hq, D], k/v [total_k, Hkv, D] and int32 cu_seqlens for the lengths."""
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + list(lens_q), dtype=torch.int64).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + list(lens_k), dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), heads_q, dim, generator=g).to(dtype)
    k = torch.randn(int(cu_k[-1]), heads_kv, dim, generator=g).to(dtype)
    v = torch.randn(int(cu_k[-1]), heads_kv, dim, generator=g).to(dtype)
    return (q.to(device), k.to(device), v.to(device), cu_q.to(device), cu_k.to(device))


def view_in_nan_storage(t, pad=8):
    """A copy of `t` [B, S, H, D] living as a strided view inside a NaN-filled buffer: any read
    outside the view (or of its padding) poisons the result."""
    b, s, h, d = t.shape
    storage = torch.full((b, s + 2 * pad, h + 1, d + 2 * pad), float("nan"), dtype=t.dtype,
                         device=t.device)
    view = storage[:, pad:pad + s, 1:, pad:pad + d]
    view.copy_(t)
    return view


# ---- KV cache (SPEC §7) ----------------------------------------------------------------------


def head_major(x):
    """x's values stored head-major ([B or pages, H, rows, D] in memory, FlashInfer's "HND" and
    the Hugging Face cache's layout), seen as x's shape: a view with free strides."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def make_kv_cache(lens, capacity, hkv, d, dtype, page, seed=0, device="cpu"):
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
    flat = ids.reshape(-1).long()  # page e of sequence i holds its rows [e page, (e + 1) page)
    k_pages[flat] = k.reshape(b * max_blocks, page, hkv, d)
    v_pages[flat] = v.reshape(b * max_blocks, page, hkv, d)
    return tuple(t.to(device) for t in (k, v, k_pages, v_pages, ids))


def make_chunked_prefill(page, hq, hkv, seed=3, d=64, dtype=torch.bfloat16, lens_q=None,
                         device="cpu"):
    """Chunked prefill: paged caches holding each sequence's keys (its new chunk included), the
    same keys packed contiguously, varlen queries (the chunks) and both cu_seqlens. Returns
    (q, cu_q, cu_k, max_q, max_k, k_pages, v_pages, table, k_packed, v_packed)."""
    lens_k = [2 * page + 5, 0, page, 17]
    lens_q = lens_q or [7, 0, page, 17]  # a chunk of new rows per sequence
    capacity = ((max(lens_k) + page - 1) // page) * page
    k, v, k_pages, v_pages, table = make_kv_cache(lens_k, capacity, hkv, d, dtype, page, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype)
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int64).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int64).cumsum(0).to(torch.int32)
    k_packed = torch.cat([k[i, :n] for i, n in enumerate(lens_k)])
    v_packed = torch.cat([v[i, :n] for i, n in enumerate(lens_k)])
    return tuple(t.to(device) if torch.is_tensor(t) else t for t in
                 (q, cu_q, cu_k, max(lens_q), max(lens_k), k_pages, v_pages, table, k_packed,
                  v_packed))


def check_kv_per_sequence(out, lse, q, k_cache, v_cache, lens, **kw):
    """A KV-cache result against the reference of each sequence's first lens[i] keys."""
    for i, n in enumerate(lens):
        check_attention(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k_cache[i:i + 1, :n],
                        v_cache[i:i + 1, :n], what=f"sequence {i}", **kw)
