"""FlashAttention 2's Python API (``flash_attn.flash_attn_interface``, re-exported by
``flash_attn``), run by hipflash:

    import hipflash.compat.flash_attn as flash_attn
    out = flash_attn.flash_attn_func(q, k, v, causal=True)
    from hipflash.compat.flash_attn.flash_attn_interface import flash_attn_varlen_func

Function names, argument names and defaults as in flash-attn 2.x. Returns: ``out``; with
``return_attn_probs=True`` the triple ``(out, softmax_lse, S_dmask)`` — the LSE in
FlashAttention's layouts ([batch, nheads, seqlen] dense, [nheads, total_q] varlen), and S_dmask
empty, as FlashAttention's without dropout. Every head dim up to 256 runs, as in FlashAttention
2: those hipflash's kernels lack (80, 160, ...) zero-padded to the next they have
(compat._common.pad_head_dim), except against a KV cache or a paged one (refused by name: the
cache would be copied every call). q, k and v without a contiguous last dimension are copied, as
FlashAttention does; any negative window bound is unbounded. Refused with NotImplementedError:
dropout_p > 0 (flash_attn_with_kvcache's rotary embedding, cache_batch_idx and cache_leftpad
run). softcap and alibi_slopes run on CPU tensors and NVIDIA GPUs, forward and backward
(docs/compat.md).
"""
import hipflash

from .._common import (contiguous_last, pad_head_dim, refuse_dropout, refuse_headdim,
                      softcap_value, split_kv, split_qkv, window)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


def _result(q, res, cut, return_attn_probs):
    """out, or (out, softmax_lse, S_dmask): without dropout FlashAttention's S_dmask is empty."""
    if not return_attn_probs:
        return cut(res)
    return cut(res[0]), res[1], q.new_empty(0)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """q (batch, seqlen_q, nheads, headdim); k, v (batch, seqlen_k, nheads_k, headdim)."""
    refuse_dropout(dropout_p)
    q, k, v = contiguous_last(q, k, v)
    q, k, v, softmax_scale, cut = pad_head_dim(q, k, v, softmax_scale)
    res = hipflash.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                   window_size=window(window_size),
                                   return_lse=bool(return_attn_probs),
                                   deterministic=deterministic, softcap=softcap_value(softcap),
                                   alibi_slopes=alibi_slopes)
    return _result(q, res, cut, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    k, v = split_kv(kv, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv (batch, seqlen, 3, nheads, headdim)."""
    q, k, v = split_qkv(qkv, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """q (total_q, nheads, headdim); k, v (total_k, nheads_k, headdim), or a paged cache with
    block_table; the LSE (nheads, total_q)."""
    refuse_dropout(dropout_p)
    q, k, v = contiguous_last(q, k, v)
    if block_table is not None:
        refuse_headdim(q, "on a paged cache")
    q, k, v, softmax_scale, cut = pad_head_dim(q, k, v, softmax_scale)
    res = hipflash.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale=softmax_scale, causal=causal, window_size=window(window_size),
        return_lse=bool(return_attn_probs), lse_layout="packed", deterministic=deterministic,
        block_table=block_table, softcap=softcap_value(softcap), alibi_slopes=alibi_slopes)
    return _result(q, res, cut, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False):
    """kv (total_k, 2, nheads_k, headdim)."""
    k, v = split_kv(kv, 1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv (total, 3, nheads, headdim)."""
    q, k, v = split_qkv(qkv, 1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """Attention against a KV cache (contiguous, or paged with block_table) after appending
    k / v in place at cache_seqlens; returns out, and the LSE with return_softmax_lse."""
    refuse_headdim(q, "against a KV cache")
    q, k, v = contiguous_last(q, k, v)
    return hipflash.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table,
        softmax_scale=softmax_scale, causal=causal, window_size=window(window_size),
        num_splits=num_splits, return_lse=return_softmax_lse, softcap=softcap_value(softcap),
        alibi_slopes=alibi_slopes, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved)
