"""FlashAttention 3's Python API (``flash_attn_interface``, hopper/), run by hipflash:

    from hipflash.compat.flash_attn_interface import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)
    out, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)

Function names, argument names and defaults as in FlashAttention 3. ``return_attn_probs``
adds the LSE ([batch, nheads, seqlen] dense, [nheads, total_q] varlen): ``(out, lse)``;
flash_attn_with_kvcache's ``return_softmax_lse`` returns ``(out, lse, out_accum, lse_accum)``,
the accumulators empty, as upstream's ``(out, softmax_lse, *rest)`` of a call it does not
split.
Performance hints hipflash decides itself are accepted and ignored: pack_gqa, sm_margin,
scheduler_metadata. ``num_splits``: FA3's 1 is no split, <= 0 hipflash's heuristic.

Every head dim up to 256 runs, those hipflash's kernels lack zero-padded to the next they have
(compat._common.pad_head_dim; 16-bit inputs), except against a KV cache (refused by name), and
q, k, v without a contiguous last dimension are copied, as FlashAttention does.
Refused with NotImplementedError: qv, a value head dim other than q's, and q/k/v_descale (fp8)
in flash_attn_with_kvcache (fp8 runs where hipflash's descales do: flash_attn_func on CPU,
Hopper, AMD gfx94x / gfx950; flash_attn_varlen_func on the CPU and Hopper). flash_attn_with_kvcache takes
an all-e4m3 call without descales, with varlen queries too: q and k / v widened to bfloat16
exactly, the cache read as hipflash's fp8 cache. attention_chunk runs as hipflash's (hipflash/_chunks.py: varlen pieces),
with fp8 inputs and fp8 caches too. Varlen queries against a KV cache (paged or contiguous, with cache_batch_idx,
cache_leftpad, rotary and an append of packed new keys by cu_seqlens_k_new) run as hipflash's
chunked prefill after the append and rotation by PyTorch ops (hipflash/_varlen_kv.py). seqused_q / seqused_k run on CPU tensors and
NVIDIA GPUs, forward and backward; softcap runs on CPU tensors and
NVIDIA GPUs, forward and backward.
"""
import torch

import hipflash
from hipflash import _varlen_kv

from ._common import (contiguous_last, pad_head_dim, refuse, refuse_headdim,
                      refuse_headdim_v, softcap_value, split_qkv, window)

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_with_kvcache", "flash_attn_combine"]


def _refuse_common(q, v, qv, q_descale, k_descale, v_descale, fp8=False):
    refuse("qv", qv, None)
    refuse_headdim_v(q, v)
    if not fp8:
        for name, value in (("q_descale", q_descale), ("k_descale", k_descale),
                            ("v_descale", v_descale)):
            refuse(name, value, None, "fp8 runs in flash_attn_func and flash_attn_varlen_func")


def _cut(res, cut, with_lse):
    """A padded head dim's output cut back (compat._common.pad_head_dim); the LSE as it is."""
    return (cut(res[0]), res[1]) if with_lse else cut(res)


def _splits(num_splits):
    return 0 if num_splits <= 0 else num_splits


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                    k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                    return_attn_probs=False):
    """q (batch, seqlen_q, nheads, headdim); k, v (batch, seqlen_k, nheads_k, headdim)."""
    _refuse_common(q, v, qv, q_descale, k_descale, v_descale, fp8=True)
    q, k, v = contiguous_last(q, k, v)
    q, k, v, softmax_scale, cut = pad_head_dim(q, k, v, softmax_scale)
    res = hipflash.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                   window_size=window(window_size), num_splits=_splits(num_splits),
                                   return_lse=bool(return_attn_probs),
                                   deterministic=deterministic, softcap=softcap_value(softcap),
                                   q_descale=q_descale, k_descale=k_descale,
                                   v_descale=v_descale, attention_chunk=attention_chunk)
    return _cut(res, cut, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None,
                              k_descale=None, v_descale=None, window_size=(-1, -1),
                              attention_chunk=0, softcap=0.0, deterministic=False,
                              num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """qkv (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, nheads_q + 2 nheads_k,
    headdim) with num_heads_q (GQA)."""
    if qkv.dim() == 5:
        q, k, v = split_qkv(qkv, 2)
    else:
        if num_heads_q is None:
            raise ValueError("a 4-d qkv (heads packed) needs num_heads_q")
        num_heads_k = (qkv.shape[2] - num_heads_q) // 2
        if 2 * num_heads_k + num_heads_q != qkv.shape[2] or num_heads_k <= 0:
            raise ValueError(f"qkv's {qkv.shape[2]} heads are not num_heads_q={num_heads_q} "
                             "plus twice the kv heads")
        q, k, v = qkv.split([num_heads_q, num_heads_k, num_heads_k], dim=2)
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale,
                           window_size, attention_chunk, softcap, 1, None, deterministic,
                           sm_margin, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           qv=None, q_descale=None, k_descale=None, v_descale=None,
                           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False):
    """q (total_q, nheads, headdim); k, v (total_k, nheads_k, headdim); the LSE (nheads,
    total_q)."""
    _refuse_common(q, v, qv, q_descale, k_descale, v_descale, fp8=True)
    q, k, v = contiguous_last(q, k, v)
    q, k, v, softmax_scale, cut = pad_head_dim(q, k, v, softmax_scale)
    res = hipflash.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale=softmax_scale, causal=causal, window_size=window(window_size),
        num_splits=_splits(num_splits), return_lse=bool(return_attn_probs), lse_layout="packed",
        deterministic=deterministic, softcap=softcap_value(softcap), seqused_q=seqused_q,
        seqused_k=seqused_k, attention_chunk=attention_chunk, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale)
    return _cut(res, cut, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                            cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                            rotary_interleaved=True, scheduler_metadata=None, num_splits=0,
                            pack_gqa=None, sm_margin=0, return_softmax_lse=False):
    """Attention against a KV cache (contiguous, or paged with page_table) after appending
    k / v in place at cache_seqlens (varlen queries: the packed rows of cu_seqlens_k_new).
    rotary_seqlens without rotary_cos is ignored, as FlashAttention 3 does."""
    if rotary_cos is None and rotary_sin is None:
        rotary_seqlens = None
    _refuse_common(q, v_cache, qv, q_descale, k_descale, v_descale)
    refuse_headdim(q, "against a KV cache")
    q, k, v = contiguous_last(q, k, v)
    # FlashAttention 3 makes its index tensors contiguous too (maybe_contiguous).
    cache_seqlens, cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new, \
        rotary_seqlens = (t.contiguous() if isinstance(t, torch.Tensor) else t
                          for t in (cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                                    cu_seqlens_q, cu_seqlens_k_new, rotary_seqlens))
    if cu_seqlens_q is not None:
        res = _varlen_kv.with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, cu_seqlens_q,
            cu_seqlens_k_new, max_seqlen_q, rotary_cos, rotary_sin, rotary_seqlens,
            bool(rotary_interleaved), softmax_scale, causal, window(window_size),
            _splits(num_splits),
            bool(return_softmax_lse), softcap_value(softcap), cache_leftpad, attention_chunk)
        return _with_accumulators(res, return_softmax_lse)
    refuse("cu_seqlens_k_new", cu_seqlens_k_new, None, "new keys of varlen queries only")
    if q.dtype == hipflash._E4M3:
        # FA3's fp8 KV-cache call (q, the cache and the new k / v in e4m3, no descales): q and
        # k / v widened to bfloat16 exactly (every e4m3 value is one), the cache read as
        # hipflash's fp8 cache with scales 1, out in bfloat16 as FA3's.
        q, k, v = (t.to(torch.bfloat16) if t is not None else None for t in (q, k, v))
    res = hipflash.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, block_table=page_table,
        softmax_scale=softmax_scale, causal=causal, window_size=window(window_size),
        num_splits=_splits(num_splits), return_lse=bool(return_softmax_lse),
        softcap=softcap_value(softcap), cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, rotary_seqlens=rotary_seqlens,
        attention_chunk=attention_chunk)
    return _with_accumulators(res, return_softmax_lse)


def _with_accumulators(res, with_lse):
    """FlashAttention 3's kvcache return: out, or (out, softmax_lse, out_accum, lse_accum), the
    split accumulators empty as upstream's are for a call it does not split (hipflash's splits
    are combined inside the call)."""
    if not with_lse:
        return res
    out, lse = res
    return out, lse, torch.empty(0, device=out.device), torch.empty(0, device=out.device)


def get_scheduler_metadata(*args, **kwargs):
    """FlashAttention 3's scheduler precomputation for flash_attn_with_kvcache: hipflash plans
    each call itself, so this returns None, which scheduler_metadata accepts (and ignores)."""
    return None


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None, return_lse=True):
    """Merges split results by their LSEs: out_partial (num_splits, batch, seqlen, nheads,
    headdim) or (num_splits, total, nheads, headdim), fp32; lse_partial (num_splits, batch,
    seqlen, nheads) or (num_splits, total, nheads). Returns out in out_dtype (default
    out_partial's) and, with return_lse, the merged LSE (batch, seqlen, nheads) or (total,
    nheads) fp32. The merge runs in fp32 (hipflash.merge_attn_states), then rounds once to
    out_dtype."""
    if out_partial.dim() not in (4, 5) or lse_partial.dim() != out_partial.dim() - 1:
        raise ValueError(f"out_partial {tuple(out_partial.shape)} and lse_partial "
                         f"{tuple(lse_partial.shape)} are not FA3's combine layouts")
    if out is not None and (not isinstance(out, torch.Tensor) or
                            tuple(out.shape) != tuple(out_partial.shape[1:]) or
                            out.device != out_partial.device):
        raise ValueError(f"out must be a tensor of shape {tuple(out_partial.shape[1:])} on "
                         f"{out_partial.device}, got "
                         f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out)}")
    lses = lse_partial.movedim(-1, -2)  # hipflash: the heads before the rows
    merged, lse = hipflash.merge_attn_states(out_partial, lses.contiguous())
    merged = merged.to(out_dtype or out_partial.dtype)
    lse = lse.movedim(-2, -1)
    if out is not None:
        out.copy_(merged)
        merged = out
    return (merged, lse) if return_lse else merged
